"""logit_bias, allowed_token_ids, bad_words and grammar masks, on the bundled model's tokenizer
(its real 49k byte-level BPE vocabulary) with random logits, through the Sampler's one hook."""

from __future__ import annotations

import itertools

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.core.sequence import NO_TOKEN_LEFT, SamplingParams, Sequence
from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.logits_processors import LogitsProcessors, bad_word_token_ids
from servelab.engine.sampler import Sampler
from servelab.engine.tokenizer import Tokenizer
from servelab.errors import InvalidArgument

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from servelab.engine.bundled import bundled_model_path

    try:
        return Tokenizer.from_gguf(bundled_model_path())
    except Exception as e:  # the bundled model package is optional
        pytest.skip(f"bundled model unavailable: {e}")


@pytest.fixture(scope="module")
def processors(tokenizer) -> LogitsProcessors:
    return LogitsProcessors(tokenizer, tokenizer.vocab_size)


_IDS = itertools.count()


def make_seq(tokenizer, outputs=(), rid="r", **params) -> Sequence:
    # unique ids: the module's processors keep per-request state by id, as the engine's do
    s = Sequence(
        f"{rid}-{next(_IDS)}", [1, 2, 3], SamplingParams(**params), eos_token_ids=tuple(tokenizer.eos_token_ids)
    )
    s.token_ids.extend(outputs)
    return s


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("params", "param", "text"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias", "logit_bias[5]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", "key -1 is not a token id"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids", "-2 is not a token id"),
        ({"bad_words": ["ok", " "]}, "bad_words", "' ' is not a non-blank string"),
    ],
)
def test_bad_values_name_the_field(params, param, text):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**params)
    assert e.value.param == param and text in e.value.message


def test_token_ids_outside_the_vocabulary_are_refused(processors, tokenizer):
    vocab = tokenizer.vocab_size
    for params, param in (
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [0, vocab + 3]}, "allowed_token_ids"),
    ):
        with pytest.raises(InvalidArgument) as e:
            processors.prepare(SamplingParams(**params))
        assert e.value.param == param and f"outside the vocabulary [0, {vocab})" in e.value.message


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec("regex", "[a-", source="structured_outputs"),
        StructuredOutputSpec("grammar", "root ::= missing_rule", source="structured_outputs"),
        StructuredOutputSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}, "response_format"
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(processors, spec):
    with pytest.raises(InvalidArgument) as e:
        processors.prepare(SamplingParams(structured_output=spec))
    assert e.value.param == spec.source and "does not compile" in e.value.message


def test_spec_checks_its_value():
    with pytest.raises(InvalidArgument, match="choice must be a non-empty list"):
        StructuredOutputSpec("choice", ())
    with pytest.raises(InvalidArgument, match="unknown constraint"):
        StructuredOutputSpec("yaml", "x")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        StructuredOutputSpec.json_schema("{not json", "response_format")


# ------------------------------------------------------------------------------ bias, allowed, bad words


def test_logit_bias_applies_before_greedy_and_random_sampling(processors, tokenizer):
    vocab = tokenizer.vocab_size
    logits = random_logits(4, vocab)
    top = logits.argmax(dim=-1).tolist()
    seqs = [
        make_seq(tokenizer, temperature=0, logit_bias={123: 100}),  # greedy picks the +100 token
        make_seq(tokenizer, temperature=0, logit_bias={top[1]: -100}),  # greedy avoids its argmax
        make_seq(tokenizer, temperature=1.0, seed=3, logit_bias={777: 100}),  # so does sampling
        make_seq(tokenizer, temperature=0),  # untouched
    ]
    tokens, _ = Sampler(0, processors).sample(logits, seqs)
    assert tokens[0] == 123 and tokens[1] not in (top[1], None) and tokens[2] == 777 and tokens[3] == top[3]


def test_rows_without_edits_sample_exactly_as_without_the_hook(processors, tokenizer):
    logits = random_logits(6, tokenizer.vocab_size, seed=1)
    plain = [make_seq(tokenizer, temperature=0.8, seed=i) for i in range(5)]
    edited = make_seq(tokenizer, temperature=0.8, seed=9, allowed_token_ids=[5, 6])
    without, _ = Sampler(0).sample(logits[:5].clone(), plain)
    with_hook, _ = Sampler(0, processors).sample(logits, [*plain, edited])
    assert with_hook[:5] == without and with_hook[5] in (5, 6)


