"""The output side of the engine: the core's plain outputs become text.

Per request it keeps a detokenizer and stop-string matcher (detokenizer.RequestTextStream) and
fills each `EngineOutput`'s `text_delta`. A stop string ends a request the core still runs: the
output says so (finish reason STOP, the string in `stop_reason`) and the caller tells the core
(`EngineCore.finish`). Logprobs are rendered by the API layer from the token ids and logprobs the
output carries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.detokenizer import RequestTextStream

if TYPE_CHECKING:
    from servelab.engine.outputs import EngineOutput
    from servelab.engine.tokenizer import Tokenizer


@dataclass(slots=True)
class _RequestState:
    stream: RequestTextStream
    include_stop_str_in_output: bool
    output_text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        stream = RequestTextStream(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                   params.include_stop_str_in_output, params.min_tokens)  # fmt: skip
        self._requests[request_id] = _RequestState(stream, params.include_stop_str_in_output)

    def forget(self, request_id: str) -> bool:
        """Drops a request's text state (it was aborted or failed); False if it had none."""
        return self._requests.pop(request_id, None) is not None

    def output_text(self, request_id: str) -> str | None:
        state = self._requests.get(request_id)
        return None if state is None else state.output_text

    def process(self, out: EngineOutput) -> EngineOutput | None:
        """Fills `out`'s text in place and returns it; None for a request this processor does
        not hold (aborted while its step ran). A stop string found ends it: `out.finished` turns
        True with finish reason STOP, and the caller must finish it in the core."""
        state = self._requests.get(out.request_id)
        if state is None:
            return None
        finished = out.finished
        new_text_ids = out.new_token_ids
        if out.finish_reason is FinishReason.STOP and not state.include_stop_str_in_output:
            # As vLLM: the EOS or stop token that ended the request adds no text (skip_special_tokens
            # false would show an EOS; a stop token id may be an ordinary word).
            new_text_ids = new_text_ids[:-1]
        delta = state.stream.add(new_text_ids) if new_text_ids else None
        text = delta.text if delta is not None else ""
        stop = delta.stop if delta is not None else None
        if stop is None and finished:
            tail = state.stream.flush()  # held-back text was not a stop string after all (or is one now)
            text += tail.text
            stop = tail.stop
        if stop is not None:
            out.finished = True
            out.finish_reason = FinishReason.STOP
            out.stop_reason = stop
        state.output_text += text
        out.text_delta = text
        if out.finished:
            del self._requests[out.request_id]
        return out


def failed_output(out: EngineOutput, finished_offset_s: float | None) -> EngineOutput:
    """The last output of a request whose output `out` could not be processed: no new tokens or
    text, finish reason ERROR (also when it had just finished: its text is incomplete)."""
    return replace(
        out, new_token_ids=[], text_delta="", finished=True, finish_reason=FinishReason.ERROR, logprobs=None,
        prompt_logprobs=[], token_offsets_s=[], prev_token_offset_s=out.last_token_offset_s,
        finished_offset_s=out.finished_offset_s if finished_offset_s is None else finished_offset_s,
    )  # fmt: skip
