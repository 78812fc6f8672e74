"""Speculative decoding in the simulator: the core Scheduler's verification entries, acceptance
drawn from the model, verification + draft priced; every request finishes with its full output,
no KV block leaks, runs repeat with a seed, and the crossover shows and moves with acceptance."""

from __future__ import annotations

import json

import pytest

from servelab.cli import main
from servelab.core.config import SchedulerConfig
from servelab.core.scheduler import Scheduler
from servelab.core.speculative import SpeculativeConfig
from servelab.cost.roofline import Roofline
from servelab.cost.speculative import Acceptance, DraftCost, SpeculativeCost, draft_cost
from servelab.errors import InvalidArgument
from servelab.sim import SimConfig, simulate
from servelab.sim.cluster import ClusterSim
from servelab.sim.runner import build_cost_model, scheduler_config
from servelab.sim.speculation_sweep import compare_speculation, crossover_concurrency
from servelab.sim.executor import SimExecutor
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler
from servelab.sim.speculative import RequestAcceptances, Speculation, SpeculativeSimExecutor
from servelab.spec.hardware import get_hardware
from servelab.spec.model import get_model
from servelab.workload import RequestSpec, WorkloadSpec
from servelab.workload.acceptance import AcceptanceProfile, RequestAcceptance, load_profile
from tests.scheduler_checks import check_block_manager

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
K = 4


def spec_config(alpha: float | None, **kw) -> SimConfig:
    if alpha is None:
        return SimConfig(**kw)
    return SimConfig(speculative=NGRAM, spec_acceptance=Acceptance.rate(alpha, K), **kw)


def run(alpha: float | None, concurrency: int = 1, n: int = 8, out: int = 129, seed: int = 0, **kw):
    workload = WorkloadSpec(num_requests=n, concurrency=concurrency, input_len="256", output_len=str(out), seed=seed)
    return simulate(spec_config(alpha, **kw), workload)


def test_only_speculative_runs_leave_the_implicit_decode_path():
    for alpha in (None, 0.5):
        config = spec_config(alpha)
        sim = ClusterSim({"mixed": (1, scheduler_config(config))}, build_cost_model(config),
                         speculation=config.speculation())  # fmt: skip
        replica = sim.replicas[0]
        if alpha is None:
            assert isinstance(replica.scheduler, ImplicitDecodeScheduler) and type(replica.executor) is SimExecutor
            assert sim.drafts is None
        else:
            assert type(replica.scheduler) is Scheduler and isinstance(replica.executor, SpeculativeSimExecutor)
            assert sim.drafts == [1] * K
    plain = run(None)
    assert plain.speculation is None and "speculation" not in plain.to_dict()


def test_zero_acceptance_wastes_only_the_verification():
    plain, spec = run(None), run(0.0)
    r = spec.speculation["realised"]
    assert r["num_accepted_tokens"] == 0 and r["tokens_per_verification"] == 1.0
    assert spec.summary.completed == plain.summary.completed == 8
    assert spec.summary.total_output_tokens == plain.summary.total_output_tokens
    assert spec.num_steps == plain.num_steps  # one token a step either way
    # each step now scores 5 positions and proposes: memory-bound at batch 1, so a little slower
    target = Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))
    cost = SpeculativeCost(target, DraftCost(SpeculativeConfig.parse(NGRAM)), Acceptance.rate(0.0, K)).row(1, 320)
    ratio = spec.summary.tpot_s.mean / plain.summary.tpot_s.mean
    assert 1.0 < ratio < 1.05
    assert ratio == pytest.approx(1 / cost.speedup, rel=0.01)


def test_full_acceptance_gives_k_plus_1_tokens_a_step_at_batch_1():
    plain, spec = run(None, n=4, out=501), run(1.0, n=4, out=501)
    r = spec.speculation["realised"]
    assert r["acceptance_rate"] > 0.99
    assert r["tokens_per_verification"] == pytest.approx(K + 1, rel=0.01)
    assert r["accepted_per_position"][0] == r["accepted_per_position"][-1]
    speedup = plain.summary.tpot_s.mean / spec.summary.tpot_s.mean
    assert speedup == pytest.approx(5.0, rel=0.05)