@settings(max_examples=30, deadline=None)
@given(
    allowed=st.lists(st.integers(0, 49151), min_size=1, max_size=6),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**31),
)
def test_only_allowed_token_ids_are_sampled(processors, tokenizer, allowed, temperature, seed):
    logits = random_logits(1, tokenizer.vocab_size, seed=seed % 1000)
    seq = make_seq(
        tokenizer, temperature=temperature, seed=seed, allowed_token_ids=allowed, logit_bias={allowed[0]: -100}
    )
    tokens, _ = Sampler(0, processors).sample(logits, [seq])
    assert tokens[0] in allowed


WORDS = ["Paris", " Paris", "New York", "1", "11", "the", "!"]


@settings(max_examples=60, deadline=None)
@given(
    allowed=st.none() | st.lists(st.sampled_from([7042, 33, 0, 1, 2, 504, 9092]), min_size=1, max_size=4),
    bad=st.lists(st.sampled_from(WORDS), max_size=3),
    min_tokens=st.sampled_from([0, 1, 3]),
    outputs=st.lists(st.sampled_from([33, 7042, 1, 504]), max_size=3),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9, 1e-3, 1e-46, 5e-324]),
    top_k=st.sampled_from([0, 1, 50]),
    min_p=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.none() | st.integers(0, 2**31),
)
def test_every_mix_of_sampling_knobs_samples_a_valid_token_or_is_told_why(
    processors, tokenizer, allowed, bad, min_tokens, outputs, temperature, top_p, top_k, min_p, seed
):
    """Any valid mix of constraints and sampling values: refused at admission naming a field,
    or each step samples an allowed, unbanned token, or ends the row with NO_TOKEN_LEFT (the
    client's 400); the sampler never raises and never blames the model."""
    params = dict(allowed_token_ids=allowed, bad_words=bad, min_tokens=min_tokens, max_tokens=4,
                  temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)  # fmt: skip
    seq = make_seq(tokenizer, outputs, **params)
    try:
        processors.prepare(seq.params)
    except InvalidArgument as e:
        assert e.param in ("bad_words", "min_tokens")
        return
    sampler = Sampler(0, processors)
    tokens, _ = sampler.sample(random_logits(1, tokenizer.vocab_size, seed=len(outputs)), [seq])
    if tokens[0] is None:
        assert sampler.row_errors == {0: NO_TOKEN_LEFT}
        return
    assert 0 <= tokens[0] < tokenizer.vocab_size
    assert allowed is None or tokens[0] in allowed
    if len(seq.output_token_ids) < min_tokens:
        assert tokens[0] not in tokenizer.eos_token_ids
    out = seq.output_token_ids + [tokens[0]]
    for ids in bad_word_token_ids(tokenizer, bad) if bad else []:
        assert out[-len(ids) :] != ids  # the new token completes no bad word


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tokenizer):
    ids = bad_word_token_ids(tokenizer, ["Paris"])
    assert tokenizer.encode("Paris") in ids and tokenizer.encode(" Paris") in ids


def test_a_bad_word_loses_its_last_token_only_after_its_prefix(processors, tokenizer):
    word = tokenizer.encode(" New York")  # as many tokens as "New York": both spellings are banned
    assert len(word) == len(tokenizer.encode("New York")) == 2
    vocab = tokenizer.vocab_size
    logits = torch.zeros(2, vocab)
    logits[:, word[-1]] = 50.0  # the model wants the bad word's last token
    after_prefix = make_seq(tokenizer, word[:-1], temperature=0, bad_words=["New York"])
    elsewhere = make_seq(tokenizer, [tokenizer.encode(" Hello")[0]], rid="s", temperature=0, bad_words=["New York"])
    tokens, _ = Sampler(0, processors).sample(logits, [after_prefix, elsewhere])
    assert tokens[0] != word[-1] and tokens[1] == word[-1]


def test_a_row_left_with_no_token_ends_alone(processors, tokenizer):
    word, two = tokenizer.encode("Paris"), tokenizer.encode(" New York")
    assert len(word) == 1 and len(two) == 2
    logits = random_logits(3, tokenizer.vocab_size)
    # only " York" is allowed, and after " New" it completes a bad word: found at this step only
    stuck = make_seq(tokenizer, two[:1], temperature=1.0, allowed_token_ids=two[1:], bad_words=["New York"])
    fine = make_seq(tokenizer, rid="s", temperature=0)
    digits_only = StructuredOutputSpec("regex", "[0-9]+")
    no_overlap = make_seq(tokenizer, rid="t", temperature=1.0, allowed_token_ids=word, structured_output=digits_only)
    sampler = Sampler(0, processors)
    tokens, _ = sampler.sample(logits, [stuck, fine, no_overlap])
    assert tokens[0] is None and tokens[1] == logits[1].argmax().item() and tokens[2] is None
    # The executor's log line says why: the constraints, not the model's logits.
    assert sampler.row_errors == {0: NO_TOKEN_LEFT, 2: NO_TOKEN_LEFT}


