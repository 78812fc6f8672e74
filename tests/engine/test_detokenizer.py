"""Incremental detokenization (UTF-8 safe streaming) and stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.engine.detokenizer import IncrementalDetokenizer, RequestTextStream, StopChecker
from servelab.engine.tokenizer import Tokenizer

try:  # tests/engine as a package or as a plain directory on sys.path
    from .test_tokenizer import gguf_metadata_from, train_bpe
except ImportError:
    from test_tokenizer import gguf_metadata_from, train_bpe

MULTIBYTE = ["ζωή Ωμέγα", "日本語のテキスト", "emoji 😀 and 👩‍💻 and 🇫🇷!", "Привет, мир", "∑∫√∞ → ←", "e\u0301 中文"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # A small byte-level BPE: most non-ASCII characters are several byte tokens.
    return Tokenizer.from_gguf(gguf_metadata_from(train_bpe(None, vocab_size=400), "gpt2"))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_split_across_tokens_stream_cleanly(tok, text):
    ids = tok.encode(text)
    # the test only means something if some token is a fragment of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Say: ")), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_random_chunking_and_long_outputs_concatenate_to_full_decode(tok):
    rng = random.Random(0)
    text = " ".join(rng.choice(MULTIBYTE + ["plain words", "x = 1\n", "  "]) for _ in range(200))
    ids = tok.encode(text)
    chunks = [rng.randint(1, 4) for _ in ids]
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    deltas = stream(detok, ids, chunks)
    assert "".join(deltas) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("done") + [im_end]
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "done"
    assert "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids)) == "done<|im_end|>"


def test_incomplete_character_is_held_until_flush(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:1]) == ""  # only part of the emoji's bytes so far
    assert detok.flush() == "\ufffd"  # the model really stopped mid-character
    assert detok.flush() == ""


class MetaspaceLike:
    """A SentencePiece-style decoder: '▁' is a space, and a leading space of the string is dropped."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_the_leading_space_of_the_first_output_token():
    dec = MetaspaceLike(["▁Hello", "▁world", "!"])
    detok = IncrementalDetokenizer(dec, prompt_token_ids=[0])
    assert detok.add([1]) == " world"
    assert detok.add([2]) == "!"


# ------------------------------------------------------------------------------ StopChecker


def feed(checker: StopChecker, pieces: list[str]) -> tuple[str, str | None, int | None]:
    out, stop, offset = [], None, None
    for piece in pieces:
        check = checker.add(piece)
        out.append(check.text)
        if check.stop is not None and stop is None:
            stop, offset = check.stop, check.stop_offset
    out.append(checker.flush())
    return "".join(out), stop, offset


def test_stop_string_spanning_tokens_is_found_and_excluded():
    checker = StopChecker(["STOP"])
    assert checker.add("Hel").text == "Hel"
    assert checker.add("lo ST").text == "lo "  # "ST" may start a stop: held back
    check = checker.add("OP and more")
    assert (check.text, check.stop, check.stop_offset) == ("", "STOP", 6)
    assert checker.add("later").text == ""  # nothing after a stop
    assert checker.flush() == ""


def test_include_stop_emits_the_stop_string_and_nothing_after():
    checker = StopChecker(["STOP"], include_stop=True)
    assert checker.add("lo ST").text == "lo "
    check = checker.add("OP and more")
    assert (check.text, check.stop, check.stop_offset) == ("STOP", "STOP", 3)
    assert checker.add("later").text == "" and checker.flush() == ""
    assert feed(StopChecker(["world", "lo w"], include_stop=True), ["hel", "lo world"]) == ("hello w", "lo w", 3)


def test_partial_match_is_released_when_it_is_not_a_stop():
    checker = StopChecker(["STOP"])
    assert checker.add("a ST").text == "a "
    assert checker.add("O").text == ""
    assert checker.add("RM").text == "STORM"
    assert checker.add("ST").text == ""
    assert checker.flush() == "ST"  # the request ended for another reason: held text was not a stop


def test_earliest_stop_wins_and_overlapping_prefixes():
    assert feed(StopChecker(["world", "lo w"]), ["hel", "lo world"]) == ("hel", "lo w", 3)
    assert feed(StopChecker(["aab"]), ["a", "a", "a", "b", "c"]) == ("a", "aab", 1)
    assert feed(StopChecker(["\n\n"]), ["x\n", "y\n", "\nz"]) == ("x\ny", "\n\n", 3)
    assert feed(StopChecker([]), ["no", " stops"]) == ("no stops", None, None)
    assert feed(StopChecker(["", "!"]), ["hi", "!"]) == ("hi", "!", 2)  # empty stop strings are ignored


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc \n", max_size=40),
    stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_stop_checker_properties(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stop, offset = feed(StopChecker(stops), pieces)
    if not any(s in text for s in stops):
        assert (emitted, stop) == (text, None)
        return
    assert stop is not None and offset == len(emitted)
    assert text.startswith(emitted + stop)
    assert not any(s in emitted for s in stops)  # a stop inside emitted text would have been caught


def test_request_text_stream_with_real_tokens(tok):
    ids = tok.encode("The answer is 42.\nUser: and more text")
    ts = RequestTextStream(tok, prompt_token_ids=[], stop=["\nUser:"])
    text, stop = "", None
    for i in ids:
        delta = ts.add([i])
        text += delta.text
        if delta.stop:
            stop = delta.stop
            break
    assert (text, stop) == ("The answer is 42.", "\nUser:")
    assert ts.flush().text == ""

    ts = RequestTextStream(tok, prompt_token_ids=[], stop=["never"])
    ids = tok.encode("ends with nev")
    text = "".join(ts.add([i]).text for i in ids)
    assert text == "ends with "
    assert text + ts.flush().text == "ends with nev"


def test_no_stop_string_ends_a_request_before_min_tokens(tok):
    # vLLM's rule: stop strings are looked for once the output has more than min_tokens tokens.
    ids = tok.encode("a stop here, then more text and a stop again")
    first = next(n for n in range(1, len(ids) + 1) if "stop" in tok.decode(ids[:n]))

    def run(min_tokens: int) -> tuple[str, int]:
        ts = RequestTextStream(tok, prompt_token_ids=[], stop=["stop"], min_tokens=min_tokens)
        text = ""
        for n, i in enumerate(ids, 1):
            delta = ts.add([i])
            text += delta.text
            if delta.stop:
                return text, n
        return text + ts.flush().text, len(ids)

    assert run(0) == ("a ", first)  # the first stop ends it
    text, n = run(first)  # the first stop falls within min_tokens: it streams on to the second
    assert n > first and text.startswith("a stop here") and text.endswith(" a ")
