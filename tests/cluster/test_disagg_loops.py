"""The prefill and decode workers' loops in one process, their links and transfers faked: a
transfer that fails ends the request with an error and leaves every block free on both sides;
an abort that overtakes its offer is honoured when the offer arrives."""

from __future__ import annotations

import time

import pytest

from servelab.cluster import messages as m
from servelab.cluster.disagg_config import DisaggConfig
from servelab.cluster.disagg_worker import DecodeLoop, Go, Offer, PrefillLoop, Refuse
from servelab.cluster.kv_transfer import KVTransferError
from servelab.core.sequence import SamplingParams
from servelab.engine.core import EngineCoreRequest

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class FakeLink:
    def __init__(self, peer: int):
        self.peer = peer
        self.group = None
        self.group_peer = None
        self.sent: list = []

    def send(self, message, timeout_s: float = 30.0) -> None:
        self.sent.append(message)


def _broken_transfer(*args, **kwargs):
    raise KVTransferError("piece 1 of 2 did not cross (fake)")


def _settle(loop) -> None:
    """Runs the loop's after-step work until its transfers are done."""
    deadline = time.monotonic() + 10
    while loop.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        loop._after_step()


def _to_front(loop) -> list:
    """What the loop queued for the front end (its sender thread is not running here)."""
    sent = []
    while not loop.outbox.empty():
        sent.append(loop.outbox.get())
    return sent


def _request(request_id: str, end: int) -> EngineCoreRequest:
    """A request as the front end's input processor makes it: token ids 1..end-1, arrived at 0."""
    return EngineCoreRequest(request_id, list(range(1, end)), GREEDY, arrival_s=0.0)


def _failed(sent: list) -> list[str]:
    return [rid for msg in sent if isinstance(msg, m.RequestsFailed) for rid in msg.request_ids]


def test_a_failed_send_frees_the_prefill_side_and_fails_the_request(tiny_engine_factory, monkeypatch):
    monkeypatch.setattr("servelab.cluster.kv_transfer.send_blocks", _broken_transfer)
    engine = tiny_engine_factory(num_blocks=16)
    front, decode = FakeLink(0), FakeLink(2)
    loop = PrefillLoop(engine, front, DisaggConfig(1, 1), {2: decode})
    loop._admit(m.AddRequests(0, [_request("r", 40)], 0.0, 2))
    while not decode.sent:
        loop._step()
    offer = decode.sent[0]
    assert isinstance(offer, Offer) and offer.first_token_id >= 0
    assert engine.stats().num_blocks_free == 13  # held: 39 tokens in 3 blocks
    assert loop._on_peer_at_once(2, Go("r", 16, 0))  # started on the receiving thread, not the step loop
    while not loop.commands.empty():  # the step loop's share: it follows the transfer from here
        loop._on_command(loop.commands.get())
    _settle(loop)
    sent = _to_front(loop)
    assert _failed(sent) == ["r"] and "KV transfer to decode worker 2 failed" in sent[-1].error.message
    assert engine.stats().num_blocks_free == 16 and not loop.held


def test_a_failed_receive_frees_the_decode_side_and_fails_the_request(tiny_engine_factory, monkeypatch):
    from servelab.cluster.kv_transfer import KVLayout

    monkeypatch.setattr("servelab.cluster.kv_transfer.recv_blocks", _broken_transfer)
    engine = tiny_engine_factory(num_blocks=16)
    front, prefill = FakeLink(0), FakeLink(1)
    loop = DecodeLoop(engine, front, DisaggConfig(1, 1), {1: prefill})
    layout = KVLayout.of(engine.executor.kv_cache)
    loop._on_peer(1, Offer("r", list(range(1, 40)), 7, GREEDY, None, 0.1, 0.0, [], layout))
    loop._after_step()
    assert isinstance(prefill.sent[0], Go) and engine.stats().num_blocks_free == 13  # reserved
    _settle(loop)
    sent = _to_front(loop)
    assert _failed(sent) == ["r"] and "KV transfer from prefill worker 1 failed" in sent[-1].error.message
    assert engine.stats().num_blocks_free == 16 and not engine.has_unfinished()