def test_a_first_token_with_no_candidate_is_refused_at_admission(processors, tokenizer):
    """What admission can tell is refused there, naming the field (the server's 400), not ended
    with an error after the client was answered 200."""
    paris, eos = tokenizer.encode("Paris")[0], tokenizer.eos_token_ids[0]
    cases = [
        ({"allowed_token_ids": [paris], "bad_words": ["Paris"]}, "bad_words"),
        ({"allowed_token_ids": [eos], "min_tokens": 2, "max_tokens": 4}, "min_tokens"),
        (
            {"allowed_token_ids": [paris, 7], "stop_token_ids": [7], "bad_words": ["Paris"], "min_tokens": 1},
            "min_tokens",
        ),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidArgument) as e:
            processors.prepare(SamplingParams(**kwargs))
        assert e.value.param == param, kwargs
    # one candidate left is enough, and ignore_eos keeps EOS a candidate under min_tokens
    processors.prepare(SamplingParams(allowed_token_ids=[paris, 7], bad_words=["Paris"]))
    processors.prepare(SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=4, ignore_eos=True))


# ------------------------------------------------------------------------------ grammars


def generate(processors, tokenizer, spec, *, max_tokens=60, temperature=1.0, seed=0, rows=1) -> list[Sequence]:
    """Random logits as the 'model': whatever the model wants, the grammar decides what is legal."""
    sampler = Sampler(seed, processors)
    seqs = [
        make_seq(tokenizer, rid=f"r{i}", temperature=temperature, seed=seed * 100 + i, structured_output=spec)
        for i in range(rows)
    ]
    live = list(seqs)
    for step in range(max_tokens):
        if not live:
            break
        tokens, _ = sampler.sample(random_logits(len(live), tokenizer.vocab_size, seed=seed * 1000 + step), live)
        for s, t in zip(live, tokens):
            assert t is not None
            s.token_ids.append(t)
        live = [s for s in live if s.token_ids[-1] not in tokenizer.eos_token_ids]
    return seqs


def text_of(tokenizer, seq) -> str:
    return tokenizer.decode([t for t in seq.output_token_ids if t not in tokenizer.eos_token_ids])


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["city", "rank", "tags"],
}  # fmt: skip


