import re
from pathlib import Path

import pytest

import servelab.spec.hardware as hardware_module
from servelab.errors import InvalidArgument
from servelab.spec import HARDWARE, get_hardware, kv_dtype, weight_dtype


def test_seed_figures_for_h100_h200_a100():
    h100 = get_hardware("h100-sxm")
    assert h100.memory_bytes == 80e9
    assert h100.bandwidth_bytes_per_s == 3.35e12
    assert h100.peak_flops["bf16"] == pytest.approx(989e12, rel=0.01)
    assert 280 <= h100.ridge_flops_per_byte("bf16") <= 310
    h200 = get_hardware("h200")
    assert (h200.memory_bytes, h200.bandwidth_bytes_per_s) == (141e9, 4.8e12)
    a100 = get_hardware("a100-80gb")
    assert a100.bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert a100.peak_flops["bf16"] == 312e12


def test_catalog_is_complete_and_consistent():
    assert {"h100-sxm", "h200", "a100-80gb", "l4", "l40s", "mi300x", "b200"} <= set(HARDWARE)
    for hw in HARDWARE.values():
        assert hw.memory_bytes > 0 and hw.bandwidth_bytes_per_s > 0 and hw.interconnect_bytes_per_s > 0
        assert hw.peak_flops["bf16"] > 0
        # 8-bit tensor cores run at twice the 16-bit rate on every part that has them
        for dtype in ("fp8", "int8"):
            if dtype in hw.peak_flops:
                assert hw.peak_flops[dtype] == pytest.approx(2 * hw.peak_flops["bf16"], rel=0.02)


def test_every_entry_cites_its_public_source():
    source = Path(hardware_module.__file__).read_text()
    for name in HARDWARE:
        before = source[: source.index(f'"{name}": HardwareSpec(')].splitlines()
        before.pop()  # the indentation in front of the entry itself
        comment = []
        while before and before[-1].strip().startswith("#"):
            comment.insert(0, before.pop().strip())
        assert re.search(r"(datasheet|spec) \((?:nvidia|amd)\.com/", " ".join(comment)), name


def test_missing_8bit_tensor_cores_fall_back_to_bf16():
    a100 = get_hardware("a100-80gb")
    assert a100.peak_flops_per_s("fp8") == a100.peak_flops["bf16"]
    assert get_hardware("h100-sxm").peak_flops_per_s("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)


def test_unknown_hardware_names_the_choices():
    with pytest.raises(InvalidArgument) as err:
        get_hardware("h300")
    assert "h300" in err.value.message and "h100-sxm" in err.value.message and "mi300x" in err.value.message


def test_dtypes():
    assert [weight_dtype(n).bytes_per_element for n in ("bf16", "fp16", "fp8", "int8", "int4")] == [2, 2, 1, 1, 0.5]
    assert weight_dtype("int4").compute_dtype == "bf16"  # weight-only: dequantized to bf16
    assert weight_dtype("fp8").compute_dtype == "fp8"
    assert kv_dtype("fp8").bytes_per_element == 1 and kv_dtype("bf16").bytes_per_element == 2
    with pytest.raises(InvalidArgument, match="int3.*bfloat16, float16, fp8, int8, int4"):
        weight_dtype("int3")
    with pytest.raises(InvalidArgument, match="int4.*bfloat16"):
        kv_dtype("int4")


def test_every_catalog_part_says_where_its_parameters_come_from():
    from servelab.spec.hardware import HARDWARE

    for name, hw in HARDWARE.items():
        assert hw.datasheet and "(" in hw.datasheet, f"{name}: no datasheet named"
        assert hw.provenance.endswith(f"memory, bandwidth, peaks and link from {hw.datasheet}")
        assert ("measured kernels" in hw.provenance) == (hw.kernels is not None), name
        assert hw.kernels is not None or "extrapolated" in hw.provenance, name


def test_a_hardware_file_names_itself_as_the_source_unless_it_cites_one(tmp_path):
    import json

    from servelab.spec.hardware import get_hardware

    body = {"memory_bytes": 32e9, "bandwidth_bytes_per_s": 51.2e9, "peak_flops": {"bf16": 768e9}}
    plain = tmp_path / "box.json"
    plain.write_text(json.dumps(body))
    assert get_hardware(str(plain)).provenance.endswith(f"from the hardware file {plain}")
    cited = tmp_path / "cited.json"
    cited.write_text(json.dumps({**body, "datasheet": "vendor sheet rev 3 (example.com)"}))
    assert "vendor sheet rev 3" in get_hardware(str(cited)).provenance
    cited.write_text(json.dumps({**body, "datasheet": ""}))
    with pytest.raises(InvalidArgument, match="datasheet"):
        get_hardware(str(cited))


def test_parts_of_one_architecture_share_their_measured_gemms(tmp_path):
    import json

    from servelab.spec.hardware import measured_gemm

    h100, h200, a100 = get_hardware("h100-sxm"), get_hardware("h200"), get_hardware("a100-80gb")
    assert h100.architecture == h200.architecture == "hopper" and a100.architecture == "ampere"
    assert measured_gemm(h100, "fp8") is h100.kernels.gemm["fp8"]  # its own first
    assert measured_gemm(h200, "fp8") is h200.kernels.gemm["fp8"]
    assert measured_gemm(a100, "fp8") is None and measured_gemm(get_hardware("l40s"), "bf16") is None
    body = {"memory_bytes": 80e9, "bandwidth_bytes_per_s": 3e12, "peak_flops": {"bf16": 1e15}}
    path = tmp_path / "part.json"
    # else the first catalog part of its architecture that measured it (the H100, before the H200)
    path.write_text(json.dumps({**body, "architecture": " Hopper "}))
    assert measured_gemm(get_hardware(str(path)), "fp8") is h100.kernels.gemm["fp8"]
    path.write_text(json.dumps({**body, "architecture": 9}))
    with pytest.raises(InvalidArgument, match="architecture"):
        get_hardware(str(path))
