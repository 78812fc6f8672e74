"""The prompt's own logprobs on the wire: completions' `echo` with `logprobs` (OpenAI's legacy
shape, what evaluation harnesses read to score loglikelihoods) and vLLM's `prompt_logprobs`
extra. The engine scores the prompt during prefill (SamplingParams.prompt_logprobs); this module
only decides how many alternatives to ask for and renders what came back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servelab.engine.detokenizer import IncrementalDetokenizer
from servelab.errors import InvalidArgument

if TYPE_CHECKING:
    from servelab.core.plan import TokenLogprobs


def prompt_logprobs_wanted(*, prompt_logprobs: int | None, echo_logprobs: int | None, stream: bool) -> int | None:
    """How many top alternatives the engine must score each prompt token with (None: no scoring)."""
    if prompt_logprobs is not None and stream:
        # As vLLM: the extra belongs to a whole answer, not to a chunk.
        raise InvalidArgument("prompt_logprobs is not available with stream=true", param="prompt_logprobs")
    wanted = [k for k in (prompt_logprobs, echo_logprobs) if k is not None]
    return max(wanted) if wanted else None


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_text_offsets(tokenizer: Any, token_ids: list[int], text_len: int) -> list[int]:
    """Where each token starts in the text the ids decode to: the length of the text complete
    before it, as the streaming detokenizer emits it (the tokens of one split UTF-8 character
    share its offset; special tokens add no text), so that offsets index the echoed text."""
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    out = []
    for token_id in token_ids:
        out.append(min(len(detokenizer.text), text_len))
        detokenizer.add([token_id])
    return out


def vllm_prompt_logprobs(tokenizer: Any, scored: list[TokenLogprobs], k: int) -> list[dict[str, dict] | None]:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token (`scored`: every prompt token's but the first's) and its top-k
    alternatives."""
    out: list[dict[str, dict] | None] = [None]
    for lp in scored:
        entry = {str(lp.token_id): _entry(tokenizer, lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(t), _entry(tokenizer, t, v, rank))
        out.append(entry)
    return out


def _entry(tokenizer: Any, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}


def echoed_logprobs(first_token_id: int, scored: list[TokenLogprobs],
                    k: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:  # fmt: skip
    """(token id, logprob, top-k) for every prompt token, the first one (`first_token_id`) without
    logprobs, as OpenAI's echo returns them."""
    first: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(first_token_id, None, None)]
    return first + [(lp.token_id, lp.logprob, lp.top[:k]) for lp in scored]