def test_realised_acceptance_follows_a_profile(tmp_path):
    profile = Acceptance((0.9, 0.6, 0.4, 0.2), "profile test")
    config = SimConfig(speculative=NGRAM, spec_acceptance=profile)
    result = simulate(config, WorkloadSpec(num_requests=16, concurrency=4, input_len="128", output_len="400"))
    r = result.speculation["realised"]
    counts = [r["num_drafts"], *r["accepted_per_position"]]
    measured = [b / a for a, b in zip(counts, counts[1:])]
    # verifications cut short at a request's end score fewer positions, so allow a little
    assert measured == pytest.approx([0.9, 0.6, 0.4, 0.2], abs=0.05)
    # the realised counters are a profile too: the format --spec-acceptance-profile reads
    path = tmp_path / "realised.json"
    path.write_text(json.dumps(r))
    again = load_profile(path)
    assert again.acceptance_per_position == pytest.approx(measured)
    assert result.speculation["acceptance"]["expected_tokens_per_verification"] == pytest.approx(
        profile.expected_tokens()
    )


def test_deterministic_with_a_seed():
    a, b, c = run(0.6, concurrency=4, seed=3), run(0.6, concurrency=4, seed=3), run(0.6, concurrency=4, seed=4)
    assert [list(r.token_times_s) for r in a.records] == [list(r.token_times_s) for r in b.records]
    assert a.speculation == b.speculation
    assert a.speculation["realised"] != c.speculation["realised"]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_request_finishes_and_no_block_leaks(prefix_caching):
    # A small pool: sequences are preempted while they hold draft slots.
    config = spec_config(
        0.7,
        scheduler=SchedulerConfig(num_blocks=96, block_size=16, max_num_seqs=16, enable_prefix_caching=prefix_caching),
    )
    sched = scheduler_config(config)
    speculation = config.speculation()
    sim = ClusterSim({"mixed": (2, sched)}, build_cost_model(config), seed=5, speculation=speculation)
    requests = [RequestSpec(i, None, 200 + 37 * (i % 5), 50 + 61 * (i % 7)) for i in range(40)]
    out = sim.run(requests, concurrency=24)
    assert len(out.records) == 40 and all(r.success for r in out.records)
    assert [r.output_tokens for r in sorted(out.records, key=lambda r: int(r.request_id))] == [
        r.output_tokens for r in requests
    ]
    assert sum(r.scheduler.num_preemptions for r in out.replicas) > 0
    for replica in out.replicas:
        bm = replica.scheduler.block_manager
        check_block_manager(bm)
        assert bm.num_used_blocks == 0
        assert not replica.scheduler.has_unfinished()


def test_crossover_appears_and_moves_out_with_acceptance():
    workload = WorkloadSpec(num_requests=1, input_len="128", output_len="64")
    crossovers = {}
    for alpha in (0.0, 0.3, 0.5):
        levels = compare_speculation(spec_config(alpha), workload, [1, 64, 128, 256])
        assert [lv.speedup for lv in levels] == sorted((lv.speedup for lv in levels), reverse=True)
        crossovers[alpha] = crossover_concurrency(levels)
    assert crossovers == {0.0: 1, 0.3: 64, 0.5: 128}


def test_a_draft_model_costs_its_passes_and_its_memory():
    config = SimConfig(
        speculative='{"model": "llama-3.2-1b", "num_speculative_tokens": 3}', spec_acceptance=Acceptance.rate(0.8, 3)
    )
    plain_blocks = scheduler_config(SimConfig()).num_blocks
    assert scheduler_config(config).num_blocks < plain_blocks
    result = simulate(config, WorkloadSpec(num_requests=4, concurrency=1, input_len="256", output_len="128"))
    assert result.speculation["draft_busy_s"] > 0.2 * sum(r["busy_s"] for r in result.replica_stats)
    assert "3 forward passes of the draft model llama-3.2-1b" in result.speculation["draft_step"]
    draft = draft_cost(config.spec_config, get_hardware("h100-sxm"), "bf16", "bf16").draft_model
    assert isinstance(draft, Roofline)


