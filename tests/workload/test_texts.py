"""The edit and summarize workloads: passages of Python's own docs, one per request, with the
lengths a tokenizer measures."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from pydoc_data.topics import topics

from servelab.bench.prompts import PromptBuilder
from servelab.bench.session import BenchSession
from servelab.errors import InvalidArgument
from servelab.workload import WorkloadSpec, add_workload_arguments, workload_from_args
from servelab.workload.texts import EDITS, TextPrompts, apply_edit

ALL_DOCS = "\n".join(topics.values())


# A tokenizers-library tokenizer.json that splits on whitespace and gives every word one id.
WORD_LEVEL = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
    "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"},
}  # fmt: skip


def word_pieces(text: str) -> list[str]:
    """A stand-in tokenizer: every word and every run of punctuation is a token, so documentation
    text runs well above the 4/3 tokens per word the estimate assumes."""
    return re.findall(r"\w+|[^\w\s]+", text)


def test_edit_prompts_copy_a_docs_passage_and_ask_for_one_edit():
    maker = TextPrompts("edit", seed=3)
    for i in range(20):
        p = maker.prompt(i, 300)
        lines = [line.strip() for line in p.passage.splitlines() if line.strip()]
        assert len(lines) > 3 and all(line in ALL_DOCS for line in lines)  # the docs' own lines
        edit = next(e for e in EDITS if f'replace every "{e[0]}" with "{e[1]}"' in p.text)
        assert p.text.endswith(f"Text:\n{p.passage}\n\nRewritten text:\n")
        assert p.expected_output == apply_edit(p.passage, edit)


def test_apply_edit_replaces_whole_words_only():
    assert apply_edit("the theme of the other", ("the", "THE")) == "THE theme of THE other"
    assert apply_edit("a cat, a.b and abc", ("a", "A")) == "A cat, A.b and abc"


def test_the_seed_fixes_the_prompts():
    a = [TextPrompts("edit", seed=1).prompt(i, 200).text for i in range(10)]
    assert a == [TextPrompts("edit", seed=1).prompt(i, 200).text for i in range(10)]
    b = [TextPrompts("edit", seed=2).prompt(i, 200).text for i in range(10)]
    assert not set(a) & set(b)


def test_every_request_gets_its_own_passage_past_one_pass_over_the_paragraphs():
    maker = TextPrompts("edit", seed=0)
    n = 3000  # more requests than the docs have distinct paragraphs (about 2,000)
    passages = [maker.prompt(i, 100).passage for i in range(n)]
    assert len(set(passages)) == n
    starts = [maker.start_word(i) for i in range(n)]
    assert len(set(starts)) == n


def test_lengths_are_the_tokenizers():
    maker = TextPrompts("edit", seed=0, tokenizer=word_pieces)
    for i, target in enumerate((64, 200, 500, 1000)):
        p = maker.prompt(i, target)
        assert p.prompt_tokens == len(word_pieces(p.text))
        assert abs(p.prompt_tokens - target) <= 2
        assert p.output_tokens == len(word_pieces(p.expected_output))
    estimated = TextPrompts("edit", seed=0).prompt(0, 500)
    assert abs(estimated.prompt_tokens - 500) <= 2  # the word-count estimate, without a tokenizer


def test_a_workload_counts_with_its_own_tokenizer_as_bench_counts_with_its():
    """`sim --tokenizer` sets WorkloadSpec.tokenizer: the simulated requests are bench's, token for token."""
    spec = WorkloadSpec(num_requests=4, concurrency=1, input_len="200", dataset_kind="edit", seed=3)
    counted = WorkloadSpec(num_requests=4, concurrency=1, input_len="200", dataset_kind="edit", seed=3,
                           tokenizer=word_pieces)  # fmt: skip
    assert [r.to_dict() for r in counted.generate()] == [r.to_dict() for r in spec.generate(tokenizer=word_pieces)]
    assert [r.output_tokens for r in counted.generate()] != [r.output_tokens for r in spec.generate()]


