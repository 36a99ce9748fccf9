"""The OpenAI wire format in: request bodies as strict pydantic models, and their SamplingParams.

What goes back out (logprobs, usage, ids) is nanoserve.serving.server.responses.

Bodies are validated strictly (a string where a number belongs is an error, not coerced) and
unknown fields are ignored, as OpenAI clients send fields a server may not know, except those
listed in `unimplemented.UNIMPLEMENTED_FIELDS`, which change the response: set to anything but
their neutral value they are a 400 naming the field. The vLLM extras (top_k, min_p, ignore_eos,
...) are accepted beside OpenAI's own. A sampling field reaches the engine only if SamplingParams
has a field of that name; a field set to something other than its neutral value that the engine
cannot honour is refused, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanoserve.params import SamplingParams, StructuredOutputs
from nanoserve.serving.server.unimplemented import first_unimplemented


class ApiError(Exception):
    """An error the client caused or must see, rendered as OpenAI's error body."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.code, self.type = message, status_code, param, code, type
        self.headers = headers  # sent with the response (Retry-After on a 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False  # one extra chunk before [DONE] with usage and no choices


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """Fields both endpoints share. None means "not sent": the engine's default applies."""

    model: str | None = None
    temperature: float | None = None  # OpenAI's default is 1.0, as SamplingParams'
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json": ...} | {"regex": ...} | ...
    # chat, with a reasoning parser: the think block's budget (None: the server's --reasoning-budget; -1: no limit)
    max_reasoning_tokens: int | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 with echo: the prompt alone
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k, per choice
    best_of: int | None = None
    suffix: str | None = None


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]  # one input or a batch; text or token ids
    encoding_format: str = "float"  # "float": lists of numbers; "base64": little-endian float32 bytes
    dimensions: int | None = None  # the first n values, normalised again (a pooling that normalises)
    user: str | None = None


def embedding_inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, one per vector: a string or a list of token ids is one input.

    Raises:
        ApiError: an empty input list, or an empty input (naming its index).
    """
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise ApiError("input is empty: send a string, a list of strings, token ids or lists of token ids",
                       param="input")
    for i, item in enumerate(inputs):
        if not item:
            raise ApiError(f"input[{i}] is empty: it needs at least 1 token", param="input")
    return list(inputs)


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Body):
    type: str  # "function", the only kind
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str  # "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length, as OpenAI
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: arguments to the chat template (enable_thinking)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validates a JSON body; raises ApiError(400) naming the first bad field, or for a generation
    request (completions, chat) the first field that asks for something unimplemented."""
    try:
        body = model.model_validate_json(raw)
        if issubclass(model, _SamplingFields) and (
                found := first_unimplemented(json.loads(raw), chat=issubclass(model, ChatCompletionRequest))):
            name, what = found
            raise ApiError(f"{name} is not supported by this server (it asks for {what})", param=name,
                           code="unsupported_parameter")
        return body
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(f"invalid JSON body: {first['msg']}") from None
        loc = [str(x) for x in first["loc"] if not (isinstance(x, str) and x in _UNION_BRANCHES)]
        param = ".".join(loc) or None
        got = f" (got {first['input']!r})" if loc and first["type"] != "missing" else ""
        raise ApiError(f"{param or 'body'}: {first['msg']}{got}", param=param) from None


# pydantic names the union branch it tried in `loc` ("prompt", "str"); the client wants "prompt"
_UNION_BRANCHES = {"str", "list[int]", "list[str]", "list[list[int]]", "list[ContentPart]", "int", "float",
                   "NamedToolChoice"}

# OpenAI/vLLM field -> (SamplingParams field, value that asks for nothing)
_PASS_THROUGH = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "seed": ("seed", None),
    "top_k": ("top_k", -1),
    "min_p": ("min_p", 0.0),
    "ignore_eos": ("ignore_eos", False),
    "stop_token_ids": ("stop_token_ids", []),
    "stop": ("stop", []),
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_tokens": ("min_tokens", 0),
    "n": ("n", 1),
    "logprobs": ("logprobs", None),
}
_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(body: _SamplingFields, max_tokens: int, logprobs: int | None = None,
                    structured_outputs: StructuredOutputs | None = None,
                    prompt_logprobs: int | None = None, reasoning: dict[str, Any] | None = None) -> SamplingParams:
    """Maps a request body to SamplingParams; `logprobs` is the top-n count the endpoint asked for,
    `structured_outputs` the grammar the output must match (see `structured_outputs`),
    `prompt_logprobs` the top-n count over the prompt (echo with logprobs, or vLLM's field),
    `reasoning` the think block's SamplingParams fields (reasoning.sampling_fields).

    Raises:
        ApiError: a field the engine does not support was set, or SamplingParams rejected a value.
    """
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "structured_outputs": structured_outputs,
                              "prompt_logprobs": prompt_logprobs} | (reasoning or {})
    fields = dict(vars(body)) | {"logprobs": logprobs}  # each endpoint spells logprobs its own way
    for name, (field, neutral) in _PASS_THROUGH.items():
        value = fields[name]
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if field not in _PARAM_FIELDS:
            if value == neutral or (neutral == [] and not value):
                continue
            raise ApiError(f"{name} is not supported by this engine", param=name)
        kwargs[field] = tuple(value) if isinstance(value, list) else value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ApiError(str(e), param=param_of(str(e))) from None


def structured_outputs(body: _SamplingFields) -> StructuredOutputs | None:
    """The grammar `response_format` (OpenAI) or `structured_outputs` (vLLM) asks for; None for
    text. A schema that does not compile is the engine's ValueError, at submit."""
    fmt, extra = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and extra:
        raise ApiError("response_format and structured_outputs both constrain the output: send one",
                       param="structured_outputs")
    if extra:
        try:
            return StructuredOutputs(**extra)
        except (TypeError, ValueError) as e:
            raise ApiError(f"structured_outputs: {e}", param="structured_outputs") from None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.type != "json_schema":
        raise ApiError(f"response_format.type={fmt.type!r} must be 'text', 'json_object' or 'json_schema'",
                       param="response_format.type")
    if fmt.json_schema is None:
        raise ApiError("response_format json_schema needs its json_schema object", param="response_format.json_schema")
    schema = fmt.json_schema.schema_
    return StructuredOutputs(json_object=True) if schema is None else StructuredOutputs(json=schema)


def param_of(message: str) -> str | None:
    """The parameter an engine ValueError names ("top_p=2.0 must be in (0, 1]" -> "top_p")."""
    match = re.match(r"(\w+)=", message)
    return match.group(1) if match else None


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a list of one prompt is accepted)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(f"{len(prompt)} prompts in one request: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError("prompt is empty: it needs at least 1 token", param="prompt")
    return prompt


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: role and plain-text content, and an assistant's
    tool calls (arguments as a dict, as chat templates read them) or a tool message's call id."""
    if not body.messages:
        raise ApiError("messages is empty: it needs at least 1 message", param="messages")
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise ApiError("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, f"messages.{i}.tool_calls")}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _arguments(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ApiError(f"{param}: arguments {text[:80]!r} is not JSON", param=param) from None


def chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k`; the engine wants one count."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None
