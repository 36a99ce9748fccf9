"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

/tokenize takes a completion prompt (`prompt`; `add_special_tokens`, default true, as the
completions endpoint encodes) or a chat (`messages`; `add_generation_prompt`, default true;
`continue_final_message`; `add_special_tokens`, default false since the template writes them;
`tools`, handed to the template), and answers `{count, max_model_len, tokens, token_strs}`
(`token_strs` when `return_token_strs` is true, else null). A chat is rendered by the tokenizer's
chat template as the chat endpoint renders a chat without tools, so `count` is the prompt length
that endpoint would see for it. With tools and a template that does not read them (the default
SmolLM2's), the chat endpoint adds nanoserve's own tools message (serving/server/tools.py), which
this count does not include. /detokenize takes `{tokens}` and answers `{prompt}`: the tokenizer's decode with
special tokens kept, as vLLM's. Like vLLM, both sit outside /v1; the API key guards them too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from nanoserve.chat import render_chat
from nanoserve.serving.server import protocol
from nanoserve.serving.server.protocol import ApiError, ChatMessage, _Body

if TYPE_CHECKING:
    from nanoserve.engine import Engine


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open for the model to continue
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def tokenize_routes(engine: Engine, check_model: Callable[[str | None], None]) -> APIRouter:
    """The two routes over `engine`'s tokenizer; `check_model` refuses a model id not served."""
    router = APIRouter()

    def tokenizer():
        if engine.tokenizer is None:
            raise ApiError("this model has no tokenizer")
        return engine.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            is_chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            is_chat = False  # parse_body names what is wrong with it
        body = protocol.parse_body(raw, TokenizeChatRequest if is_chat else TokenizeCompletionRequest)
        check_model(body.model)
        tok = tokenizer()
        if is_chat:
            ids = tok.encode(chat_text(tok, body), add_special_tokens=body.add_special_tokens)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = [int(t) for t in ids]
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: the tokenizer's special tokens, class and chat template, and the context limit
        (what lm-evaluation-harness' remote tokenizer reads before it tokenizes through /tokenize)."""
        tok = tokenizer()
        info = {name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return info | {"tokenizer_class": type(tok).__name__, "chat_template": getattr(tok, "chat_template", None),
                       "model_max_length": engine.max_model_len}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body: DetokenizeRequest = protocol.parse_body(await request.body(), DetokenizeRequest)
        check_model(body.model)
        tok = tokenizer()
        vocab_size = engine.model.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    return router


def chat_text(tokenizer, body: TokenizeChatRequest) -> str:
    """The chat rendered by the tokenizer's template, as text."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: send a prompt", param="messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    messages = protocol.chat_messages(body)
    extra = {"tools": body.tools} if body.tools else {}
    try:
        return render_chat(tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message, **extra)
    except ValueError as e:  # the template's own raise_exception, e.g. roles out of order
        raise ApiError(str(e), param="messages") from None