def test_sim_tokenizer_flag(tmp_path, capsys):
    from servelab.cli import main

    tok = tmp_path / "tokenizer.json"
    argv = ["sim", "--model", "smollm2-135m", "--dataset-kind", "edit", "--num-requests", "4", "--concurrency", "2",
            "--json"]  # fmt: skip
    assert main([*argv, "--tokenizer", str(tok)]) == 2
    assert "no such file" in capsys.readouterr().err
    tok.write_text(json.dumps(WORD_LEVEL))  # a word-level tokenizer.json: one token a word
    assert main([*argv, "--tokenizer", str(tok)]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert exact["summary"]["output_throughput"] != estimated["summary"]["output_throughput"]


def test_a_summary_is_a_quarter_of_the_passage_or_the_length_asked():
    maker = TextPrompts("summarize", seed=0, tokenizer=word_pieces)
    p = maker.prompt(0, 400)
    passage_tokens = len(word_pieces(p.passage))
    assert p.output_tokens == passage_tokens // 4 and p.expected_output is None
    assert f"in about {round(p.output_tokens * 3 / 4)} words." in p.text and p.text.endswith("Summary:\n")
    assert maker.prompt(0, 400, output_tokens=50).output_tokens == 50
    assert TextPrompts("summarize", seed=0).prompt(1, 30).output_tokens == 16  # never under 16


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_flag_makes_a_text_workload():
    spec = workload_from_args(_args("--dataset-kind", "edit", "--num-requests", "8", "--input-len", "100-200"))
    assert spec.kind == "edit" and spec.to_dict()["dataset_kind"] == "edit"
    assert "edit a Python docs passage, uniform:100,200 in" in spec.describe()
    reqs = spec.generate(tokenizer=word_pieces)
    assert len({r.prompt_text for r in reqs}) == 8
    for r in reqs:
        assert 98 <= r.prompt_tokens <= 202 and r.prompt_tokens == len(word_pieces(r.prompt_text))
        assert r.output_tokens < r.prompt_tokens  # the passage again, without the instruction
    default = WorkloadSpec(num_requests=4, concurrency=1, dataset_kind="summarize")
    assert str(default.input_dist) == "uniform:128,512" and "a quarter of the passage out" in default.describe()
    assert WorkloadSpec(concurrency=1).to_dict()["dataset_kind"] == "random"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset_kind": "edit", "output_len": "64"}, "drop --output-len"),
        ({"dataset_kind": "edit", "dataset": "x.json"}, "--dataset FILE is a ShareGPT file"),
        ({"dataset_kind": "summarize", "trace": "t.jsonl", "concurrency": 1}, "a trace carries its own prompts"),
        ({"dataset_kind": "edit", "shared_prefix_fraction": 0.5}, "drop --shared-prefix"),
        ({"dataset_kind": "sharegpt"}, "--dataset FILE"),
        ({"dataset_kind": "sonnet"}, "--dataset-kind must be one of random, sharegpt, edit, summarize"),
    ],
)
def test_conflicting_flags_are_refused_by_name(kwargs, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        WorkloadSpec(**{"concurrency": 1, **kwargs})


def test_the_warm_up_of_a_text_workload_sends_passages_the_run_does_not():
    workload = WorkloadSpec(num_requests=5, concurrency=1, dataset_kind="edit", input_len="80")
    session = BenchSession(None, PromptBuilder(None))  # type: ignore[arg-type]  # no client: nothing is sent
    measured = workload.generate()
    warm = session._warmup_specs(workload, measured, 3)
    assert len(warm) == 3 and not {s.prompt_text for s in warm} & {s.prompt_text for s in measured}
    random = WorkloadSpec(num_requests=5, concurrency=1)
    specs = random.generate()
    assert session._warmup_specs(random, specs, 3) is specs  # random prompts vary by round already
