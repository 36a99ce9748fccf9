"""Tools on chat completions: what `tools` and `tool_choice` ask for, the prompt, the parsed calls.

- "none" (the default without tools): the output is text. A template that reads `tools` still
  renders them (as vLLM does); one that does not gets no tools prompt from nanoserve either.
- A named function and "required" work on every model: a grammar holds the output to the function's
  arguments (its parameter schema) or to a JSON array of calls `[{"name", "parameters"}, ...]`
  (vLLM's required schema), so the arguments are always valid JSON for their schema.
- "auto" (the default with tools) lets the model choose, so its own tool-call format must be parsed:
  a chat template that writes `<tool_call>` gets the Hermes parser (Qwen 2.5 and other Hermes-style
  templates), one that writes `<|python_tag|>` the Llama 3 JSON parser. A model whose template has
  neither cannot do "auto": a 400 says so.

A chat template that reads `tools` renders them itself. One that does not (SmolLM2's) gets them
from nanoserve in a system message (TOOLS_PROMPT: one JSON object per function between
<functions> tags, and a line saying what to reply for "required" or a named function), and an
assistant's earlier calls written as the JSON array "required" produces.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nanoserve.chat import render_chat
from nanoserve.params import StructuredOutputs
from nanoserve.serving.server.protocol import ApiError, ChatCompletionRequest
from nanoserve.serving.server.tool_parsers import (
    CallArguments,
    CallArray,
    CallStart,
    Content,
    Event,
    Hermes,
    Llama3Json,
    NamedCall,
    Parser,
)

NO_ARGUMENTS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")
PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json}

TOOLS_PROMPT = ("You can call functions. Each is described by a JSON object with its name, a description "
                "and its parameters as a JSON schema:\n<functions>\n{functions}\n</functions>")
REPLY_REQUIRED = ('Call one or more of them: reply only with a JSON array of calls, each '
                  '{{"name": <function name>, "parameters": <its arguments>}}.')
REPLY_NAMED = 'Call the function "{name}": reply only with its arguments, as one JSON object.'


def parser_for_template(template: str | None) -> str | None:
    """The parser for a chat template's own tool-call format, or None if it writes none we know."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask of the prompt, the grammar and the output."""

    choice: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # the request's tools, as OpenAI dicts
    function: str | None = None  # the named function
    parser: str | None = None  # "auto": the model's own format ("hermes", "llama3_json")
    structured_outputs: StructuredOutputs | None = None  # "required" and named: the grammar
    template_reads_tools: bool = False

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def new_parser(self) -> Parser:
        if self.choice == "named":
            return NamedCall(self.function)
        if self.choice == "required":
            return CallArray()
        return PARSERS[self.parser]()


def plan(body: ChatCompletionRequest, tokenizer: Any) -> ToolPlan:
    """Reads tools and tool_choice.

    Raises:
        ApiError: a tool_choice that is not one of CHOICES or a function of `tools`, tool_choice
            without tools, two tools of one name, "auto" on a model without a tool-call parser, or
            a grammar-enforced choice together with response_format.
    """
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    names = [t["function"]["name"] for t in tools]
    if any(t["type"] != "function" for t in tools):
        raise ApiError("tools: only tools of type 'function' are supported", param="tools")
    if len(set(names)) != len(names):
        raise ApiError(f"tools: two tools share a name ({names})", param="tools")
    function = None
    if not isinstance(choice, str):
        function, choice = choice.function.name, "named"
        if function not in names:
            raise ApiError(f"tool_choice names the function {function!r}, which is not among tools {names}",
                           param="tool_choice")
    elif choice not in CHOICES:
        raise ApiError(f"tool_choice={choice!r} must be one of {CHOICES} or a named function", param="tool_choice")
    if not tools and choice != "none":
        raise ApiError(f"tool_choice={choice!r} needs tools", param="tool_choice")
    template = getattr(tokenizer, "chat_template", None)
    # The template reads `tools` when a Jinja statement or expression names the variable (not when
    # the word only appears in its text or inside another name).
    reads_tools = isinstance(template, str) and re.search(r"\{[{%][^}]*\btools\b", template) is not None
    parser = parser_for_template(template) if choice == "auto" else None
    if choice == "auto" and parser is None:
        raise ApiError("tool_choice='auto' (the default when tools are given) needs a parser for the model's own "
                       "tool-call format, and this model's chat template writes none nanoserve knows (Hermes "
                       "<tool_call> blocks, Llama 3 JSON calls): send tool_choice='required' or name a function, "
                       "which a grammar enforces on any model", param="tool_choice", code="auto_tool_choice_unsupported")
    structured = None
    if choice in ("required", "named"):
        if (body.response_format is not None and body.response_format.type != "text") or body.structured_outputs:
            raise ApiError(f"tool_choice={choice!r} and response_format both constrain the output: send one",
                           param="response_format")
        structured = StructuredOutputs(json=_call_schema(tools, function, body.parallel_tool_calls))
    return ToolPlan(choice, tools, function, parser, structured, reads_tools)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_ARGUMENTS


