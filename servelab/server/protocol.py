"""The OpenAI wire protocol as pydantic models: what clients send and what the server answers.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion); values that pass the types but fall outside a range are checked by
`SamplingParams.validate`, so the server, the offline API and the CLI share one set of limits
and messages. What servelab does with each field OpenAI defines (honoured, informational or
refused) is decided in `fields.py`; fields it has never heard of pass, as in vLLM. `logit_bias`,
`allowed_token_ids`, `bad_words`, `response_format`, `tools` and the structured-output extras
are honoured by server/structured.py.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# --------------------------------------------------------------------------------------------
# Requests


FinishReasonName = Literal["stop", "length", "abort"]  # how an engine request ended, as the API names it
ChatFinishReasonName = Literal["stop", "length", "abort", "tool_calls"]


class _Request(BaseModel):
    # strict: "temperature": "0.5" is a client bug worth reporting; extra="allow": unknown
    # fields from newer clients must not break old servers.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk (GuideLLM sends it)


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # "schema" shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class _SamplingFields(_Request):
    """The sampling parameters common to both endpoints (OpenAI names, vLLM extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions, as in vLLM.
    top_k: int | None = None  # None, 0 or -1: disabled
    min_p: float = 0.0
    ignore_eos: bool = False
    priority: int = 0  # lower runs first when the server's order is "priority"
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None  # None: the model's generation_config.json, else 1.0 (off)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # fast tokenizers join special tokens as they are, as in vLLM
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens; -1: the last max_model_len
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>"
    length_penalty: float = 1.0  # beam search's only, and beam search is refused
    request_id: str | None = None  # the answer's id is cmpl- / chatcmpl- and this
    # Logit edits and output constraints (server/structured.py turns them into SamplingParams).
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prediction: Prediction | None = None  # OpenAI's predicted output (speculative decoding)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(
            self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = None  # top alternatives per token
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM extension: score the prompt, with this many alternatives
    add_special_tokens: bool = True  # the BOS/EOS the tokenizer's post-processor adds


class ContentPart(_Request):
    type: str
    text: str | None = None


class Prediction(_Request):
    """OpenAI's predicted output: text the answer is expected to resemble, verified as drafts."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class _ChatTemplateFields(_Request):
    """How the chat template renders the messages (vLLM's chat extensions): the chat endpoint's,
    and /tokenize's for messages, so that both count the same tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open, for the model to continue
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
        # Tool-using templates (Hermes, Qwen2.5) also render earlier calls and results.
        out: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for key in ("tool_calls", "tool_call_id"):
                if m.model_extra and m.model_extra.get(key) is not None:
                    message[key] = m.model_extra[key]
            out.append(message)
        return out


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM extension
    echo: bool = False  # the answer starts with the last message's content when it has the answer's role
    include_reasoning: bool = True  # there is no reasoning to include or leave out
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call


class TokenizeRequest(_Request):
    """A prompt, or a chat's messages (TokenizeChatRequest below): vLLM's two /tokenize bodies."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: a prompt's True, a chat's False (as the chat endpoint)


class TokenizeChatRequest(_ChatTemplateFields):
    model: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------
# Responses


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0  # the prediction's tokens that verification kept
    rejected_prediction_tokens: int = 0  # the prediction's other tokens


class SpecDecodeUsage(BaseModel):
    """servelab's extension: this request's speculative decoding, in vLLM's spec-decode counter
    terms, so a load generator can see how acceptance varies between requests."""

    num_decode_steps: int = 0  # steps after the prefill's token, drafting or not
    num_drafts: int = 0  # verification steps that scored drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts the output kept beyond each step's one token
    accepted_per_position: list[int] = Field(default_factory=list)  # verifications that kept position i


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # only for a request with a prediction
    spec_decode: SpecDecodeUsage | None = None  # only from a server that may draft for the request

    @model_serializer(mode="wrap")
    def _details_where_set(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for name in ("completion_tokens_details", "spec_decode"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extra


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithoutNulls(BaseModel):
    """OpenAI omits a delta's absent keys rather than sending null."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_WithoutNulls):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonName | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extra


class DeltaMessage(_WithoutNulls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "servelab"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
