"""llama.cpp's tokenization of tiny SentencePiece vocabularies, kept as a golden file so the parity
tests run where llama.cpp is not installed. Regenerate (after changing the texts or vocabularies)
with a Python that has llama-cpp-python:

    SERVELAB_LLAMA_CPP_PYTHON=/path/to/python python -m tests.engine.spm_golden
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tests.tiny_spm import SpmVocab, gemma_vocab, llama_vocab, phi3_vocab, write_vocab_gguf

GOLDEN = Path(__file__).parent / "data" / "spm_golden.json"
REFERENCE_SCRIPT = Path(__file__).parents[1] / "llama_cpp_tokenize.py"

# name -> (vocabulary, general.name: llama.cpp keys its Phi-3 whitespace rule on it)
VOCABS = {
    "llama": (llama_vocab, "tiny-llama"),
    "gemma": (gemma_vocab, "tiny-gemma"),
    "phi3": (phi3_vocab, "Phi-3 tiny"),
}

TEXTS = [
    "", " ", "  ", "\n", "Hello world", "hello world", " hello  world ", "   leading and trailing   ",
    "The quick brown fox jumps over the lazy dog.", "line one\nline two\n\nline four", "tab\tseparated\tvalues",
    "digits 0123456789 and 3.14159", "café crème brûlée", "naïve façade", "日本語のテキスト", "emoji 🙂🙃 and ✓",
    "Zürich € £ ¥ ÆØÅ", "mixed 日本 and english", "▁ literal marker ▁▁", "<0x41> is not a byte token",
    "[INST] What is the capital of France? [/INST]", "<s>[INST] hi [/INST] hello</s>", "x<tool>y  <tool>  z",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<|user|>\nWhere is Paris?<|end|>\n<|assistant|>\n",
    "<|user|> \t spaced <|end|>  \n<|endoftext|> after", "<unk> and <pad> and <eos> and <bos>", "a" * 40, "ab" * 30,
    "model prefill decode batch queue server request latency", "\r\nwindows\r\nline", "\u3000ideographic space",
]  # fmt: skip


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    atoms = list("abcdefghijklmnopqrstuvwxyzTHEQW0123456789.,!?:") + [" ", " ", "  ", "\n", "\t", "é", "ï", "ø", "€",
             "🙂", "日", "本", "語", "Ω", "the ", "model ", "cache", "▁", "<s>", "</s>", "[INST]", "<tool>",
             "<start_of_turn>", "<end_of_turn>", "<|end|>", "<|user|>"]  # fmt: skip
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def cases() -> list[dict]:
    texts = TEXTS + _random_texts(60, seed=0)
    return [
        {"text": t, "add_bos": b, "special": s} for t in texts for b, s in ((True, True), (False, True), (True, False))
    ]


def llama_cpp(python: str, gguf: Path, requests: list[dict]) -> list[dict]:
    """llama.cpp's ids and text for each request (tests/llama_cpp_tokenize.py, run by `python`)."""
    run = subprocess.run(
        [python, str(REFERENCE_SCRIPT)],
        input=json.dumps({"gguf": str(gguf), "cases": requests}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode:
        raise RuntimeError(f"llama.cpp reference failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout)


def vocab_gguf(directory: Path, name: str) -> tuple[SpmVocab, Path]:
    make, gguf_name = VOCABS[name]
    vocab = make()
    return vocab, write_vocab_gguf(directory / f"{name}.gguf", vocab, name=gguf_name)


def main() -> None:
    python = os.environ.get("SERVELAB_LLAMA_CPP_PYTHON")
    if not python:
        sys.exit("set SERVELAB_LLAMA_CPP_PYTHON to a Python with llama-cpp-python")
    requests = cases()
    golden: dict = {"vocabs": {}, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (_, gguf_name) in VOCABS.items():
            vocab, path = vocab_gguf(Path(tmp), name)
            golden["vocabs"][name] = {**asdict(vocab), "name": gguf_name}
            golden["cases"][name] = [
                {**c, "ids": r["ids"], "decoded": r["text"], "decoded_special": r["text_special"]}
                for c, r in zip(requests, llama_cpp(python, path, requests))
            ]
    GOLDEN.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}: {sum(len(c) for c in golden['cases'].values())} cases")


if __name__ == "__main__":
    main()