def test_under_a_profile_the_draft_is_the_profiled_model_or_refused():
    """A calibrated profile measured one model on one host: a draft that is that model runs its
    passes at the profile's step times (less the serving term); another draft is refused."""
    from servelab.cost.profile import ProfileStepCost

    profile = ProfileStepCost(per_step_s=3e-3, per_token_s=7e-4, per_seq_s=2e-4, per_context_token_s=1e-6,
                              per_pair_s=1e-9, server_per_step_s=5e-4, server_per_seq_s=1e-4)  # fmt: skip
    same = SimConfig(model="llama-3.2-1b", cost_model=profile,
                     speculative='{"model": "llama-3.2-1b", "num_speculative_tokens": 3}',
                     spec_acceptance=Acceptance.rate(0.8, 3))  # fmt: skip
    speculation = same.speculation()
    assert speculation is not None
    draft = speculation.draft
    # one decode row of the profile, without the serving term: per step + per token + per seq + context
    one = draft.draft_model.time_from_totals(1, 1, 100, 100)
    assert one == pytest.approx(3e-3 + 7e-4 + 2e-4 + 1e-4 + 1e-7)
    assert draft.time_s([], [(1, 100)]) > 2 * one  # K = 3 passes
    with pytest.raises(InvalidArgument, match="not the model the calibrated profile measured"):
        SimConfig(model="llama-3.1-8b", cost_model=profile,
                  speculative='{"model": "llama-3.2-1b", "num_speculative_tokens": 3}',
                  spec_acceptance=Acceptance.rate(0.8, 3)).speculation()  # fmt: skip


def test_bad_configs_are_refused():
    with pytest.raises(InvalidArgument, match="needs an acceptance model"):
        SimConfig(speculative=NGRAM)
    with pytest.raises(InvalidArgument, match="needs a speculative config"):
        SimConfig(spec_acceptance=Acceptance.rate(0.5, 4))
    with pytest.raises(InvalidArgument, match="colocated replicas"):
        SimConfig(speculative=NGRAM, spec_acceptance=Acceptance.rate(0.5, 4), disagg=(1, 1))
    with pytest.raises(InvalidArgument, match="covers 2 draft position"):
        SimConfig(speculative=NGRAM, spec_acceptance=Acceptance((0.5, 0.5), "profile x"))
    with pytest.raises(InvalidArgument, match="drop --rate"):
        compare_speculation(spec_config(0.5), WorkloadSpec(num_requests=4, rate=1.0), [1])


def test_compare_speculation_runs_under_the_callers_check():
    class Stop(Exception):
        pass

    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise Stop

    workload = WorkloadSpec(num_requests=1, input_len="256", output_len="512", seed=0)
    with pytest.raises(Stop):
        compare_speculation(spec_config(0.7), workload, [1, 16], check=check)
    assert len(calls) == 4  # the runs called it as they went, and its exception ended them


