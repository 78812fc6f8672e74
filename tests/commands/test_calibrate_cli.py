"""`servelab calibrate` on a tiny random model writes a profile; `sim`/`plan`/`roofline --profile` use it."""

import json

import pytest

from servelab.cli import main
from servelab.commands import calibrate
from servelab.cost.profile import TERMS, load_profile

COEFS = {"per_step_s": 0.002, "per_token_s": 5e-5, "per_seq_s": 1e-4, "per_context_token_s": 2e-7, "per_pair_s": 1e-8}


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {"format": "servelab-profile", "version": 1, "model": "smollm2-135m", "fit": {"coefficients": COEFS}}
        )
    )
    return str(path)


def test_calibrate_tiny_model_writes_a_valid_profile(tmp_path, monkeypatch, capsys):
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    tiny = calibrate.Grid(
        chunk=32, prefill_lens=(8, 32, 64), decode_batches=(1, 4), decode_contexts=(16, 48), decode_steps=3, repeats=2,
        verify_batches=(1, 3), verify_contexts=(24,),
    )  # fmt: skip
    monkeypatch.setitem(calibrate.GRIDS, "coarse", tiny)
    out = tmp_path / "p.json"
    # a tiny model's steps are too short to time well on a shared host: accept any fit here
    assert (
        main(
            ["calibrate", "--model", str(model), "--dtype", "float32", "--out", str(out), "--max-heldout-error", "1e9"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "held-out error" in text and "median of 2 interleaved passes" in text and "per-shape spread" in text
    profile = load_profile(str(out))
    fit = profile["fit"]
    assert set(fit["coefficients"]) == set(TERMS)
    c = fit["coefficients"]
    assert all(v >= 0 for v in c.values())
    # on a tiny, noisy grid the fixed cost may land in per_step or per_seq, but a batch-1 step costs time
    assert c["per_step_s"] + c["per_seq_s"] + c["per_token_s"] > 0
    assert fit["heldout"]["count"] >= 3 and fit["heldout"]["median_abs_pct"] >= 0
    assert profile["host"]["cpu"] and profile["dtype"] == "float32" and profile["kv_cache_dtype"] == "float32"
    ms = profile["measurements"]
    # prefill chunks (64 tokens in chunks of 32), decode batches of 4 and a mixed step are all there
    assert any(m["num_tokens"] == 32 and m["context_tokens"] == 64 for m in ms)
    assert any(m["num_seqs"] == 4 and m["num_tokens"] == 4 for m in ms)
    assert any(m["num_seqs"] > 1 and m["num_tokens"] > m["num_seqs"] for m in ms)
    # the whole batch decodes together once prefilled (decode-only steps, the engine's one-call path),
    # at the long context too, and a fresh prompt joins a full decode batch (4 decodes + a chunk)
    for context in (16, 48):
        assert any(m["num_tokens"] == m["num_seqs"] == 4 and m["context_tokens"] > 4 * context for m in ms), context
    assert any(m["num_seqs"] == 5 and m["num_tokens"] > 5 and m["context_tokens"] > 4 * 48 for m in ms)
    # verification steps: each sequence's greedy output, as its prediction, verified K + 1 rows at a
    # time, every row computing logits (the decode stack's path, priced as such by the fit)
    k = calibrate.DEFAULT_PREDICTION_TOKENS
    verified = [m for m in ms if m["logit_rows"] == m["num_tokens"] > m["num_seqs"]]
    assert {m["num_seqs"] for m in verified} == {1, 3}
    assert all(
        m["num_tokens"] == (k + 1) * m["num_seqs"] and m["context_tokens"] > 24 * m["num_seqs"] for m in verified
    )
    assert sum(m["num_seqs"] == 3 for m in verified) >= 2
    assert all(m["time_s"] > 0 for m in ms)
    assert all(len(m["samples_s"]) == 2 and m["time_s"] == pytest.approx(sum(m["samples_s"]) / 2) for m in ms)
    noise = profile["host_noise"]
    assert noise["cpus"] and noise["spread_median_pct"] >= 0 and isinstance(noise["noisy"], bool)
    # dense fp32 linears run one kernel at every row count: no kernel switches, no terms for them
    assert profile["kernel_rows"] is None
    assert c["per_wide_step_s"] == c["per_dense_step_s"] == c["per_dense_token_s"] == 0.0
    assert profile["step_time_statistic"] == "median of the interleaved passes"


def test_the_coarse_grid_times_the_steps_a_served_engine_runs():
    # serve's budget (2048 tokens): 16 prompts of 128 prefill in one step at concurrency 16, and a
    # prompt joins a few decodes whole (past the packed kernels' 128 rows) at concurrency 4 or a rate
    grid = calibrate.GRIDS["coarse"]
    budget = calibrate.serving_budget()
    plan = calibrate.scenarios(grid, 8192)
    together = [sc for sc in plan if sc.budget == budget and not sc.late and not sc.predicted]
    assert max(len(sc.prompts) * grid.chunk for sc in together) == budget
    assert {len(sc.prompts) for sc in together} == set(grid.together)
    joined = [len(sc.prompts) + sum(n for n, _ in sc.late) for sc in plan if sc.budget == budget and sc.late]
    assert joined and all(rows > grid.chunk for rows in joined)
    # the grid's own scenarios keep the chunked budget (many mixed steps of one chunk); the
    # verification scenarios prefill their whole batch in one step, then verify together
    verify = [sc for sc in plan if sc.predicted]
    assert len(verify) == len(grid.verify_batches) * len(grid.verify_contexts)
    assert all(sc.budget >= sum(n for n, _ in sc.prompts) for sc in verify)
    assert sum(sc.budget is None for sc in plan) == len(plan) - len(together) - len(joined) - len(verify)
    # a grid of prompts only (no decode batches) still plans
    only = calibrate.Grid(
        chunk=128,
        prefill_lens=(128,),
        decode_batches=(),
        decode_contexts=(32,),
        decode_steps=3,
        repeats=1,
        together=(2,),
    )
    assert [len(sc.prompts) for sc in calibrate.scenarios(only, 8192)] == [1, 2]


def test_calibrate_times_steps_at_the_serving_budget_and_by_the_fastest_pass(tmp_path, monkeypatch, capsys):
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    tiny = calibrate.Grid(
        chunk=32,
        prefill_lens=(8, 32),
        decode_batches=(1, 4),
        decode_contexts=(16,),
        decode_steps=2,
        repeats=3,
        together=(2, 4),
        joined_batches=(1, 3),
    )
    monkeypatch.setitem(calibrate.GRIDS, "coarse", tiny)
    monkeypatch.setattr(calibrate, "serving_budget", lambda: 128)
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model),
                "--dtype",
                "float32",
                "--out",
                str(out),
                "--max-heldout-error",
                "1e9",
                "--step-time-statistic",
                "fastest",
            ]
        )
        == 0
    )
    assert "fastest of 3 interleaved passes" in capsys.readouterr().out
    profile = load_profile(str(out))
    ms = profile["measurements"]
    # 4 prompts of 32 in one step of the whole 128-token budget; 1 and 3 decodes beside a whole prompt
    assert any(m["num_tokens"] == 128 and m["num_seqs"] == 4 for m in ms)
    assert {m["num_tokens"] for m in ms if m["num_seqs"] in (2, 4) and m["num_tokens"] - m["num_seqs"] == 32 - 1} == {
        33,
        35,
    }
    assert max(m["num_tokens"] for m in ms if m["num_seqs"] == 1) <= 32  # the chunked scenarios' budget holds
    assert all(m["time_s"] == min(m["samples_s"]) for m in ms)
    assert profile["step_time_statistic"] == "fastest of the interleaved passes"
    assert profile["serving_budget_tokens"] == 128


