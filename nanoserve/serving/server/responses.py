"""The OpenAI wire format out: the pieces of a response body (logprobs in the completions and chat
formats, usage, ids, timestamps). Requests are nanoserve.serving.server.protocol."""

from __future__ import annotations

import time
import uuid
from typing import Any


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's entry holds the top k first, in order, then the sampled token if it was not among them.
    return list(entry.items())[:k]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions format: parallel lists over the tokens, `text_offset` from `text_offset`."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry[t] for t, entry in zip(token_ids, entries, strict=True)],
        "top_logprobs": [{tokenizer.decode([i]): v for i, v in _top(entry, k)} for entry in entries],
        "text_offset": offsets,
    }


def prompt_completion_logprobs(tokenizer, prompt_ids: list[int], entries, k: int) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (completion_logprobs' lists from offset
    0): its first token has none, as OpenAI's legacy echo gives it."""
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [entry[t] for t, entry in zip(prompt_ids[1:], entries[1:], strict=True)],
        "top_logprobs": [None] + [{tokenizer.decode([i]): v for i, v in _top(entry, k)} for entry in entries[1:]],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int], entries, k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, decoded_token}}
    for the token itself and the top k at its position."""
    out: list[dict[str, Any] | None] = [None]
    for t, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        chosen = dict(_top(entry, k)) | {t: entry[t]}
        out.append({str(i): {"logprob": v, "decoded_token": tokenizer.decode([i])} for i, v in chosen.items()})
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict[str, Any]:
    """The chat format: one object per token with its bytes and its top alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [item(t, entry[t]) | {"top_logprobs": [item(i, v) for i, v in _top(entry, k)]}
                        for t, entry in zip(token_ids, entries, strict=True)]}


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