def test_json_schema_outputs_parse_and_validate(processors, tokenizer):
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
    seqs = generate(processors, tokenizer, spec, max_tokens=80, rows=8)
    for s in seqs:
        assert s.token_ids[-1] in tokenizer.eos_token_ids, "the grammar ends with EOS once complete"
        jsonschema.validate(json.loads(text_of(tokenizer, s)), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(processors, tokenizer):
    cases = [
        (StructuredOutputSpec("regex", r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (StructuredOutputSpec("choice", ("yes", "no", 'a "quoted" é')), lambda t: t in ("yes", "no", 'a "quoted" é')),
        (StructuredOutputSpec("grammar", 'root ::= "x" [0-9] [0-9] "y"'), lambda t: re.fullmatch(r"x[0-9]{2}y", t)),
    ]
    for spec, ok in cases:
        for s in generate(processors, tokenizer, spec, max_tokens=200, rows=4, seed=2):
            text = text_of(tokenizer, s)
            assert s.token_ids[-1] in tokenizer.eos_token_ids and ok(text), (spec, text)


def test_json_object_is_an_object(processors, tokenizer):
    """Random logits rarely close a free-form object within a few tokens; whatever ends must be
    a JSON object (not any JSON value), and every output starts as one."""
    for s in generate(processors, tokenizer, StructuredOutputSpec("json_object"), max_tokens=40, rows=8, seed=3):
        text = text_of(tokenizer, s)
        assert text.startswith("{")
        if s.token_ids[-1] in tokenizer.eos_token_ids:
            assert isinstance(json.loads(text), dict)


def test_the_matcher_follows_the_output_after_recompute(processors, tokenizer):
    """Preemption by recompute keeps the output tokens; a matcher rebuilt from them (or one that
    saw more tokens than the sequence now has) masks exactly as one that followed along."""
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
    (followed,) = generate(processors, tokenizer, spec, max_tokens=6, temperature=0)
    fresh = make_seq(tokenizer, followed.output_token_ids, temperature=0, structured_output=spec)
    logits = random_logits(1, tokenizer.vocab_size, seed=7)
    a, b = logits.clone(), logits.clone()
    assert processors.apply(a, [followed]) == {} and processors.apply(b, [fresh]) == {}
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a).any()
    state = processors._rows[followed.request_id].matcher
    shorter = followed.token_ids[: followed.num_prompt_tokens + 3]
    assert state.sync(shorter, followed.num_prompt_tokens) and state.num_accepted == 3  # rebuilt and replayed


def test_a_grammar_rejecting_a_row_ends_only_that_row(processors, tokenizer):
    spec = StructuredOutputSpec("regex", "[0-9]+")
    broken = make_seq(tokenizer, tokenizer.encode("abc"), temperature=0, structured_output=spec)  # not digits
    fine = make_seq(tokenizer, rid="s", temperature=0, structured_output=spec)
    sampler = Sampler(0, processors)
    tokens, _ = sampler.sample(random_logits(2, tokenizer.vocab_size), [broken, fine])
    assert tokens[0] is None and re.fullmatch("[0-9]+", tokenizer.decode([tokens[1]]))
    assert sampler.row_errors == {0: "its grammar rejects its output so far"}


def test_max_tokens_mid_json_is_cut_not_closed(processors, tokenizer):
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
    (s,) = generate(processors, tokenizer, spec, max_tokens=4)
    assert s.token_ids[-1] not in tokenizer.eos_token_ids
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(tokenizer, s))


def test_constrained_requests_survive_preemption(tiny_engine_factory):
    """A KV pool too small for the batch preempts sequences (recompute keeps their output); the
    grammar keeps following each output, so every answer still matches."""
    engine = tiny_engine_factory(num_blocks=8, max_num_seqs=4, block_size=16)
    pattern = "[a-z]{100}"
    seqs = [
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                                                     structured_output=StructuredOutputSpec("regex", pattern)))
        for i in range(4)
    ]  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    for s in seqs:
        assert s.finish_reason.value == "stop", s.finish_reason
        assert re.fullmatch(pattern, engine.tokenizer.decode(s.output_token_ids)), engine.tokenizer.decode(
            s.output_token_ids
        )


def test_the_models_inference_tensors_are_edited(processors, tokenizer):
    """The model's forward runs under inference_mode; its logits reach the sampler as inference
    tensors, which torch lets no one edit in place outside that mode."""
    with torch.inference_mode():
        logits = random_logits(2, tokenizer.vocab_size)
    two = tokenizer.encode(
        " New York"
    )  # " York" alone allowed, banned after " New": nothing left, the row is zeroed too
    seqs = [make_seq(tokenizer, temperature=0, logit_bias={42: 100}),
            make_seq(tokenizer, two[:1], rid="s", temperature=1.0, allowed_token_ids=two[1:], bad_words=["New York"])]  # fmt: skip
    tokens, _ = Sampler(0, processors).sample(logits, seqs)
    assert tokens == [42, None]


def test_a_retry_row_by_row_does_not_apply_logit_bias_twice(processors, tokenizer):
    """When the batched sample raises after the in-place edits, each row is sampled again alone:
    from the model's logits, not from already-biased ones."""
    from servelab.engine.row_isolation import sample_isolated

    class FailsOnBatches(Sampler):
        def sample(self, logits, seqs, argmax=None):
            tokens, logprobs = super().sample(logits, seqs, argmax)  # edits the constrained rows in place
            if len(seqs) > 1:
                raise RuntimeError("injected fault after the edits")
            return tokens, logprobs

    logits = torch.zeros(2, tokenizer.vocab_size)
    logits[:, 5] = 10.0
    biased = make_seq(tokenizer, temperature=0, logit_bias={3: 6.0})  # 6 < 10: still token 5, if applied once
    plain = make_seq(tokenizer, rid="s", temperature=0)
    rows = sample_isolated(FailsOnBatches(0, processors), logits, [biased, plain], tokenizer.vocab_size)
    assert rows.tokens == [5, 5] and not rows.errors


