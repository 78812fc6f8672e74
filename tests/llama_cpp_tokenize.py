"""llama.cpp's tokenizer as a reference, run under a Python that has llama-cpp-python
($SERVELAB_LLAMA_CPP_PYTHON): reads {"gguf": path, "cases": [{"text", "add_bos", "special"}]} as
JSON on stdin, writes [{"ids", "text", "text_special"}] as JSON on stdout: the ids, then llama.cpp's
own `llama_detokenize` of the ids after the BOS (what an engine decodes) skipping and rendering
control tokens."""

from __future__ import annotations

import ctypes
import json
import sys


def _detokenize(llama_cpp, vocab, ids: list[int], special: bool) -> str:
    tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 64 * len(ids)
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buffer, size, not special, special)
    return buffer.raw[:n].decode("utf-8", errors="replace")


def main() -> None:
    import llama_cpp

    request = json.load(sys.stdin)
    model = llama_cpp.Llama(model_path=request["gguf"], vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    out = []
    for case in request["cases"]:
        ids = model.tokenize(case["text"].encode("utf-8"), add_bos=case["add_bos"], special=case["special"])
        body = ids[1:] if ids[:1] == [model.token_bos()] else ids
        out.append({"ids": ids, "text": _detokenize(llama_cpp, vocab, body, False),
                    "text_special": _detokenize(llama_cpp, vocab, body, True)})  # fmt: skip
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