SIM = ["sim", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--input-len", "128", "--output-len", "64"]


def test_sim_cli_prints_the_speculation_and_its_realised_acceptance(capsys):
    args = [*SIM, "--concurrency", "2", "--num-requests", "6", "--no-progress"]
    assert main([*args, "--speculative-config", NGRAM, "--spec-acceptance", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: " in out and "2.77 tokens per verification step in expectation" in out
    assert "realised: " in out and "tokens per verification step" in out
    assert main([*args, "--json", "--speculative-config", NGRAM, "--spec-acceptance", "0.7"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["speculative_config"] == SpeculativeConfig.parse(NGRAM).to_json()
    assert 2.3 < data["speculation"]["realised"]["tokens_per_verification"] < 3.2
    assert data["speculation"]["acceptance"]["acceptance_per_position"] == [0.7] * 4


def test_sim_cli_compare_marks_the_crossover(capsys):
    args = [*SIM, "--speculative-config", NGRAM, "--spec-acceptance", "0.3", "--compare-speculation", "1,128"]
    assert main([*args, "--num-requests", "1"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "<- crossover" in line)
    assert line.split()[0] == "128"
    assert "speculation stops paying at concurrency 128" in out
    assert "the cost model's steady decode at context 160: crossover at batch" in out
    assert main([*args, "--num-requests", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["crossover_concurrency"] == 128 and [lv["concurrency"] for lv in data["levels"]] == [1, 128]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--compare-speculation", "1,4"], "--compare-speculation needs --speculative-config"),
        (
            [
                "--speculative-config",
                NGRAM,
                "--spec-acceptance",
                "0.5",
                "--compare-speculation",
                "1",
                "--concurrency",
                "2",
            ],
            "drop --concurrency",
        ),
        (
            ["--speculative-config", NGRAM, "--spec-acceptance", "0.5", "--disagg", "1:1", "--rate", "1"],
            "drop --disagg",
        ),
        (["--speculative-config", NGRAM, "--concurrency", "2"], "needs exactly one of --spec-acceptance"),
        (
            ["--speculative-config", NGRAM, "--spec-acceptance", "0.5", "--compare-speculation", "0"],
            "--compare-speculation",
        ),
    ],
)
def test_sim_cli_errors(capsys, extra, needle):
    assert main([*SIM, *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_plan_takes_the_same_flags(capsys):
    args = ["plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--slo-tpot", "5ms", "--input-len", "128",
            "--output-len", "32", "--max-concurrency", "16", "--num-requests", "40", "--workers", "1", "--json"]  # fmt: skip
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["speculative_config"] is None
    assert main([*args, "--speculative-config", NGRAM, "--spec-acceptance", "0.7"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["spec_acceptance"]["draft_acceptance_rate"] == pytest.approx(0.7 * (1 - 0.7**4) / 0.3 / 4)
    # plain decoding takes 7.2 ms a token even alone; 2.77 tokens a verification meet 5 ms
    assert plain["configs"][0]["capacity_concurrency"] is None
    assert spec["configs"][0]["capacity_concurrency"] >= 1
    assert main([*args, "--spec-acceptance", "0.7"]) == 2
    assert "--spec-acceptance needs --speculative-config" in capsys.readouterr().err


def test_speculation_record_is_json_ready():
    config = spec_config(0.5)
    speculation = config.speculation()
    assert isinstance(speculation, Speculation)
    json.dumps(speculation.describe())


def test_a_coverage_under_one_leaves_that_share_of_decode_steps_plain():
    # prompt lookup with no match proposes nothing: that step decodes one token, as without speculation
    full = SimConfig(speculative=NGRAM, spec_acceptance=Acceptance((0.8,) * K, "p"))
    part = SimConfig(speculative=NGRAM, spec_acceptance=Acceptance((0.8,) * K, "p", coverage=0.6))
    workload = WorkloadSpec(num_requests=8, concurrency=2, input_len="128", output_len="300", seed=1)
    a, b = simulate(full, workload), simulate(part, workload)
    assert a.summary.completed == b.summary.completed == 8
    ra, rb = a.speculation["realised"], b.speculation["realised"]
    steps = b.summary.total_output_tokens - 8 - rb["num_accepted_tokens"]  # first tokens come from prefill
    assert rb["num_drafts"] / steps == pytest.approx(0.6, abs=0.04)
    full_steps = a.summary.total_output_tokens - 8 - ra["num_accepted_tokens"]
    # every decode step verified but a request's last, where the length limit leaves no room for drafts
    assert full_steps - 8 <= ra["num_drafts"] < full_steps
    assert b.num_steps > a.num_steps and b.summary.tpot_s.mean > a.summary.tpot_s.mean
    assert b.speculation["acceptance"]["draft_coverage"] == 0.6
    assert b.speculation == simulate(part, workload).speculation  # which steps draft is seeded too


def _two_kinds_of_request(n: int) -> AcceptanceProfile:
    """A profile of requests that copy everything (every draft kept, every step drafting) and
    requests that never draft, half and half: pooled, a middling acceptance; per request, two kinds."""
    copier = RequestAcceptance(100, 100, 100 * K, (100,) * K)
    plain = RequestAcceptance(100, 0, 0, ())
    records = tuple(copier if i % 2 else plain for i in range(n))
    drafts = sum(r.num_drafts for r in records)
    return AcceptanceProfile(
        num_drafts=drafts,
        num_draft_tokens=drafts * K,
        num_accepted_tokens=drafts * K,
        accepted_per_position=(drafts,) * K,
        num_decode_steps=sum(r.num_decode_steps for r in records),
        per_request=records,
    )


def test_a_per_request_profile_gives_each_request_a_measured_requests_acceptance():
    profile = _two_kinds_of_request(20)
    mixed = Acceptance.from_profile(profile, "two kinds")
    assert mixed.coverage == pytest.approx(0.5) and mixed.per_position == (1.0,) * K
    assert sorted({(r.coverage, r.per_position) for r in mixed.per_request}) == [(0.0, (1.0,) * K), (1.0, (1.0,) * K)]
    pooled = Acceptance(mixed.per_position, "pooled", mixed.coverage)
    workload = WorkloadSpec(num_requests=24, concurrency=4, input_len="128", output_len="200", seed=2)
    a = simulate(SimConfig(speculative=NGRAM, spec_acceptance=mixed), workload)
    b = simulate(SimConfig(speculative=NGRAM, spec_acceptance=pooled), workload)
    assert a.summary.completed == b.summary.completed == 24
    # pooled, every request drafts on half its steps; per request, a request drafts always or never
    tpots = sorted(r.tpot_s for r in a.records)
    assert tpots[-1] / tpots[0] > 3.0
    spread_pooled = sorted(r.tpot_s for r in b.records)
    assert spread_pooled[-1] / spread_pooled[0] < 1.5
    # per request, a copier drafts at every decode step and keeps all K; the others never draft
    r = a.speculation["realised"]
    assert r["num_drafts"] > 0 and r["num_accepted_tokens"] == r["num_draft_tokens"]
    assert a.speculation == simulate(SimConfig(speculative=NGRAM, spec_acceptance=mixed), workload).speculation
    assert a.speculation["acceptance"]["requests_measured"] == 20


def test_a_request_keeps_its_draw_and_positions_it_never_reached_take_the_pooled_rate():
    profile = AcceptanceProfile(
        num_drafts=10,
        num_draft_tokens=40,
        num_accepted_tokens=20,
        accepted_per_position=(8, 6, 4, 2),
        per_request=(RequestAcceptance(12, 10, 40, (8, 6, 4, 2)), RequestAcceptance(5, 2, 8, (0, 0, 0, 0)),
                     RequestAcceptance(0, 0, 0, ())),
    )  # fmt: skip
    acceptance = Acceptance.from_profile(profile, "p")
    # the request with no decode step is left out; the one that never kept a draft rejects position
    # 0 and has the pooled rates after it
    assert len(acceptance.per_request) == 2
    assert acceptance.per_request[1].per_position == (0.0, 0.75, 2 / 3, 0.5)
    assert acceptance.per_request[1].coverage == 0.4
    assert acceptance.for_k(2).per_request[0].per_position == (0.8, 0.75)
    draws = RequestAcceptances(acceptance, seed=0)
    assert all(draws("r7") is draws("r7") for _ in range(3))
    assert {id(draws(f"r{i}")) for i in range(40)} == {id(r) for r in acceptance.per_request}
    assert RequestAcceptances(Acceptance.rate(0.5, K), 0)("any").per_position == (0.5,) * K