def test_calibrate_refuses_a_fit_that_misses_its_held_out_steps(tmp_path, monkeypatch, capsys):
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    rng = __import__("random").Random(0)
    # times unrelated to the shapes: no linear model predicts them
    junk = [
        {
            "num_tokens": n,
            "num_seqs": 1,
            "context_tokens": n,
            "pairs": n * (n + 1) // 2,
            "samples_s": [t, t * 1.5],
            "time_s": t,
            "spread_pct": 50.0,
        }
        for n, t in ((rng.randrange(1, 200), rng.uniform(1e-3, 1.0)) for _ in range(40))
    ]
    monkeypatch.setattr(calibrate, "measure", lambda engine, grid, before_pass=None, statistic="fastest": junk)
    out = tmp_path / "p.json"
    args = ["calibrate", "--model", str(model), "--dtype", "float32", "--out", str(out)]
    assert main([*args, "--max-heldout-error", "15"]) == 1
    err = capsys.readouterr().err
    assert "above --max-heldout-error 15%" in err and f"not writing {out}" in err and "per-shape spread" in err
    assert not out.exists()
    assert main([*args, "--max-heldout-error", "1e9"]) == 0 and out.exists()
    assert main([*args, "--max-heldout-error", "0"]) == 2
    assert "--max-heldout-error must be > 0" in capsys.readouterr().err