def test_a_request_the_decode_side_cannot_start_fails_alone_and_frees_its_blocks(tiny_engine_factory, monkeypatch):
    from servelab.cluster.kv_transfer import KVLayout

    monkeypatch.setattr("servelab.cluster.kv_transfer.recv_blocks", lambda *a, **k: 0)
    engine = tiny_engine_factory(num_blocks=16)

    def cannot_prepare(params):
        raise ValueError("grammar cannot compile here (fake)")

    front, prefill = FakeLink(0), FakeLink(1)
    loop = DecodeLoop(engine, front, DisaggConfig(1, 1), {1: prefill})
    loop._on_peer(
        1, Offer("r", list(range(1, 40)), 7, GREEDY, None, 0.1, 0.0, [], KVLayout.of(engine.executor.kv_cache))
    )
    loop._after_step()
    assert engine.stats().num_blocks_free == 13  # reserved
    monkeypatch.setattr(engine, "prepare_logits_processors", cannot_prepare)
    _settle(loop)  # the step loop survives the failure
    sent = _to_front(loop)
    assert _failed(sent) == ["r"] and "grammar cannot compile here" in sent[-1].error.message
    assert engine.stats().num_blocks_free == 16 and not engine.has_unfinished() and "r" not in loop.live


def test_an_abort_that_overtakes_its_offer_refuses_it(tiny_engine_factory):
    from servelab.cluster.kv_transfer import KVLayout

    engine = tiny_engine_factory(num_blocks=16)
    front, prefill = FakeLink(0), FakeLink(1)
    loop = DecodeLoop(engine, front, DisaggConfig(1, 1), {1: prefill})
    loop._abort_one("r")
    loop._on_peer(1, Offer("r", [1, 2, 3], 7, GREEDY, None, 0.1, 0.0, [], KVLayout.of(engine.executor.kv_cache)))
    loop._after_step()
    assert [type(x) for x in prefill.sent] == [Refuse] and prefill.sent[0].error is None
    assert engine.stats().num_blocks_free == 16 and not loop.offers


@pytest.mark.parametrize("wrong", ["dtype", "block_size"])
def test_an_offer_of_another_kv_layout_is_refused_naming_both(tiny_engine_factory, wrong):
    from dataclasses import replace

    from servelab.cluster.kv_transfer import KVLayout

    engine = tiny_engine_factory(num_blocks=16)
    prefill = FakeLink(1)
    loop = DecodeLoop(engine, FakeLink(0), DisaggConfig(1, 1), {1: prefill})
    layout = KVLayout.of(engine.executor.kv_cache)
    other = replace(layout, **({"dtype": "float16"} if wrong == "dtype" else {"block_size": 32}))
    loop._on_peer(1, Offer("r", [1, 2, 3], 7, GREEDY, None, 0.1, 0.0, [], other))
    assert isinstance(prefill.sent[0], Refuse) and "KV layouts differ" in prefill.sent[0].error


def test_a_lost_decode_worker_fails_what_the_prefill_worker_holds_or_runs_for_it(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=16)
    decode = FakeLink(2)
    loop = PrefillLoop(engine, FakeLink(0), DisaggConfig(1, 1), {2: decode})
    loop._admit(m.AddRequests(0, [_request("held", 20)], 0.0, 2))
    while not decode.sent:
        loop._step()  # "held" is prefilled and offered
    loop._admit(m.AddRequests(1, [_request("queued", 30)], 0.0, 2))
    loop._on_peer_gone(2, "connection lost")
    assert sorted(_failed(_to_front(loop))) == ["held", "queued"]
    stats = engine.stats()
    assert stats.num_blocks_free == 16 and stats.num_running == stats.num_waiting == 0 and not loop.held


