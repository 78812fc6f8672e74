"""The pieces of the cluster that need no process: rendezvous settings, errors across the link,
and the engine's plain outputs, which cross the link as they are."""

from __future__ import annotations

import pickle

import pytest

from servelab.cluster import messages as m
from servelab.cluster.channel import Rendezvous
from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.outputs import EngineOutput
from servelab.errors import InvalidArgument, QueueFull


def test_rendezvous_reads_torchs_variables_and_flags_win():
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "3"}
    assert Rendezvous.from_env(env) == Rendezvous("10.0.0.5", 29500, 3, 2)
    assert Rendezvous.from_env(env, rank=1, master_addr="h").rank == 1
    assert Rendezvous.from_env(env, master_addr="h").master_addr == "h"


@pytest.mark.parametrize(("env", "given", "message"), [
    ({"MASTER_PORT": "1", "RANK": "1", "WORLD_SIZE": "2"}, {}, "--master-addr is not given and MASTER_ADDR is not set"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "1", "WORLD_SIZE": "2"}, {}, "MASTER_PORT='x' is not an integer"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2", "WORLD_SIZE": "2"}, {}, r"rank must be in \[0, 1\]"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"}, {}, "world size must be at least 2"),
    ({}, {"master_addr": "h", "master_port": 70000, "rank": 1, "world_size": 2}, r"master port must be in \[1, 65535\]"),
])  # fmt: skip
def test_bad_rendezvous_settings_name_the_input(env, given, message):
    with pytest.raises(InvalidArgument, match=message):
        Rendezvous.from_env(env, **given)


def test_an_admission_error_crosses_the_link_as_itself():
    wire = pickle.loads(pickle.dumps(m.WireError.of(QueueFull("the queue holds 4 requests", param="max_waiting"))))
    error = wire.known()
    assert isinstance(error, QueueFull) and error.http_status == 503
    assert (error.message, error.param) == ("the queue holds 4 requests", "max_waiting")
    assert m.WireError.of(RuntimeError("boom")).known() is None  # not a user's error: the front end words it


def test_an_engines_outputs_are_plain_data_that_cross_the_link_as_they_are(fake_engine):
    """What a worker's engine returns is what the front end forwards: no Sequence, times after
    the request's arrival (the worker's clock never crosses), cumulative counts for usage."""
    engine = fake_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=100.0)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(pickle.loads(pickle.dumps(out)) for out in engine.step())
    assert all(type(out) is EngineOutput for out in outputs)
    assert [out.num_output_tokens for out in outputs] == [1, 2, 3]
    assert all(out.num_prompt_tokens == 3 and out.max_tokens == 3 for out in outputs)
    last = outputs[-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    # perf_counter is far past 100 s: the times are the engine's clock minus that arrival
    first = outputs[0]
    assert first.prev_token_offset_s is None and first.token_offsets_s == [first.first_token_offset_s]
    assert outputs[1].prev_token_offset_s == first.token_offsets_s[0]
    assert 0 < first.first_scheduled_offset_s <= first.first_token_offset_s <= last.finished_offset_s
    assert last.last_token_offset_s == last.token_offsets_s[-1]


def test_an_abort_ends_a_request_with_its_counts_and_times_so_far(fake_engine):
    engine = fake_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.abort("r")
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert out.num_output_tokens == 1 and out.token_offsets_s == [] and out.last_token_offset_s is not None
