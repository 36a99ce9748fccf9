"""Request fields the server refuses, and fields it ignores on purpose.

Clients send many fields a server may not know, and the request bodies ignore unknown ones. That
is right for a field that asks for nothing the response shows (`user`, `metadata`, ...) and wrong
for one that does: a client asking for `logit_bias` or `audio` that gets a plain completion back
fails later, far from the cause. So every field in UNIMPLEMENTED_FIELDS is a 400 naming it, unless
its value asks for nothing (what the client gets without the field). A field in neither list is
ignored as any unknown field is. Fields the server implements (sampling, logprobs, streaming, and
whatever the request bodies declare) are in neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Neutral = Callable[[Any, Mapping[str, Any]], bool]  # (value, whole body) -> the value asks for nothing


def _unset(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None


def _false(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value is False


def _empty(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value in ({}, [], "")


def _true(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value is True


# field -> (when its value asks for nothing, what it would change in the response)
UNIMPLEMENTED_FIELDS: dict[str, tuple[Neutral, str]] = {
    # OpenAI, both endpoints
    "logit_bias": (_empty, "biases added to chosen tokens' logits"),
    # OpenAI completions
    "suffix": (_empty, "text to insert the completion before"),
    "best_of": (lambda v, body: v is None or v == (body.get("n") or 1), "the best n of best_of candidates"),
    # OpenAI chat
    "functions": (_empty, "legacy function calling; tools is its successor"),
    "function_call": (lambda v, body: v is None or v == "none", "legacy function calling; tool_choice is its successor"),
    "audio": (_unset, "audio output"),
    "modalities": (lambda v, body: v is None or v == ["text"], "output in modalities other than text"),
    "web_search_options": (_unset, "answers grounded in a web search"),
    "reasoning_effort": (_unset, "a reasoning model's effort (OpenAI refuses it on models that do not reason)"),
    "verbosity": (_unset, "a reasoning model's answer length (OpenAI refuses it on models that do not reason)"),
    # vLLM's extras
    "use_beam_search": (_false, "beam search"),
    "include_stop_str_in_output": (_false, "the matched stop string kept in the text"),
    "skip_special_tokens": (_true, "special tokens written into the text"),
    "truncate_prompt_tokens": (_unset, "the prompt cut to its last tokens"),
    "allowed_token_ids": (_empty, "sampling restricted to a set of tokens"),
    "bad_words": (_empty, "words that may not be generated"),
    "logits_processors": (_empty, "custom logits processors"),
    "return_tokens_as_token_ids": (_false, "logprob tokens written as token ids"),
    "return_token_ids": (_false, "the prompt's and the output's token ids in the response"),
    "add_generation_prompt": (_true, "a chat prompt without the assistant's header"),
    "continue_final_message": (_false, "the last message continued instead of answered"),
    "chat_template": (_unset, "a chat template sent with the request"),
    "documents": (_empty, "documents rendered into the chat template"),
    # vLLM's older structured-output fields: structured_outputs and response_format are served instead
    "guided_json": (_unset, "output held to a JSON schema (send response_format or structured_outputs)"),
    "guided_regex": (_unset, "output held to a regex (send structured_outputs)"),
    "guided_choice": (_unset, "output held to a list of choices (send structured_outputs)"),
    "guided_grammar": (_unset, "output held to a grammar (send structured_outputs)"),
    "guided_decoding_backend": (_unset, "the structured-output backend"),
}

# Served on /v1/completions, refused on chat (vLLM takes them there too).
CHAT_UNIMPLEMENTED_FIELDS: dict[str, tuple[Neutral, str]] = {
    "echo": (_false, "the last message echoed before the answer (served on /v1/completions)"),
    "prompt_logprobs": (_unset, "log probabilities of the prompt tokens (served on /v1/completions)"),
}

# field -> why ignoring it is right: it asks for nothing the response shows.
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id, for the provider's abuse monitoring",
    "safety_identifier": "user's successor, likewise",
    "metadata": "tags for stored completions",
    "store": "whether the provider stores the completion",
    "service_tier": "the provider's processing tier",
    "prompt_cache_key": "a hint for the provider's prompt cache",
    "prediction": "a latency hint: known output content makes the response faster, never different",
    "priority": "vLLM's scheduling priority: when, not what",
    "cache_salt": "vLLM's prefix-cache isolation: which cached blocks may be reused, not what they hold",
    "spaces_between_special_tokens": "spacing around special tokens, which the text never holds",
}


def first_unimplemented(body: Mapping[str, Any], chat: bool = False) -> tuple[str, str] | None:
    """The first field of `body` (a parsed JSON object; a chat request's where `chat`) that asks for
    something unimplemented, as (field, what it would change); None when there is none."""
    for name, value in body.items():
        rule = UNIMPLEMENTED_FIELDS.get(name) or (CHAT_UNIMPLEMENTED_FIELDS.get(name) if chat else None)
        if rule is not None and not rule[0](value, body):
            return name, rule[1]
    return None
