"""Router policies, prefix-affinity in particular, on plain replicas and in the simulator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelab.core.block_manager import BlockManager, chain_block_hashes
from servelab.core.config import SchedulerConfig
from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import InvalidArgument
from servelab.sim import SimConfig, simulate
from servelab.core.router import ROUTERS, Router
from servelab.workload import WorkloadSpec

from tests.sim.test_sim import LinearCost


@dataclass
class Rep:
    index: int
    outstanding: int = 0
    kv_usage: float = 0.0


def test_unknown_router_names_the_choices():
    with pytest.raises(InvalidArgument, match="prefix-affinity"):
        Router("random")


def test_chain_block_hashes_are_the_prefix_caches():
    bm = BlockManager(num_blocks=64, block_size=4)
    tokens = list(range(100, 142))
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1))
    bm.find_cached_prefix(seq)  # computes seq.prefix.hashes
    assert seq.prefix.hashes == chain_block_hashes(tokens, 4)
    assert len(seq.prefix.hashes) == 10  # full blocks only


def test_prefix_affinity_follows_the_longest_remembered_prefix():
    router = Router("prefix-affinity")
    reps = [Rep(0), Rep(1), Rep(2)]
    a = chain_block_hashes([1] * 64, 16)
    b = chain_block_hashes([2] * 64, 16)
    first = router.pick(reps, a)
    assert first is reps[0]  # a new prefix: the least loaded (lowest index on ties)
    first.outstanding += 1
    second = router.pick(reps, b)
    assert second is reps[1]  # another new prefix avoids the busy replica
    second.outstanding += 1
    # a prompt sharing a's first two blocks goes where a went, though replica 2 is idle
    assert router.pick(reps, a[:2] + chain_block_hashes([1] * 32 + [9] * 32, 16)[2:]) is reps[0]


def test_prefix_affinity_gives_way_to_load_beyond_the_slack():
    router = Router("prefix-affinity", affinity_slack=2)
    reps = [Rep(0), Rep(1)]
    h = chain_block_hashes(list(range(32)), 16)
    assert router.pick(reps, h) is reps[0]
    reps[0].outstanding = 2
    assert router.pick(reps, h) is reps[0]  # within the slack: stays
    reps[0].outstanding = 3
    assert router.pick(reps, h) is reps[1]  # beyond it: the least loaded, which now holds the prefix
    reps[0].outstanding = 0
    assert router.pick(reps, h) is reps[1]


def test_prefix_affinity_skips_a_replica_that_left_the_pool():
    router = Router("prefix-affinity")
    reps = [Rep(0, outstanding=1), Rep(1)]
    h = chain_block_hashes(list(range(48)), 16)
    router.pick([reps[0]], h)  # only replica 0 was alive
    assert router.pick([reps[1]], h) is reps[1]  # it died: the survivor gets the prefix


@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=1, max_size=40), st.sampled_from(ROUTERS))
def test_every_router_picks_one_of_the_offered_replicas(prompts, kind):
    router = Router(kind, affinity_memory_blocks=8)
    reps = [Rep(i) for i in range(3)]
    for blocks in prompts:
        offered = reps[: 1 + len(blocks) % 3]
        chosen = router.pick(offered, chain_block_hashes([t for b in blocks for t in [b] * 4], 4))
        assert chosen in offered
        chosen.outstanding += 1
    assert len(router._holder) <= 8


def test_sim_prefix_affinity_keeps_each_group_on_one_replica():
    def run(router: str):
        wl = WorkloadSpec(80, rate=20.0, input_len="512", output_len="4", shared_prefix_fraction=0.75,
                          num_prefix_groups=4, seed=0)  # fmt: skip
        cfg = SimConfig(cost_model=LinearCost(), replicas=4, router=router, scheduler=SchedulerConfig(num_blocks=4000))
        return simulate(cfg, wl)

    affine, spread = run("prefix-affinity"), run("round-robin")
    cached = {name: sum(r.num_cached_tokens for r in res.records) for name, res in (("affine", affine), ("rr", spread))}
    assert affine.summary.completed == spread.summary.completed == 80
    assert cached["affine"] > cached["rr"], cached
