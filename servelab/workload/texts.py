"""Prompts about a given passage of English text: where speculative decoding's n-gram lookup hits.

Two kinds, beside the random-words prompts (`random`), whose outputs share nothing with the prompt:

- `edit`: "Rewrite the following text exactly, but replace every "the" with "THE"." and a
  passage. The answer is the passage again with a handful of words changed, so prompt lookup
  (vLLM's `ngram` method) proposes long runs the target model accepts. The output length is
  the edited passage's token count.
- `summarize`: "Summarize the following text in about N words." and a passage. A summary
  reuses phrases of the text, so lookup hits now and then. The output length is `--output-len`,
  or a quarter of the passage (at least 16 tokens).

Passages are cut from the documentation texts CPython ships in `pydoc_data.topics` (79 topics,
about 2,000 distinct paragraphs and 52,000 words; no download), read as one ring of words that
keeps the text's own line breaks and indents. Each request starts at its own word: the
paragraph openings in a seeded order, then every other word in a seeded order, so no two of a
run's first ~52,000 requests share a passage and the server's prefix cache holds nothing but the
instruction. The same seed gives the same prompts under the same Python version (a new CPython
may revise the topics).

The whole prompt (instruction and passage) is `prompt_tokens` long, counted with the tokenizer
when one is given, else estimated from words; passages are cut at word boundaries, so a count
lands within a few tokens of the target (one word of code can be several tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from servelab.errors import InvalidArgument
from servelab.workload.datasets import TOKENS_PER_WORD, Tokenizer, count_tokens

TEXT_KINDS = ("edit", "summarize")
MIN_PASSAGE_TOKENS = 16
MIN_SUMMARY_TOKENS = 16

# Whole-word edits: frequent words, so every passage has some, and small ones, so the answer is
# mostly a copy.
EDITS = (("the", "THE"), ("and", "AND"), ("is", "IS"), ("of", "OF"), ("to", "TO"), ("a", "A"))


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    prompt_tokens: int
    output_tokens: int
    passage: str
    expected_output: str | None  # edit: the exact answer; summarize: None


@dataclass(frozen=True, slots=True)
class _Corpus:
    words: tuple[str, ...]  # each word with the whitespace before it
    paragraph_starts: tuple[int, ...]  # word index where each paragraph begins


@lru_cache(maxsize=1)
def _corpus() -> _Corpus:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package the stdlib's documentation separately
        raise InvalidArgument(
            "the edit and summarize workloads read Python's pydoc_data.topics, which this Python lacks "
            "(install the full standard library, e.g. Debian's libpython3-stdlib)",
            param="dataset_kind",
        ) from None
    words: list[str] = []
    starts: list[int] = []
    seen: set[str] = set()
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            paragraph = paragraph.strip("\n").rstrip()
            # Some topics repeat others' paragraphs (the mapping methods, the operator tables):
            # kept once, so two requests never start on the same text.
            if not paragraph or paragraph in seen:
                continue
            seen.add(paragraph)
            # Each word carries the whitespace before it, so indented lines keep their indent.
            found = re.findall(r"\s*\S+", paragraph)
            starts.append(len(words))
            found[0] = "\n\n" + found[0]
            words.extend(found)
    return _Corpus(tuple(words), tuple(starts))


def _passage(start: int, num_words: int) -> str:
    words = _corpus().words
    n = len(words)
    text = "".join(words[(start + k) % n] for k in range(num_words))
    return text.lstrip("\n") if text.startswith("\n") else text.lstrip()


def _edit_instruction(edit: tuple[str, str]) -> str:
    return f'Rewrite the following text exactly, but replace every "{edit[0]}" with "{edit[1]}".'


def apply_edit(passage: str, edit: tuple[str, str]) -> str:
    return re.sub(rf"\b{re.escape(edit[0])}\b", edit[1], passage)


def _compose(instruction: str, passage: str, answer_label: str) -> str:
    return f"{instruction}\n\nText:\n{passage}\n\n{answer_label}:\n"


class TextPrompts:
    """The prompts of one seeded `edit` or `summarize` workload, request by request."""

    def __init__(self, kind: str, seed: int, tokenizer: Tokenizer | None = None) -> None:
        if kind not in TEXT_KINDS:
            raise InvalidArgument(f"text workload kind must be one of {', '.join(TEXT_KINDS)}, got {kind!r}")
        self.kind = kind
        self.seed = seed
        self.tokenizer = tokenizer
        corpus = _corpus()
        rng = np.random.default_rng([seed, 0x7E47])
        # Paragraph openings first (they read as a text begins), then every other word: each
        # request its own starting word, so its own passage.
        paragraphs = np.asarray(corpus.paragraph_starts, dtype=np.int64)
        inner = np.setdiff1d(np.arange(len(corpus.words), dtype=np.int64), paragraphs)
        self._starts = np.concatenate([rng.permutation(paragraphs), rng.permutation(inner)])

    def _count(self, text: str) -> int:
        return count_tokens(text, self.tokenizer)

    def start_word(self, index: int) -> int:
        """Where request `index`'s passage begins in the ring of words."""
        return int(self._starts[index % len(self._starts)])

    def prompt(self, index: int, prompt_tokens: int, output_tokens: int | None = None) -> TextPrompt:
        """Request `index`'s prompt, about `prompt_tokens` long in all. `output_tokens` is the
        summary's length (None: a quarter of the passage); an edit's is its answer's."""
        if self.kind == "edit":
            if output_tokens is not None:
                raise InvalidArgument(
                    "the edit workload's output is the edited passage, whose length the prompt sets: drop --output-len",
                    param="output_len",
                )
            edit = EDITS[int(np.random.default_rng([self.seed, 0xED17, index]).integers(len(EDITS)))]
            instruction, label = _edit_instruction(edit), "Rewritten text"
        else:
            edit = None
            # The summary's word count is only known once the passage is: size the instruction
            # with a placeholder of the same width class, then fill in the number.
            instruction, label = "Summarize the following text in about 1000 words.", "Summary"
        overhead = self._count(_compose(instruction, "", label))
        want = max(MIN_PASSAGE_TOKENS, prompt_tokens - overhead)
        passage = self._passage_of(self.start_word(index), want)
        if edit is not None:
            answer = apply_edit(passage, edit)
            text = _compose(instruction, passage, label)
            return TextPrompt(text, self._count(text), self._count(answer), passage, answer)
        passage_tokens = self._count(passage)
        out = output_tokens if output_tokens is not None else max(MIN_SUMMARY_TOKENS, passage_tokens // 4)
        words = max(1, round(out / TOKENS_PER_WORD))
        text = _compose(f"Summarize the following text in about {words} words.", passage, label)
        return TextPrompt(text, self._count(text), out, passage, None)

    def _passage_of(self, start: int, num_tokens: int) -> str:
        """The passage from word `start` whose token count comes closest to `num_tokens`, the word
        count rescaled by the tokens per word measured on the last try (documentation text, with
        its code and punctuation, runs above English prose's 4/3)."""
        num_words = max(1, round(num_tokens / TOKENS_PER_WORD))
        best, best_err = "", None
        for _ in range(6):
            text = _passage(start, num_words)
            got = self._count(text)
            if best_err is None or abs(got - num_tokens) < best_err:
                best, best_err = text, abs(got - num_tokens)
            if got == num_tokens:
                break
            step = round((num_tokens - got) * num_words / max(got, 1)) or (1 if got < num_tokens else -1)
            num_words = max(1, num_words + step)
        return best