def test_the_step_loop_never_compiles_a_grammar_evicted_after_its_preparation(tiny_engine_factory):
    """The server compiles a request's grammar on a worker thread before admission; were the
    cache to drop it before the step loop admits the request, the step loop must not compile
    it again (it travels with the request)."""
    import threading

    engine = tiny_engine_factory(num_blocks=16)
    backend = engine.logits_processors.structured
    wanted = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutputSpec("regex", "[a-z]{3}"))
    other = SamplingParams(max_tokens=8, structured_output=StructuredOutputSpec("regex", "[0-9]{3}"))

    def on_worker(params: SamplingParams) -> None:
        worker = threading.Thread(target=engine.prepare_logits_processors, args=(params,), name="worker")
        worker.start()
        worker.join()

    on_worker(wanted)
    backend.cache.capacity_bytes = backend.cache.size_bytes  # room for one grammar of this size
    compiled_on: list[str] = []
    real_compiler = backend._compiler

    class CountingCompiler:
        def __getattr__(self, name):
            attr = getattr(real_compiler, name)
            if not name.startswith("compile_"):
                return attr

            def counted(*args, **kwargs):
                compiled_on.append(threading.current_thread().name)
                return attr(*args, **kwargs)

            return counted

    backend._compiler = CountingCompiler()
    on_worker(other)  # evicts `wanted` from the cache
    assert compiled_on == ["worker"]
    assert backend.cache.get(wanted.structured_output) is None
    seq = engine.add_request("r", [5, 6, 7], wanted)  # on this thread: the step loop's
    while engine.has_unfinished():
        engine.step()
    assert compiled_on == ["worker"], "the step loop compiled a grammar"
    assert re.fullmatch("[a-z]{3}", engine.tokenizer.decode(seq.output_token_ids))


def test_params_copies_leave_the_prepared_edits_behind(processors):
    import copy
    import pickle

    params = SamplingParams(structured_output=StructuredOutputSpec("regex", "[a-z]+"), bad_words=["x"])
    processors.prepare(params)
    assert params.prepared_edits is not None
    for clone in (pickle.loads(pickle.dumps(params)), copy.copy(params)):
        assert clone.prepared_edits is None and clone.structured_output == params.structured_output


def test_siblings_share_the_first_choices_preparation(processors, tokenizer):
    first = SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=list(range(100)), bad_words=["Paris"],
                           structured_output=StructuredOutputSpec("regex", "[a-z]+"))  # fmt: skip
    siblings = [first.sibling(seed=i, max_tokens=8, prompt_logprobs=None) for i in range(3)]
    other = SamplingParams(bad_words=["London"])  # not a sibling: prepared on its own
    processors.prepare(first, *siblings, other)
    assert all(s.prepared_edits is first.prepared_edits for s in siblings)
    assert other.prepared_edits is not first.prepared_edits
    assert other.prepared_edits.bad_words == bad_word_token_ids(tokenizer, ["London"])
    assert [s.seed for s in siblings] == [0, 1, 2] and siblings[0].max_tokens == 8
    with pytest.raises(InvalidArgument, match="min_tokens"):
        SamplingParams(min_tokens=4, max_tokens=8).sibling(seed=None, max_tokens=2, prompt_logprobs=None)


def test_the_step_loop_never_tokenizes_bad_words(tiny_engine_factory):
    import threading

    engine = tiny_engine_factory(num_blocks=16)
    params = SamplingParams(max_tokens=4, temperature=0, bad_words=["hello", "world"])
    worker = threading.Thread(target=engine.prepare_logits_processors, args=(params,))
    worker.start()
    worker.join()
    tokenized_on: list[str] = []
    real_encode = engine.tokenizer.encode

    def encode(*args, **kwargs):
        tokenized_on.append(threading.current_thread().name)
        return real_encode(*args, **kwargs)

    engine.tokenizer.encode = encode
    try:
        engine.add_request("r", [5, 6, 7], params)
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.tokenizer.encode
    assert tokenized_on == []


def test_the_step_loop_does_no_per_entry_work_on_a_prepared_requests_lists(tiny_engine_factory):
    """A request's lists may be as long as the vocabulary, for each of up to 128 choices: once
    prepared (off the step loop), add_request and the steps must not walk them again."""
    import threading

    class CountingList(list):
        walks = 0

        def __iter__(self):
            CountingList.walks += 1
            return super().__iter__()

    engine = tiny_engine_factory(num_blocks=32)
    first = SamplingParams(max_tokens=3, temperature=1.0, seed=0, allowed_token_ids=CountingList(range(5, 300)))
    siblings = [first.sibling(seed=i, max_tokens=3, prompt_logprobs=None) for i in range(1, 4)]
    worker = threading.Thread(target=engine.prepare_logits_processors, args=(first, *siblings))
    worker.start()
    worker.join()
    CountingList.walks = 0
    seqs = [engine.add_request(f"r{i}", [5, 6, 7], p) for i, p in enumerate([first, *siblings])]
    while engine.has_unfinished():
        engine.step()
    assert CountingList.walks == 0
    assert all(5 <= t < 300 for s in seqs for t in s.output_token_ids)
