"""Hardware described in a JSON file instead of the catalog: the HardwareSpec fields, in the same
units (bytes, bytes/s, FLOP/s), as JSON or YAML (by the file's extension). Files shipped with
servelab (hardware_files/) are found by their file name alone, e.g. `--hardware generic-cpu.json`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from servelab.errors import InvalidArgument
from servelab.spec.dtypes import KV_DTYPES, WEIGHT_DTYPES
from servelab.spec.hardware_spec import HardwareSpec

SHIPPED_DIR = Path(__file__).with_name("hardware_files")

# The cost model falls back to "bf16" for any compute dtype a part lacks (see HardwareSpec).
REQUIRED_PEAK = "bf16"


YAML_SUFFIXES = (".yaml", ".yml")
SUFFIXES = (".json", *YAML_SUFFIXES)  # a --hardware value with one of these is a file, wherever it is


def is_hardware_file(text: str) -> bool:
    """A --hardware value names a file (not a catalog entry) when it looks like one."""
    return text.lower().endswith(SUFFIXES) or "/" in text or "\\" in text


def shipped_files() -> list[str]:
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if p.suffix.lower() in SUFFIXES)


def resolve_path(text: str) -> Path:
    path = Path(text).expanduser()
    if path.is_file():
        return path
    shipped = SHIPPED_DIR / text
    if path.name == text and shipped.is_file():
        return shipped
    raise InvalidArgument(
        f"hardware file {text!r} not found (shipped files: {', '.join(shipped_files()) or 'none'})", param="hardware"
    )


def load_hardware_file(text: str) -> HardwareSpec:
    path = resolve_path(text)
    try:
        raw = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"hardware file {str(path)!r}: cannot read it ({exc})", param="hardware") from None
    data = _parse_yaml(raw, path) if path.suffix.lower() in YAML_SUFFIXES else _parse_json(raw, path)
    return parse_hardware(data, source=str(path), default_name=path.stem)


def _parse_json(raw: str, path: Path) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"hardware file {str(path)!r}: invalid JSON: {exc}", param="hardware") from None


def _parse_yaml(raw: str, path: Path) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        """YAML 1.1 reads `40e9` (no dot, no exponent sign) as text; a hardware file means a number."""

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$|^[-+]?(?:[0-9][0-9_]*)\.[0-9_]*$"),
        list("-+0123456789."),
    )
    try:
        return yaml.load(raw, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidArgument(
            f"hardware file {str(path)!r}: invalid YAML{where}: {problem}", param="hardware"
        ) from None


def parse_hardware(data: Any, *, source: str, default_name: str) -> HardwareSpec:
    """Validate a decoded hardware file; every error names the file and the field."""

    def fail(what: str) -> InvalidArgument:
        return InvalidArgument(f"hardware file {source!r}: {what}", param="hardware")

    if not isinstance(data, dict):
        raise fail(f"expected a mapping of HardwareSpec fields, got {type(data).__name__}")
    # measured kernels come from benchmarks/gpu_kernels_fit.py, not from a hand-written file
    spec_fields = {f.name: f for f in fields(HardwareSpec) if f.name != "kernels"}
    unknown = sorted(set(data) - set(spec_fields))
    if unknown:
        raise fail(f"unknown field(s) {', '.join(map(repr, unknown))}; known: {', '.join(spec_fields)}")
    required = [
        n for n, f in spec_fields.items() if f.default is MISSING and f.default_factory is MISSING and n != "name"
    ]
    missing = [n for n in required if n not in data]
    if missing:
        raise fail(f"missing field(s) {', '.join(map(repr, missing))}")

    def positive(field: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise fail(f"{field} must be a positive number, got {value!r}")
        return float(value)

    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise fail(f"name must be a non-empty string, got {name!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail(f"description must be a string, got {description!r}")
    datasheet = data.get("datasheet", f"the hardware file {source}")
    if not isinstance(datasheet, str) or not datasheet.strip():
        raise fail(f"datasheet must be a non-empty string (where the figures come from), got {datasheet!r}")
    architecture = data.get("architecture", "")
    if not isinstance(architecture, str):
        raise fail(f"architecture must be a string (e.g. 'hopper'), got {architecture!r}")
    peaks = data["peak_flops"]
    if not isinstance(peaks, dict):
        raise fail(f"peak_flops must be an object of compute dtype -> FLOP/s, got {peaks!r}")
    compute_dtypes = sorted({d.compute_dtype for d in (*WEIGHT_DTYPES.values(), *KV_DTYPES.values())})
    for key in peaks:
        if key not in compute_dtypes:
            raise fail(f"peak_flops key {key!r} is not a compute dtype; known: {', '.join(compute_dtypes)}")
    if REQUIRED_PEAK not in peaks:
        raise fail(
            f"peak_flops needs {REQUIRED_PEAK!r} (the 16-bit matmul rate; on a CPU without native bf16, its fp32 rate)"
        )

    def optional(field: str) -> float | None:
        return None if data.get(field) is None else positive(field, data[field])

    return HardwareSpec(
        name=name.strip(),
        memory_bytes=positive("memory_bytes", data["memory_bytes"]),
        bandwidth_bytes_per_s=positive("bandwidth_bytes_per_s", data["bandwidth_bytes_per_s"]),
        peak_flops={k: positive(f"peak_flops.{k}", v) for k, v in peaks.items()},
        description=description,
        datasheet=datasheet,
        architecture=architecture.strip().lower(),
        interconnect_bytes_per_s=optional("interconnect_bytes_per_s"),
        price_per_hour_usd=optional("price_per_hour_usd"),
    )