def test_a_lost_prefill_worker_fails_the_offers_queued_from_it(tiny_engine_factory):
    from servelab.cluster.kv_transfer import KVLayout

    engine = tiny_engine_factory(num_blocks=4, max_num_seqs=1)
    loop = DecodeLoop(engine, FakeLink(0), DisaggConfig(1, 1), {1: FakeLink(1)})
    layout = KVLayout.of(engine.executor.kv_cache)
    engine.reserve_prefilled("busy", [1, 2, 3], 7, GREEDY)  # the sequence budget is taken: offers wait
    loop._on_peer(1, Offer("waiting", [1, 2, 3], 7, GREEDY, None, 0.1, 0.0, [], layout))
    loop._after_step()
    assert len(loop.offers) == 1
    loop._on_peer_gone(1, "connection lost")
    assert _failed(_to_front(loop)) == ["waiting"] and not loop.offers


def test_a_decode_worker_prepares_an_offered_grammar_before_its_step_loop_sees_it(tiny_engine_factory):
    """The compiled grammar does not cross the link: the preparer thread redoes the work
    (here: bad words tokenized) when the offer arrives, so start_prefilled on the step loop
    finds it done."""
    import pickle
    import threading

    from servelab.cluster.disagg_worker import _FromPeer
    from servelab.cluster.kv_transfer import KVLayout

    engine = tiny_engine_factory(num_blocks=16)
    loop = DecodeLoop(engine, FakeLink(0), DisaggConfig(1, 1), {1: FakeLink(1)})
    layout = KVLayout.of(engine.executor.kv_cache)
    params = SamplingParams(max_tokens=8, temperature=0, bad_words=["hello"])
    engine.prepare_logits_processors(params)  # as the prefill worker did, in its own process
    offer = pickle.loads(pickle.dumps(Offer("r", [1, 2, 3], 7, params, None, 0.1, 0.0, [], layout)))
    assert offer.params.prepared_edits is None  # the wire dropped it
    preparer = threading.Thread(target=loop._prepare_arrivals, daemon=True)
    preparer.start()
    loop.arrivals.put(_FromPeer(1, offer))
    loop.arrivals.put(None)
    preparer.join(timeout=10)
    command = loop.commands.get(timeout=1)
    assert isinstance(command, _FromPeer) and command.message is offer
    assert offer.params.prepared_edits is not None


def test_a_decode_worker_refuses_an_offer_whose_grammar_does_not_compile(tiny_engine_factory):
    """Its grammar workers refuse the constraint (here: past the timeout): the offer is refused to
    the prefill worker with that error, at once, and nothing is compiled on the step loop."""
    import pickle
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    from servelab.cluster.disagg_worker import _FromPeer
    from servelab.cluster.kv_transfer import KVLayout
    from servelab.core.structured_output import StructuredOutputSpec
    from servelab.errors import InvalidArgument

    class RefusingGrammars:
        backend = SimpleNamespace(cache=SimpleNamespace(get=lambda spec: None))

        def submit(self, spec):
            future: Future = Future()
            future.set_exception(InvalidArgument(f"{spec.source}: did not compile within 1 s", param=spec.source))
            return future

        def shutdown(self):
            pass

    engine = tiny_engine_factory(num_blocks=16)
    prefill = FakeLink(1)
    loop = DecodeLoop(engine, FakeLink(0), DisaggConfig(1, 1), {1: prefill}, RefusingGrammars())
    layout = KVLayout.of(engine.executor.kv_cache)
    params = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutputSpec("regex", "[a-z]+"))
    offer = pickle.loads(pickle.dumps(Offer("r", [1, 2, 3], 7, params, None, 0.1, 0.0, [], layout)))
    preparer = threading.Thread(target=loop._prepare_arrivals, daemon=True)
    preparer.start()
    loop.arrivals.put(_FromPeer(1, offer))
    loop._on_command(loop.commands.get(timeout=5))
    loop.arrivals.put(None)
    preparer.join(timeout=10)
    assert not loop.offers and offer.params.prepared_edits is None
    [refusal] = prefill.sent
    assert isinstance(refusal, Refuse) and refusal.request_id == "r"
    assert "decode worker could not prepare it: structured_outputs: did not compile within 1 s" in refusal.error