def _call_schema(tools: list[dict[str, Any]], function: str | None, parallel: bool | None) -> dict[str, Any]:
    """A named function's parameter schema, or for "required" an array of calls to any tool."""
    if function is not None:
        return next(_parameters(t) for t in tools if t["function"]["name"] == function)
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema | ({"maxItems": 1} if parallel is False else {})


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan,
                  template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's prompt, with the tools in it (see the module docstring); template_kwargs:
    the request's chat_template_kwargs (a model's own switches, such as Qwen3's `enable_thinking`).

    Raises:
        ApiError: the template rejected the messages or the arguments.
    """
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    for name in ("tools", "tokenize", "add_generation_prompt", "chat_template", "continue_final_message"):
        if name in kwargs:
            raise ApiError(f"chat_template_kwargs may not set {name}: the server sets it", param="chat_template_kwargs")
    if plan.tools and plan.template_reads_tools:
        kwargs["tools"] = plan.tools
    else:
        messages = [_calls_as_text(m) for m in messages]
        if plan.tools and plan.choice != "none":
            messages = _with_tools_prompt(messages, plan)
    try:
        return render_chat(tokenizer, messages, **kwargs)
    except ValueError as e:  # the template's own raise_exception, e.g. roles out of order
        raise ApiError(str(e), param="messages") from None


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_call_id"}
    text = json.dumps([{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls])
    return {"role": message["role"], "content": (message["content"] + "\n" if message["content"] else "") + text}


def _with_tools_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    text = TOOLS_PROMPT.format(functions=functions)
    if plan.choice == "required":
        text += "\n" + REPLY_REQUIRED.format()
    elif plan.choice == "named":
        text += "\n" + REPLY_NAMED.format(name=plan.function)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- the output ------------------------------------------------------------------------------------


def message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The non-streamed assistant message and finish reason: the calls parsed out of `text`.
    A call whose arguments were cut short (finish_reason "length") is left out."""
    parser = plan.new_parser()
    events = parser.feed(text) + parser.finish()
    calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
             for call_id, name, arguments in parser.calls if _is_json(arguments)]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = "".join(e.text for e in events if isinstance(e, Content)).strip()
    return ({"role": "assistant", "content": content or None, "tool_calls": calls},
            "tool_calls" if finish_reason == "stop" else finish_reason)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolDeltas:
    """One streamed completion: its text deltas become OpenAI's content and tool-call deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = plan.new_parser()

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The chunk's delta fields and finish reason ("tool_calls" once a call was made)."""
        events: list[Event] = self.parser.feed(text) + (self.parser.finish() if finished else [])
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls: dict[int, dict[str, Any]] = {}  # one entry per call index in a chunk, as OpenAI sends
        for e in events:
            if isinstance(e, CallStart):
                calls[e.index] = {"index": e.index, "id": e.id, "type": "function",
                                  "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, CallArguments):
                entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += e.text
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = list(calls.values())
        reason = finish_reason if finished else None
        return delta, ("tool_calls" if reason == "stop" and self.parser.calls else reason)
