"""Completions' echo rendering when a prompt's scores arrive after a choice opens: the prompt is
scored by its first choice only, so a sibling that streams first must wait for those scores, and
its stream must still add up to the whole answer."""

from __future__ import annotations

from types import SimpleNamespace

from servelab.core.sequence import FinishReason, SamplingParams, TokenLogprobs
from servelab.engine.outputs import EngineOutput
from servelab.engine.tokenizer import Tokenizer
from servelab.server import protocol as p
from servelab.engine.client import EngineRequest
from servelab.server.prompts import EchoPrompt
from servelab.server.prompt_scoring import token_text_offsets
from servelab.server.render import CompletionRenderer


def test_a_sibling_that_opens_before_its_prompt_is_scored_waits(tiny_model_dir):
    tokenizer = Tokenizer.from_hf_dir(tiny_model_dir)
    text = "hello there"
    ids = tokenizer.encode(text)
    req = p.CompletionRequest(prompt=text, n=2, echo=True, logprobs=0, max_tokens=2, stream=True)
    params = SamplingParams(max_tokens=2, logprobs=0, prompt_logprobs=0)
    sibling_params = params.sibling(seed=None, max_tokens=2, prompt_logprobs=None)
    requests = [EngineRequest("r-0", ids, params), EngineRequest("r-1", ids, sibling_params)]
    state = SimpleNamespace(front=SimpleNamespace(tokenizer=tokenizer), model_name="m")
    echoes = [EchoPrompt(text, token_text_offsets(tokenizer, ids, len(text)))]
    renderer = CompletionRenderer(state, "cmpl-x", req, requests, echoes=echoes)
    scorer, sibling = (r.request_id for r in requests)
    out_ids = tokenizer.encode(" ok go")[:2]
    prompt_logprobs = {scorer: [], sibling: []}

    def output(rid: str, k: int) -> EngineOutput:
        done = k == len(out_ids) - 1
        piece = tokenizer.decode([out_ids[k]])
        scored, prompt_logprobs[rid] = prompt_logprobs[rid], []
        return EngineOutput(rid, [out_ids[k]], piece, done, FinishReason.LENGTH if done else None,
                            [TokenLogprobs(out_ids[k], -0.5)], num_prompt_tokens=len(ids), num_output_tokens=k + 1,
                            max_tokens=2, prompt_logprobs=scored)  # fmt: skip

    def chunk(out: EngineOutput) -> dict | None:
        return renderer.chunk(renderer.update(out), out)

    streamed: dict[int, list[dict]] = {0: [], 1: []}
    assert chunk(output(sibling, 0)) is None  # its prompt's scores are not in yet
    prompt_logprobs[scorer] = [TokenLogprobs(t, -1.0 - i) for i, t in enumerate(ids[1:])]
    for out in (output(scorer, 0), output(sibling, 1), output(scorer, 1)):
        index = int(out.request_id[-1])
        streamed[index].append(chunk(out)["choices"][0])
    whole = {c["index"]: c for c in renderer.response()["choices"]}
    for index, chunks in streamed.items():
        assert "".join(c["text"] for c in chunks) == whole[index]["text"] == text + tokenizer.decode(out_ids)
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [v for c in chunks for v in c["logprobs"][key]] == whole[index]["logprobs"][key], (index, key)
    assert whole[1]["logprobs"]["token_logprobs"][: len(ids)] == [None, *(-1.0 - i for i in range(len(ids) - 1))]
