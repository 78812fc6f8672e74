"""The simulator's closed loop with a think time: a client takes and sends its next request a
think time after its last one ended, through the event queue, never inline."""

from __future__ import annotations

import pytest

from servelab.cli import main as cli_main
from servelab.core.config import SchedulerConfig
from servelab.errors import InvalidArgument
from servelab.sim import SimConfig, simulate
from servelab.workload import RequestSpec, WorkloadSpec


class ConstantCost:
    """2 ms per step whatever it holds: the clock is easy to follow."""

    def step_time_s(self, shape):  # noqa: ANN001, ANN201
        return 2e-3


def _config() -> SimConfig:
    return SimConfig(cost_model=ConstantCost(), scheduler=SchedulerConfig(num_blocks=2000))


def _by_index(result):  # noqa: ANN001, ANN202
    return sorted(result.records, key=lambda r: int(r.request_id))


@pytest.mark.parametrize("think_time_s", [0.05, 1e-9])
def test_each_follow_up_leaves_a_think_time_after_a_request_ended(think_time_s):
    c, n = 3, 30
    wl = WorkloadSpec(n, concurrency=c, input_len="16-64", output_len="2-12", seed=1, think_time_s=think_time_s)
    records = _by_index(simulate(_config(), wl))
    assert [r.arrival_s for r in records[:c]] == [0.0] * c  # the first wave: all clients at once
    # Request C+i is sent by the client whose request was the i-th to end, a think time later.
    ends = sorted(r.end_s for r in records)[: n - c]
    assert [r.arrival_s for r in records[c:]] == pytest.approx([e + think_time_s for e in ends], abs=1e-12)


def test_a_follow_up_never_joins_the_step_that_starts_when_its_predecessor_ends():
    # Two clients: A's requests are short, B's long, so A's end comes while B decodes, and the
    # engine starts its next step (B's decode) at that very instant.
    def follow_up(think_s: float):  # noqa: ANN202
        reqs = [RequestSpec(0, None, 32, 2, think_s=think_s), RequestSpec(1, None, 32, 40), RequestSpec(2, None, 32, 2)]
        result = simulate(_config(), reqs, concurrency=2)
        first, nxt = (r for r in _by_index(result) if r.request_id in ("0", "2"))
        steps = dict(zip(result.trace.start_s, result.trace.num_seqs))
        return first.end_s, nxt, steps

    # No think time (as before): the follow-up joins the step starting at the instant A ended.
    ended, nxt, steps = follow_up(0.0)
    assert nxt.arrival_s == ended and nxt.first_scheduled_s == ended and steps[ended] == 2
    # Any think time, however small: that step runs B's decode alone; the follow-up waits for the next.
    ended, nxt, steps = follow_up(1e-9)
    assert steps[ended] == 1
    assert nxt.first_scheduled_s == pytest.approx(ended + 2e-3) and steps[nxt.first_scheduled_s] == 2


def test_no_think_time_is_the_closed_loop_as_it_was():
    wl = dict(num_requests=40, concurrency=4, input_len="64-256", output_len="4-40", seed=3)
    base = simulate(_config(), WorkloadSpec(**wl))
    zero = simulate(_config(), WorkloadSpec(**wl, think_time_s=0.0))
    assert [r.to_dict() for r in zero.records] == [r.to_dict() for r in base.records]
    # ... in which a follow-up is sent the instant a request ends
    ends = {r.end_s for r in base.records}
    assert all(r.arrival_s in ends for r in _by_index(base)[4:])


@pytest.mark.parametrize("dist", ["constant", "exponential"])
def test_littles_law_holds_in_a_long_closed_loop(dist):
    c, think_time_s = 4, 0.2
    wl = WorkloadSpec(
        400, concurrency=c, input_len="100", output_len="20-60", seed=0, think_time_s=think_time_s, think_time_dist=dist
    )
    result = simulate(_config(), wl)
    s = result.summary
    thinks = [r.think_s for r in wl.generate()]  # the draws' own mean, where they are random
    # N users, each cycling through a request (E2E) and a think: throughput = N / (E2E + Z)
    assert s.request_throughput == pytest.approx(c / (s.e2e_s.mean + sum(thinks) / len(thinks)), rel=0.03)
    assert result.steady is not None and result.warmup_requests_excluded == c  # --warmup's default still holds


def test_disaggregated_pools_honor_the_think_time():
    config = SimConfig(cost_model=ConstantCost(), disagg=(1, 1), scheduler=SchedulerConfig(num_blocks=2000))
    records = _by_index(
        simulate(config, WorkloadSpec(12, concurrency=2, input_len="64", output_len="8", think_time_s=0.5))
    )
    ends = sorted(r.end_s for r in records)[:10]
    assert [r.arrival_s for r in records[2:]] == pytest.approx([e + 0.5 for e in ends])


def test_requests_with_their_own_arrival_times_refuse_a_think_time():
    with pytest.raises(InvalidArgument, match="think time"):
        simulate(_config(), [RequestSpec(0, 0.0, 16, 2, think_s=0.1)])


def test_cli_json_and_table_show_the_think_time(capsys):
    argv = [
        "sim",
        "--model",
        "llama-3.1-8b",
        "--concurrency",
        "4",
        "--think-time",
        "50ms",
        "--num-requests",
        "12",
        "--input-len",
        "128",
        "--output-len",
        "16",
    ]
    assert cli_main([*argv, "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["config"]["workload"]["think_time_s"] == pytest.approx(0.05)
    assert cli_main(argv) == 0
    assert "closed loop, concurrency 4, think time 50 ms" in capsys.readouterr().out
    assert cli_main([*argv[:3], "--rate", "2", *argv[3:]]) == 2
    assert "--think-time" in capsys.readouterr().err
