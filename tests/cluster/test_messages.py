"""The pieces of the cluster that need no process: rendezvous settings, errors across the link,
and the front end's copy of a Sequence rebuilt from a worker's outputs."""

from __future__ import annotations

import pickle

import pytest

from servelab.cluster import messages as m
from servelab.cluster.channel import Rendezvous
from servelab.cluster.front_end import _apply
from servelab.core.plan import TokenLogprobs
from servelab.core.sequence import NO_TOKEN_LEFT, FinishReason, SamplingParams, Sequence
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


def test_the_front_ends_sequence_follows_the_workers_outputs_on_its_own_clock():
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=3, logprobs=0, prompt_logprobs=0), arrival_s=100.0)
    first = m.WireOutput("r", [11, 12], "ab", False, None, [TokenLogprobs(11, -0.1), TokenLogprobs(12, -0.2)],
                         [0.5, 0.6], 0.25, None, 2, None, [TokenLogprobs(6, -1.0), TokenLogprobs(7, -2.0)])  # fmt: skip
    out = _apply(seq, first)
    assert out.new_token_ids == [11, 12] and out.text_delta == "ab" and not out.finished
    assert seq.output_token_ids == [11, 12] and seq.num_output_tokens == 2
    assert seq.token_times_s == [100.5, 100.6] and seq.first_token_s == 100.5 and seq.first_scheduled_s == 100.25
    assert seq.num_cached_tokens == 2 and len(seq.prompt_logprobs) == 2
    last = _apply(seq, m.WireOutput("r", [13], "c", True, "stop", None, [0.9], 0.25, 0.9, 2, "c"))
    assert last.finished and last.finish_reason is FinishReason.STOP and last.seq is seq
    assert seq.finished_s == 100.9 and seq.stop_reason == "c" and seq.is_finished and seq.error is None
    failed = Sequence("f", [5], SamplingParams(max_tokens=3), arrival_s=0.0)
    _apply(failed, m.WireOutput("f", [], "", True, "error", None, [], 0.1, 0.2, 0, None, error=NO_TOKEN_LEFT))
    assert failed.finish_reason is FinishReason.ERROR and failed.error == NO_TOKEN_LEFT  # the server's 400
    assert seq.token_times_s == [100.5, 100.6, 100.9]