def test_sim_profile_prices_each_step_by_the_formula(profile_file, tmp_path):
    records = tmp_path / "r.jsonl"
    assert (
        main(
            [
                "sim",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--profile",
                profile_file,
                "--concurrency",
                "1",
                "--num-requests",
                "1",
                "--input-len",
                "100",
                "--output-len",
                "3",
                "--requests-out",
                str(records),
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads(records.read_text())
    c = COEFS
    prefill = (
        c["per_step_s"]
        + 100 * c["per_token_s"]
        + c["per_seq_s"]
        + 100 * c["per_context_token_s"]
        + (100 * 100 - 100 * 99 // 2) * c["per_pair_s"]
    )
    decode = c["per_step_s"] + c["per_token_s"] + c["per_seq_s"] + 101 * (c["per_context_token_s"] + c["per_pair_s"])
    assert r["ttft_s"] == pytest.approx(prefill, rel=1e-9)
    assert r["token_times_s"][1] - r["token_times_s"][0] == pytest.approx(decode, rel=1e-9)


def test_sim_prices_prefill_and_decode_only_steps_by_path_and_says_so(tmp_path, capsys):
    # the revised form: prefill steps pay per_prefill_step_s, every step the serving term's parts
    extra = {"per_prefill_step_s": 3e-3}
    serving = {"per_step_s": 1e-3, "per_seq_s": 2e-4}
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "format": "servelab-profile",
                "version": 1,
                "model": "smollm2-135m",
                "fit": {"coefficients": {**COEFS, **extra}},
                "server": serving,
            }
        )
    )
    records = tmp_path / "r.jsonl"
    assert (
        main(
            [
                "sim",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--profile",
                str(path),
                "--concurrency",
                "1",
                "--num-requests",
                "1",
                "--input-len",
                "100",
                "--output-len",
                "3",
                "--requests-out",
                str(records),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        f"steps priced by {path}: calibrated profile (prefill steps +3.00 ms over decode-only ones; "
        f"serving term 1.00 ms per step + 0.20 ms per sequence)"
    ) in out
    r = json.loads(records.read_text())
    c = COEFS
    prefill = (
        c["per_step_s"]
        + 100 * c["per_token_s"]
        + c["per_seq_s"]
        + 100 * c["per_context_token_s"]
        + (100 * 100 - 100 * 99 // 2) * c["per_pair_s"]
    )
    decode = c["per_step_s"] + c["per_token_s"] + c["per_seq_s"] + 101 * (c["per_context_token_s"] + c["per_pair_s"])
    served = serving["per_step_s"] + serving["per_seq_s"]
    assert r["ttft_s"] == pytest.approx(prefill + extra["per_prefill_step_s"] + served, rel=1e-9)
    assert r["token_times_s"][1] - r["token_times_s"][0] == pytest.approx(decode + served, rel=1e-9)
    assert (
        main(
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--profile",
                str(path),
                "--slo-tpot",
                "10ms",
                "--input-len",
                "64",
                "--output-len",
                "8",
                "--num-requests",
                "10",
                "--max-concurrency",
                "2",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "serving term 1.00 ms per step + 0.20 ms per sequence" in capsys.readouterr().out


def test_roofline_and_plan_take_a_profile(profile_file, capsys):
    assert (
        main(
            [
                "roofline",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--batch",
                "1,4",
                "--context",
                "100",
                "--profile",
                profile_file,
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    c = COEFS
    expected = c["per_step_s"] + 4 * (
        c["per_token_s"] + c["per_seq_s"] + 100 * (c["per_context_token_s"] + c["per_pair_s"])
    )
    assert rows[1]["profile_step_time_s"] == pytest.approx(expected, rel=1e-12)
    assert (
        main(
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--profile",
                profile_file,
                "--slo-tpot",
                "10ms",
                "--input-len",
                "64",
                "--output-len",
                "8",
                "--num-requests",
                "20",
                "--max-concurrency",
                "8",
                "--workers",
                "1",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["cost_model"] == "calibrated profile (one form for decode-only and prefill steps; no serving term)"
    row = plan["configs"][0]
    # the profile's decode step at batch 1 is ~2.2 ms: within a 10 ms TPOT target, so capacity > 1
    assert row["tpot_s"] is not None and row["tpot_s"] <= 0.010 and row["capacity_concurrency"] >= 1


@pytest.mark.parametrize(
    "cmd",
    [
        [
            "sim",
            "--model",
            "smollm2-135m",
            "--hardware",
            "generic-cpu.json",
            "--concurrency",
            "1",
            "--num-requests",
            "1",
        ],
        ["roofline", "--model", "smollm2-135m", "--hardware", "generic-cpu.json"],
        ["plan", "--model", "smollm2-135m", "--hardware", "generic-cpu.json", "--slo-tpot", "10ms"],
    ],
)
def test_bad_profile_is_a_clear_cli_error(cmd, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "servelab-profile", "version": 1, "fit": {"coefficients": {}}}))
    assert main([*cmd, "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--profile {bad}" in err and "lacks per_step_s" in err


def test_calibrate_refuses_an_unwritable_out(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "no" / "dir" / "p.json")]) == 2
    assert "--out" in capsys.readouterr().err


def test_calibrate_refuses_a_hardware_out_that_hardware_would_not_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--out", "p.json", "--hardware-out", "x.txt"]) == 2  # refused before any timing
    err = capsys.readouterr().err
    assert "--hardware-out 'x.txt'" in err and "FILE.json" in err and not (tmp_path / "x.txt").exists()
    # the hint `use it with --hardware NAME.json` works for a bare name in the current folder
    from servelab.spec.hardware_file import SHIPPED_DIR

    (tmp_path / "mine.json").write_text((SHIPPED_DIR / "generic-cpu.json").read_text())
    assert main(["roofline", "--model", "smollm2-135m", "--hardware", "mine.json", "--batch", "1", "--json"]) == 0


def test_calibrate_writes_a_hardware_file_for_this_host(tmp_path, monkeypatch, capsys):
    from servelab.runtime import host_probe
    from tests.tiny_models import write_tiny_llama
    from servelab.spec.hardware_file import load_hardware_file

    model = write_tiny_llama(tmp_path / "tiny")
    tiny = calibrate.Grid(
        chunk=32, prefill_lens=(8, 32), decode_batches=(1, 2), decode_contexts=(16,), decode_steps=2, repeats=1
    )
    monkeypatch.setitem(calibrate.GRIDS, "coarse", tiny)
    real_probe = host_probe.probe_hardware
    monkeypatch.setattr(
        host_probe,
        "probe_hardware",
        lambda name, description: real_probe(name, description, size_bytes=16 << 20, sizes=(128, 256), repeats=2),
    )
    hw = tmp_path / "host.yaml"  # written as YAML, read back by --hardware
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model),
                "--dtype",
                "float32",
                "--out",
                str(tmp_path / "p.json"),
                "--hardware-out",
                str(hw),
                "--max-heldout-error",
                "1e9",
            ]
        )
        == 0
    )
    assert f"use it with --hardware {hw}" in capsys.readouterr().out
    spec = load_hardware_file(str(hw))
    assert spec.name.startswith("host-")
    # a 2015 laptop to a big server: the probe measured something real, in the right units
    assert 1e9 < spec.bandwidth_bytes_per_s < 5e12 and 1e9 < spec.memory_bytes < 1e14
    assert 1e8 < spec.peak_flops["fp32"] < 1e15 and spec.peak_flops["bf16"] >= spec.peak_flops["fp32"]
    # and the cost model takes it
    assert (
        main(
            [
                "roofline",
                "--model",
                "smollm2-135m",
                "--hardware",
                str(hw),
                "--dtype",
                "fp32",
                "--kv-dtype",
                "fp32",
                "--batch",
                "1",
                "--json",
            ]
        )
        == 0
    )


def test_calibrate_refuses_cuda_without_a_device(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "calibrate --device cuda" in err and "sees no CUDA device" in err and not (tmp_path / "p.json").exists()


def test_sim_refuses_a_tp_the_profile_cannot_price(profile_file, capsys):
    assert (
        main(
            [
                "sim",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--profile",
                profile_file,
                "--tp",
                "3",
                "--concurrency",
                "1",
                "--num-requests",
                "1",
            ]
        )
        == 2
    )
    assert "has no TP term" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_with_tensor_parallel_writes_the_tp_term(tmp_path, monkeypatch, capsys):
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    tiny = calibrate.Grid(
        chunk=32, prefill_lens=(8, 32), decode_batches=(1, 2), decode_contexts=(16,), decode_steps=2, repeats=1
    )
    monkeypatch.setitem(calibrate.GRIDS, "coarse", tiny)
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model),
                "--dtype",
                "float32",
                "--out",
                str(out),
                "--tensor-parallel-size",
                "2",
                "--max-heldout-error",
                "1e9",
            ]
        )
        == 0
    )
    assert "tp term, gloo all-reduce among 2 ranks" in capsys.readouterr().out
    profile = load_profile(str(out))
    term = profile["tp"]
    assert profile["engine_flags"]["tensor_parallel_size"] == 2 and term["ranks"] == 2
    assert term["allreduce_latency_s"] > 0 and len(term["measurements"]) == 5
    assert term["compute_scales_with_ranks"] is False
    # the profile prices TP=1 too: its all-reduces taken out, so a step is cheaper
    from servelab.cost.profile import profile_step_cost

    shape = [(1, 40)] * 2
    assert profile_step_cost(profile, 1).step_time_s(shape) <= profile_step_cost(profile, 2).step_time_s(shape)


def test_wait_for_quiet_waits_for_a_quiet_window_or_gives_up(monkeypatch):
    from servelab.runtime import host_probe

    loads = iter([1.5, 0.9, 0.1, 1.8, 1.8, 1.8, 1.8])
    clock = [0.0]

    class Meter:
        def other_cpus(self):
            return next(loads)

    monkeypatch.setattr(host_probe, "OtherLoadMeter", Meter)
    monkeypatch.setattr(calibrate.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    assert calibrate.wait_for_quiet(0) == {"waited_s": 0.0, "other_cpus": None}
    assert calibrate.wait_for_quiet(60) == {"waited_s": 3 * calibrate.QUIET_WINDOW_S, "other_cpus": 0.1}
    clock[0] = 0.0
    assert calibrate.wait_for_quiet(2.5) == {"waited_s": 3.0, "other_cpus": 1.8}  # gave up: noisy all along


@pytest.mark.slow
def test_kernel_rows_come_from_the_linears_the_engine_loaded():
    # the bundled model keeps its Q4_1 blocks packed: the switches are block_quant's; in
    # deterministic mode every row count runs the panel kernel, so there is no switch to price
    from servelab.runtime import block_quant
    from servelab.engine.bundled import bundled_model_path
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    try:
        path = str(bundled_model_path())
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bundled model unavailable: {e}")
    found = []
    for deterministic in (False, True):
        engine = LLMEngine.from_args(
            EngineArgs.from_kwargs(model=path, dtype="float32", max_model_len=256, deterministic=deterministic)
        )
        try:
            found.append(calibrate.kernel_rows_of(engine))
        finally:
            engine.close()
    packed, invariant = found
    assert packed is not None and "Q4_1" in packed["linears"]
    from servelab.runtime import native

    # past max_rows: MKL up to AVX2, the k-major panel at the AVX-512 levels
    want = (block_quant.FUSED_MAX_ROWS, block_quant.same_order_max_rows(native.native_kernels()))
    assert (packed["fused_max_rows"], packed["max_rows"]) == want
    assert invariant is None


def test_calibrate_refuses_an_unknown_sim_model_before_timing(tmp_path, monkeypatch, capsys):
    from tests.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny")
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("timed steps for a bad --sim-model"))
    out = tmp_path / "p.json"
    args = ["calibrate", "--model", str(model), "--out", str(out), "--server-term", "--sim-model", "llama-9"]
    assert main(args) == 2
    assert "unknown model 'llama-9'" in capsys.readouterr().err and not out.exists()
