"""--hardware as a JSON or YAML file: parsing, validation errors, the shipped generic CPU."""

import json
import re
from dataclasses import asdict, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cost.memory import MemoryPlan
from servelab.errors import InvalidArgument
from servelab.spec import HARDWARE, get_hardware, get_model
from servelab.spec.hardware import hardware_ref
from servelab.spec.hardware_file import SHIPPED_DIR, shipped_files

CPU = {
    "name": "my-box",
    "memory_bytes": 64e9,
    "bandwidth_bytes_per_s": 80e9,
    "peak_flops": {"fp32": 1.2e12, "bf16": 2.4e12},
}


def write(tmp_path, data, name="box.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_file_gives_the_spec(tmp_path):
    hw = get_hardware(write(tmp_path, CPU))
    assert (hw.name, hw.memory_bytes, hw.bandwidth_bytes_per_s) == ("my-box", 64e9, 80e9)
    assert hw.peak_flops_per_s("fp32") == 1.2e12 and hw.ridge_flops_per_byte("bf16") == 30
    assert hw.interconnect_bytes_per_s is None and hw.price_per_hour_usd is None


def test_name_defaults_to_the_file_stem(tmp_path):
    assert (
        get_hardware(write(tmp_path, {k: v for k, v in CPU.items() if k != "name"}, "lab-host.json")).name == "lab-host"
    )


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(list(HARDWARE.values())),
    scale=st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
)
def test_every_catalog_entry_round_trips_through_a_file(tmp_path_factory, spec, scale):
    # a file holds the datasheet fields; measured kernels come only from the catalog's fits
    data = {k: v for k, v in asdict(replace(spec, kernels=None)).items() if k != "kernels"}
    data["bandwidth_bytes_per_s"] *= scale
    path = write(tmp_path_factory.mktemp("hw"), data)
    loaded = get_hardware(path)
    assert loaded.kernels is None
    assert {k: v for k, v in asdict(loaded).items() if k != "kernels"} == data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_bytes": None}, "missing field(s) 'memory_bytes'"),
        ({"peak_flops": None}, "missing field(s) 'peak_flops'"),
        ({"memory_bytes": -1}, "memory_bytes must be a positive number, got -1"),
        ({"memory_bytes": float("inf")}, "memory_bytes must be a positive number, got inf"),
        ({"bandwidth_bytes_per_s": "51.2e9"}, "bandwidth_bytes_per_s must be a positive number, got '51.2e9'"),
        ({"bandwidth_bytes_per_s": True}, "bandwidth_bytes_per_s must be a positive number"),
        ({"peak_flops": {"fp32": 1e12}}, "peak_flops needs 'bf16'"),
        (
            {"peak_flops": {"bf16": 1e12, "tf32": 2e12}},
            "peak_flops key 'tf32' is not a compute dtype; known: bf16, fp32, fp8, int8",
        ),
        ({"peak_flops": {"bf16": 0}}, "peak_flops.bf16 must be a positive number, got 0"),
        ({"peak_flops": [1e12]}, "peak_flops must be an object"),
        ({"cores": 8}, "unknown field(s) 'cores'; known: name, memory_bytes"),
        ({"interconnect_bytes_per_s": 0}, "interconnect_bytes_per_s must be a positive number, got 0"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_invalid_fields_are_named(tmp_path, change, message):
    data = {**CPU, **change}
    data = {k: v for k, v in data.items() if v is not None}
    path = write(tmp_path, data)
    with pytest.raises(InvalidArgument) as err:
        get_hardware(path)
    assert err.value.message.startswith(f"hardware file {path!r}: ")
    assert message in err.value.message
    assert err.value.param == "hardware"


def test_unreadable_files(tmp_path):
    with pytest.raises(InvalidArgument, match=r"box.json': invalid JSON: Expecting"):
        get_hardware(write(tmp_path, "{memory_bytes: 1}"))
    with pytest.raises(InvalidArgument, match=r"expected a mapping of HardwareSpec fields, got list"):
        get_hardware(write(tmp_path, "[]"))
    with pytest.raises(
        InvalidArgument, match=r"hardware file 'nope.json' not found \(shipped files: generic-cpu.json\)"
    ):
        get_hardware("nope.json")
    with pytest.raises(InvalidArgument, match=r"unknown hardware 'h300'; choose one of: h100-sxm.*generic-cpu.json"):
        get_hardware("h300")


def test_shipped_generic_cpu_is_found_by_file_name():
    assert "generic-cpu.json" in shipped_files()
    cpu = get_hardware("generic-cpu.json")
    assert cpu.name == "generic-cpu" and cpu.peak_flops["fp32"] > 0
    # 8 cores x 3 GHz x 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP; dual-channel DDR4-3200
    assert cpu.peak_flops["fp32"] == 8 * 3e9 * 2 * 8 * 2 and cpu.bandwidth_bytes_per_s == 2 * 8 * 3200e6
    assert hardware_ref("generic-cpu.json") == str(SHIPPED_DIR / "generic-cpu.json")
    assert hardware_ref("H200") == "h200"


def test_a_file_in_the_working_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, CPU, "generic-cpu.json")
    assert get_hardware("generic-cpu.json").name == "my-box"


def test_no_interconnect_refuses_tensor_parallelism():
    cpu = get_hardware("generic-cpu.json")
    model = get_model("llama-3.1-8b")
    assert MemoryPlan(model, cpu, tp=1).tp == 1
    with pytest.raises(
        InvalidArgument,
        match="tp=2 needs a device-to-device link, and generic-cpu has no interconnect_bytes_per_s; use tp=1",
    ):
        MemoryPlan(model, cpu, tp=2)


YAML_BOX = """\
# a box, as a person writes YAML: exponents without a dot or a sign
name: my-box
memory_bytes: 16e9
bandwidth_bytes_per_s: 40e9
peak_flops:
  fp32: 0.5e12
  bf16: 500000000000
"""


def test_yaml_file_reads_as_the_json_one(tmp_path):
    from_yaml = get_hardware(write(tmp_path, YAML_BOX, "box.yaml"))
    from_json = get_hardware(
        write(
            tmp_path,
            {
                "name": "my-box",
                "memory_bytes": 16e9,
                "bandwidth_bytes_per_s": 40e9,
                "peak_flops": {"fp32": 0.5e12, "bf16": 0.5e12},
            },
        )
    )
    assert from_yaml == from_json
    assert get_hardware(write(tmp_path, YAML_BOX, "box.yml")).bandwidth_bytes_per_s == 40e9


def test_yaml_errors_name_the_file_and_the_field_or_line(tmp_path):
    path = write(tmp_path, YAML_BOX.replace("bandwidth_bytes_per_s: 40e9", "bandwidth_bytes_per_s: fast"), "box.yaml")
    with pytest.raises(
        InvalidArgument,
        match=rf"hardware file {re.escape(repr(path))}: bandwidth_bytes_per_s must be a "
        r"positive number, got 'fast'",
    ):
        get_hardware(path)
    path = write(tmp_path, YAML_BOX + "peak_flop: {}\n", "box.yaml")
    with pytest.raises(InvalidArgument, match=r"unknown field\(s\) 'peak_flop'"):
        get_hardware(path)
    path = write(tmp_path, "name: [unclosed\nmemory_bytes: 1\n", "box.yaml")
    with pytest.raises(InvalidArgument, match=rf"hardware file {re.escape(repr(path))}: invalid YAML at line \d+"):
        get_hardware(path)
