"""A reasoning model's thinking kept apart from its answer (`nanoserve serve --reasoning-parser`).

Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>` before the answer; a
chat completion returns it in the message's `reasoning_content` and the answer in `content`
(vLLM's `--reasoning-parser qwen3`, llama.cpp's `--reasoning-format`), streamed as deltas of each.

The rule, one for both formats: a completion that opens with `<think>` is reasoning up to the first
`</think>` and answer after it; one that has no `</think>` at all is reasoning to its end if it
opened with `<think>` (cut off by max_tokens while thinking), and answer otherwise (thinking off:
Qwen3's template writes an empty think block into the prompt, DeepSeek-R1's writes `<think>\n`
there, so its output may hold `</think>` without opening it: reasoning up to it). The tags are
dropped; nothing else is trimmed, so the streamed deltas concatenate to the non-streamed fields.
A prompt that opened a block and did not close it (`opened`) starts the output inside it, for
either format.

The engine knows the block too (nanoserve.reasoning): `sampling_fields` gives a request the
markers' token ids and its budget, so that its grammar (structured outputs, a tool-call grammar)
applies after `</think>` and `max_reasoning_tokens` (or the server's `--reasoning-budget`) can end
the block. Qwen3's output may open a block (a start marker is given); DeepSeek-R1's starts inside
one (none is: everything before `</think>` is reasoning, and a model that never writes it never
reaches its grammar unless a budget ends the block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanoserve.reasoning import prompt_opens_block

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def markers(tokenizer: Any, parser: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The think block's (start, end) markers as `tokenizer` encodes them (no start for deepseek_r1)."""
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return (() if parser == "deepseek_r1" else encode(OPEN)), encode(CLOSE)


def sampling_fields(marker_ids: tuple[tuple[int, ...], tuple[int, ...]], budget: int,
                    prompt_token_ids: Sequence[int]) -> tuple[dict[str, Any], bool]:
    """A chat request's SamplingParams fields for its think block, and whether its prompt opened one."""
    start, end = marker_ids
    fields = {"reasoning_start_token_ids": start, "reasoning_end_token_ids": end, "max_reasoning_tokens": budget}
    return fields, prompt_opens_block(prompt_token_ids, start, end)


class ReasoningSplitter:
    """Splits a completion's text as it grows into (reasoning, answer) deltas: `feed` each new piece
    of text, then `finish` once. A piece that might be the start of a tag is held back until the
    next one says whether it is."""

    def __init__(self, parser: str, opened: bool = False) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of {list(PARSERS)}")
        self.parser = parser
        # "start": nothing decided yet; "reasoning": inside the think block; "answer": after it (or none)
        self.state = "reasoning" if opened else "start"
        self.held = ""  # text not yet given out: a possible tag's beginning
        self.thought = opened  # whether a think block was entered (reasoning None where not)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and answer text this piece completes (either may be empty)."""
        text = self.held + text
        self.held = ""
        reasoning = ""
        if self.state == "start":
            if OPEN.startswith(text):  # maybe "<think>" still on its way
                self.held = text
                return "", ""
            if text.startswith(OPEN):
                self.state, text = "reasoning", text[len(OPEN):]
            elif self.parser == "deepseek_r1":
                self.state = "reasoning"  # its template opened the block in the prompt
            else:
                self.state = "answer"
            self.thought = self.state == "reasoning"
        if self.state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = _partial_tag(text, CLOSE)
                reasoning, self.held = text[:len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
            reasoning, text, self.state = text[:end], text[end + len(CLOSE):], "answer"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the completion."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def split(parser: str, text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole completion's (reasoning, answer): reasoning None where there was none, as vLLM returns it."""
    splitter = ReasoningSplitter(parser, opened)
    (r1, a1), (r2, a2) = splitter.feed(text), splitter.finish()
    return (r1 + r2 if splitter.thought else None), a1 + a2


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag` (0 where none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
