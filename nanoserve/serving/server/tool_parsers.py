"""Tool calls out of generated text, incrementally: one parser per tool-call format.

A parser is fed the completion's text as it grows (`feed`, then `finish` once) and returns
events: content text for the client, a call's header (its index, id and function name), and
fragments of a call's arguments (JSON text). Concatenated, a call's fragments are its arguments;
streamed, they become OpenAI's tool-call deltas. Four formats:

- NamedCall: the whole output is the arguments of one named function (tool_choice names it; the
  grammar holds the output to that function's parameter schema).
- CallArray: the output is `[{"name": ..., "parameters": {...}}, ...]` (tool_choice "required"; the
  grammar holds it to that shape, one entry per call, as vLLM's required schema).
- Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among free text (Qwen 2.5
  and other Hermes-style templates).
- Llama3Json: the whole output is one or more `{"name": ..., "parameters": {...}}` objects separated
  by ";" (Llama 3.1-3.3's JSON tool calling; the <|python_tag|> token is not in the text).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # which call of the completion, from 0
    id: str  # "call_..."
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next fragment of the call's arguments (JSON text)


Event = Content | CallStart | CallArguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Parser:
    """Base: holds every call started so far (name and arguments), for the non-streamed message."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (id, name, arguments so far)

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        return []

    def _start(self, name: str) -> CallStart:
        self.calls.append((new_call_id(), name, ""))
        return CallStart(len(self.calls) - 1, self.calls[-1][0], name)

    def _arguments(self, text: str) -> CallArguments:
        call_id, name, arguments = self.calls[-1]
        self.calls[-1] = (call_id, name, arguments + text)
        return CallArguments(len(self.calls) - 1, text)

    def _whole_call(self, name: str, arguments: object) -> list[Event]:
        return [self._start(name), self._arguments(json.dumps(arguments, ensure_ascii=False))]


class NamedCall(Parser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self.calls else [self._start(self.name)]
        return events + ([self._arguments(text)] if text else [])


class CallArray(Parser):
    """A character scanner over the array: it tracks depth and strings, reads each call's "name"
    and streams its "parameters" value as it is written, whatever the key order."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # 1 inside the array, 2 inside a call object, 3 and more inside its parameters
        self.in_string = self.escaped = False
        self.token = ""  # the key or the name being read inside a call object
        self.key: str | None = None  # the key whose value comes next
        self.name: str | None = None
        self.header_sent = False
        self.args = ""  # parameters text not handed out yet (held while the name is unknown)
        self.in_parameters = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            between_values = self.depth == 2 and not self.in_parameters
            if self.in_parameters:
                self.args += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                if between_values:
                    self.token += ch
                    if not self.in_string and self.key == "name":
                        self.name = json.loads(self.token)
                        events += self._emit()
                continue
            if ch == '"':
                self.in_string = True
                if between_values:
                    self.token = ch
            elif ch in "{[":
                self.depth += 1
                if self.depth == 2:  # a new call
                    self.key, self.name, self.header_sent, self.args = None, None, False, ""
                elif between_values and self.key == "parameters":
                    self.in_parameters, self.args = True, ch
            elif ch in "}]":
                self.depth -= 1
                if self.in_parameters and self.depth == 2:
                    self.in_parameters = False
                    events += self._emit()
            elif between_values and ch == ":":
                self.key = json.loads(self.token)
            elif between_values and ch == ",":
                self.key = None
        if self.in_parameters:
            events += self._emit()
        return events

    def _emit(self) -> list[Event]:
        if self.name is None:
            return []  # parameters came before the name: held until it is known
        events: list[Event] = []
        if not self.header_sent:
            events.append(self._start(self.name))
            self.header_sent = True
        if self.args:
            events.append(self._arguments(self.args))
            self.args = ""
        return events


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of text could be the start of tag (held until the next feed)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class Hermes(Parser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""
        self.inside = False  # between a START and its END

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if self.inside:
                end = self.buf.find(self.END)
                if end < 0:
                    return events
                events += self._call(self.buf[:end], self.START + self.buf[:end] + self.END)
                self.buf, self.inside = self.buf[end + len(self.END):], False
            else:
                start = self.buf.find(self.START)
                if start < 0:
                    cut = len(self.buf) - _held_back(self.buf, self.START)
                    out, self.buf = self.buf[:cut], self.buf[cut:]
                    return events + ([Content(out)] if out else [])
                if start:
                    events.append(Content(self.buf[:start]))
                self.buf, self.inside = self.buf[start + len(self.START):], True

    def finish(self) -> list[Event]:
        buf, self.buf = self.buf, ""
        if self.inside:  # a block the model never closed: a call if it parses, else text
            return self._call(buf, self.START + buf)
        return [Content(buf)] if buf else []

    def _call(self, body: str, raw: str) -> list[Event]:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            return [Content(raw)]
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return [Content(raw)]
        return self._whole_call(name, arguments)


class Llama3Json(Parser):
    def __init__(self) -> None:
        super().__init__()
        self.buf = ""
        self.is_json: bool | None = None  # decided by the first character that is not whitespace

    def feed(self, text: str) -> list[Event]:
        if self.is_json is False:
            return [Content(text)] if text else []
        self.buf += text
        first = self.buf.lstrip()[:1]
        if not first or first == "{":
            self.is_json = True if first else None
            return []  # calls are parsed whole at the end
        self.is_json, out, self.buf = False, self.buf, ""
        return [Content(out)]

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        decoder, pos, calls = json.JSONDecoder(), 0, []
        try:
            while (pos := _skip(text, pos, " \t\r\n;")) < len(text):
                call, pos = decoder.raw_decode(text, pos)
                name, arguments = call["name"], call.get("parameters", call.get("arguments"))
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise TypeError(name)
                calls.append((name, arguments))
        except (ValueError, KeyError, TypeError):
            calls = []
        if not calls:
            return [Content(text)] if text else []
        return [event for name, arguments in calls for event in self._whole_call(name, arguments)]


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
