"""Chat prompts: a conversation written out by the tokenizer's chat template, then its token ids.

One rendering for every door a chat comes through: `Engine.chat`, the server's chat endpoint and
its /tokenize. A template writes the model's special tokens itself (a BOS, the turn markers), so
the rendered text is encoded with none added: a second BOS would be a prompt the model never saw
in training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
    """The conversation as the tokenizer's chat template writes it, the assistant's turn opened.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: one conversation: {"role", "content"} dicts, oldest first.
        template_kwargs: passed to the template (`tools`, `continue_final_message`, a model's own
            switches such as `enable_thinking`); `add_generation_prompt` defaults to True.
    Raises:
        ValueError: no tokenizer, a tokenizer without a chat template, `tokenize` among the
            template's arguments, or a conversation the template rejected.
    """
    if tokenizer is None:
        raise ValueError("a chat needs a tokenizer with a chat template; there is no tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template: send the prompt as text "
                         "or token ids instead")
    if "tokenize" in template_kwargs:
        raise ValueError("chat template arguments may not set tokenize: the chat is rendered as text, then encoded")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             **({"add_generation_prompt": True} | template_kwargs))
    except Exception as e:  # the template's own raise_exception, e.g. roles out of order
        raise ValueError(f"the chat template rejected the messages: {e}") from e


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat's token ids: the template wrote the special tokens, the encoder adds none."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def as_conversations(messages: Any) -> list[list[Mapping[str, Any]]]:
    """`messages` as a list of conversations: one conversation (a list of message dicts) or a list
    of them, as vLLM's `LLM.chat` takes.

    Raises:
        ValueError: naming what is not a conversation or not a message, or an empty one.
    """
    what = "messages must be a conversation (a list of {'role', 'content'} dicts) or a list of conversations"
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{what}; got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least 1 message")
    conversations = [messages] if isinstance(messages[0], Mapping) else messages
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise ValueError(f"{what}; got a list holding {type(conversation).__name__} at index {c}")
        if not conversation:
            raise ValueError(f"conversation {c} is empty: it needs at least 1 message")
        bad = next((i for i, m in enumerate(conversation) if not isinstance(m, Mapping)), None)
        if bad is not None:
            raise ValueError(f"{what}; conversation {c} holds {type(conversation[bad]).__name__} at index {bad}")
    return [list(c) for c in conversations]
