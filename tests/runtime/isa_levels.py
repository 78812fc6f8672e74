"""The native kernels at every ISA level of native.ISA_LEVELS, for tests: built for this CPU
where it has the level, else built on SIMDe (csrc/isa.h's SL_SIMDE_LEVEL: portable versions of
the AVX-512 intrinsics, slow, for correctness only) where SIMDe's headers are found, else a skip
that says how to get them. The emulated builds go through native's own _build, so they are cached
like the others, keyed by their flags. make_ops_at gives a whole model's ops at any level."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from servelab.runtime import native
from servelab.runtime.ops import Ops, make_ops

# csrc/isa.h's SL_SIMDE_LEVEL for each level that SIMDe can stand in for
SIMDE_LEVELS = {"avx512": 1, "avx512_vnni": 2, "avx512_bf16": 3}
_REPO = Path(__file__).resolve().parents[2]
_HOW = "run `make simde` (or install libsimde-dev) and set SERVELAB_SIMDE_INCLUDE to the folder holding simde/"
_CPU = torch.device("cpu")
_emulated: dict[str, native.NativeKernels] = {}


def simde_include() -> str | None:
    """The include folder holding simde/x86/avx512.h: $SERVELAB_SIMDE_INCLUDE, `make simde`'s
    .simde/usr/include, or /usr/include."""
    for folder in (os.environ.get("SERVELAB_SIMDE_INCLUDE"), _REPO / ".simde/usr/include", "/usr/include"):
        if folder and (Path(folder) / "simde/x86/avx512.h").is_file():
            return str(folder)
    return None


def emulated_level(name: str, include: str) -> native.IsaLevel:
    """Level `name` built on SIMDe: AVX2's flags (the SIMDe code runs on AVX2 vectors) plus the
    SL_SIMDE_LEVEL that turns the kernels' AVX-512 paths on."""
    flags = (*native._LEVELS["avx2"].cflags, f"-DSL_SIMDE_LEVEL={SIMDE_LEVELS[name]}", f"-I{include}")
    return native.IsaLevel(f"{name}-simde", flags, frozenset())


def fail_if_the_code_does_not_build(why: str | None) -> None:
    """Where the CPU has the level and the compiler ran, a failed build is the code's fault: the
    test fails instead of skipping (a missing compiler or CPU feature still skips)."""
    if why and " failed: " in why:
        pytest.fail(f"the native kernels do not build: {why}")


def kernels_at(name: str) -> tuple[native.NativeKernels | None, str]:
    """(kernels, how they run: "native" or "simde") for ISA level `name`, or (None, why not)."""
    reason = native.unavailable_reason(name)
    if reason is None:
        kernels = native.native_kernels(name)
        if kernels is None:
            fail_if_the_code_does_not_build(native.kernels_unavailable(name))
        return (kernels, "native") if kernels is not None else (None, native.kernels_unavailable(name) or "")
    if name not in SIMDE_LEVELS or "avx2" in reason or native.unavailable_reason("avx2") is not None:
        return None, reason  # SIMDe's builds need AVX2 underneath
    include = simde_include()
    if include is None:
        return None, f"{reason}, and SIMDe is not found to emulate it: {_HOW}"
    if name not in _emulated:  # a build that fails raises: with SIMDe there, it is the code's fault
        _emulated[name] = native._build(emulated_level(name, include))
    return _emulated[name], "simde"


def make_ops_at(name: str, monkeypatch: pytest.MonkeyPatch) -> Ops:
    """ops.make_ops(name) for an fp32 model on the CPU, its ISA level's kernels as kernels_at
    gives them: an emulated level goes through make_ops too, with native_kernels answering its
    SIMDe build for that level (for the test's duration). Skips, saying why, where it cannot run."""
    if name == "torch":
        return make_ops(name, _CPU, torch.float32)
    level = name.partition("-")[2]
    kernels, how = kernels_at(level)
    if kernels is None:
        pytest.skip(f"{name}: {how}")
    if how == "simde":
        real = native.native_kernels
        monkeypatch.setattr(native, "native_kernels", lambda lv=None: kernels if lv == level else real(lv))
    ops = make_ops(name, _CPU, torch.float32)
    assert ops.kernels is kernels
    return ops
