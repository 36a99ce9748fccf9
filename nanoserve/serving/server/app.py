"""The OpenAI-compatible HTTP app: FastAPI routes over one AsyncEngine (completions, chat
completions, embeddings: each input of POST /v1/embeddings one embedding request, pooled as the
engine's checkpoint says, batched with the generation requests in the same steps).

Every route validates its body before anything reaches the engine, and every client mistake
becomes an OpenAI-style error body with a 4xx, so one bad request never disturbs the others. A
streaming request whose client disconnects is cancelled by Starlette, which closes the SSE
generator and aborts the request; a non-streaming one races its generation against the
disconnect message itself.

The operator's guards (guard.ServerConfig): an API key on every /v1 route and /tokenize,
/detokenize; a 503 with Retry-After past `max_waiting_requests` waiting requests; a 503 for new
requests once the server drains. A request whose engine step raised gets a 500 body, or when
streamed an error event and then [DONE], while the engine goes on with the others.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.chat import encode_chat
from nanoserve.params import PoolingParams
from nanoserve.serving.async_engine import (
    AsyncEngine,
    DrainingError,
    EngineDeadError,
    QueueFullError,
    RequestStream,
    StepFailedError,
)
from nanoserve.serving.server import protocol, reasoning, responses, tools
from nanoserve.serving.server.guard import ApiKeyMiddleware, ServerConfig
from nanoserve.serving.server.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.serving.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from nanoserve.serving.server.tokenize import tokenize_routes
from nanoserve.serving.streaming import StreamDelta

if TYPE_CHECKING:
    from nanoserve.engine import Engine
    from nanoserve.params import SamplingParams


def create_app(engine: Engine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """The app serving `engine` under the model id `model_name`, guarded as `config` says."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    thinks = config.reasoning_parser
    marker_ids = reasoning.markers(engine.tokenizer, thinks) if thinks and engine.tokenizer is not None else None
    async_engine = AsyncEngine(engine, on_finished=metrics.observe_finished, max_waiting=config.max_waiting_requests,
                               on_step_fault=metrics.observe_step_fault)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await async_engine.shutdown()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    if config.api_key is not None:

        def count_rejected() -> None:
            metrics.num_rejected += 1

        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, on_refused=count_rejected)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if 400 <= exc.status_code < 499:  # 499: the client left, nothing it sent was wrong
            metrics.num_rejected += 1
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(f"the model {name!r} does not exist; this server serves {model_name!r}",
                           status_code=404, param="model", code="model_not_found")

    def max_tokens_for(requested: int | None, num_prompt_tokens: int) -> int:
        if requested is not None:
            return requested  # SamplingParams and the engine check it against the limits
        # The context is bounded by max_model_len and by what the whole KV pool can hold.
        limit = min(engine.max_model_len, engine.allocator.num_blocks * engine.config.block_size)
        room = limit - num_prompt_tokens
        if room < 1:
            raise ApiError(f"the prompt has {num_prompt_tokens} tokens; the context limit of {limit} tokens "
                           "leaves no room for output", param="prompt", code="context_length_exceeded")
        return room

    async def submit(prompt: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        return await refused_as_api_errors(async_engine.add_request(prompt, params, request_id=request_id))

    async def refused_as_api_errors(call, input_param: str | None = None):
        """Awaits an engine call; what it refuses becomes an ApiError (a ValueError: a 400 naming
        the parameter it names, else `input_param`, else "prompt" where it is about the prompt)."""
        try:
            return await call
        except ValueError as e:
            param = protocol.param_of(str(e)) or input_param or ("prompt" if "prompt" in str(e) else None)
            raise ApiError(str(e), param=param) from None
        except EngineDeadError as e:
            raise ApiError(str(e), status_code=503, type="server_error") from None
        except QueueFullError as e:
            metrics.refused["queue_full"] += 1
            raise ApiError(f"the server is busy: {e}; retry later", status_code=503, type="server_error",
                           code="queue_full", headers={"Retry-After": str(config.retry_after_s)}) from None
        except DrainingError as e:
            metrics.refused["draining"] += 1
            raise ApiError(str(e), status_code=503, type="server_error", code="draining",
                           headers={"Connection": "close"}) from None

    def tokenize(text: str, param: str = "prompt") -> list[int]:
        if engine.tokenizer is None:
            raise ApiError(f"this model has no tokenizer: send the {param} as token ids", param=param)
        return list(engine.tokenizer.encode(text))

    # ---- routes ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if async_engine.error is not None:
            return JSONResponse({"status": "dead", "error": repr(async_engine.error)}, status_code=503)
        if async_engine.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": responses.now(), "owned_by": "nanoserve",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(await async_engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = protocol.parse_body(await request.body(), CompletionRequest)
        check_model(body.model)
        if body.max_reasoning_tokens is not None:
            raise ApiError("max_reasoning_tokens applies to chat completions (a reasoning parser finds the think "
                           "block there)", param="max_reasoning_tokens")
        prompt = protocol.completion_prompt(body)
        prompt_ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        echo, k = body.echo, body.logprobs
        # max_tokens 0 with echo: the prompt alone (lm-evaluation-harness' loglikelihood may ask so);
        # the engine samples one token, which the response leaves out
        prompt_only = echo and body.max_tokens == 0
        scored = [n for n in (k if echo else None, body.prompt_logprobs) if n is not None]
        params = protocol.sampling_params(body, 1 if prompt_only else max_tokens_for(body.max_tokens, len(prompt_ids)),
                                          k, protocol.structured_outputs(body), max(scored) if scored else None)
        rid = responses.new_id("cmpl")
        stream = await submit(prompt_ids, params, rid)
        head = {"id": rid, "object": "text_completion", "created": responses.now(), "model": model_name}
        offsets = [0] * params.n  # characters of each completion sent so far, for text_offset
        echo_text = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids)) if echo else ""

        def choice(index: int, text: str, token_ids: list[int], entries, finish_reason, first: bool,
                   prompt_entries) -> dict[str, Any]:
            """A choice's text, logprobs and finish reason since the last; its first carries the echo."""
            if prompt_only:
                text, token_ids, entries = "", [], []
            logprobs = None
            if k is not None:
                logprobs = responses.completion_logprobs(engine.tokenizer, token_ids, entries, k,
                                                         offsets[index] + (len(echo_text) if first else 0))
                if echo and first:
                    head_part = responses.prompt_completion_logprobs(engine.tokenizer, prompt_ids, prompt_entries, k)
                    logprobs = {key: head_part[key] + logprobs[key] for key in logprobs}
            if first:
                text = echo_text + text
            offsets[index] += len(text)
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            if body.prompt_logprobs is not None and first:
                out["prompt_logprobs"] = responses.vllm_prompt_logprobs(engine.tokenizer, prompt_ids, prompt_entries,
                                                                        body.prompt_logprobs)
            return out

        started: set[int] = set()

        def stream_choice(d) -> dict[str, Any]:
            first = d.index not in started
            started.add(d.index)
            return choice(d.index, d.text, d.token_ids, d.logprobs, d.finish_reason if d.finished else None, first,
                          d.output.prompt_logprobs)

        if body.stream:
            return _sse(stream, head, body, stream_choice, num_completion_tokens=0 if prompt_only else None)
        done = await _collect(request, stream)
        return JSONResponse(head | {
            "choices": [choice(i, c.text, c.token_ids, c.logprobs, c.finish_reason, True, c.prompt_logprobs)
                        for i, c in sorted(done.items())],
            "usage": _usage(stream, done, 0 if prompt_only else None),
        })

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body: EmbeddingRequest = protocol.parse_body(await request.body(), EmbeddingRequest)
        check_model(body.model)
        if body.encoding_format not in ("float", "base64"):
            raise ApiError(f"encoding_format={body.encoding_format!r} must be 'float' or 'base64'",
                           param="encoding_format")
        pooling = engine.pooling
        if body.dimensions is not None and not pooling.normalize:
            raise ApiError(f"dimensions={body.dimensions}: this model's pooling does not normalise, so its "
                           "vectors cannot be cut and normalised again", param="dimensions")
        try:
            params = PoolingParams(pooling.pooling, pooling.normalize, body.dimensions)
        except ValueError as e:
            raise ApiError(str(e), param="dimensions") from None
        inputs = [tokenize(item, "input") if isinstance(item, str) else item for item in protocol.embedding_inputs(body)]
        rid = responses.new_id("embd")
        calls = [asyncio.ensure_future(refused_as_api_errors(async_engine.embed(ids, params, f"{rid}-{i}"), "input"))
                 for i, ids in enumerate(inputs)]
        try:
            outputs = await asyncio.gather(*calls)
        except (StepFailedError, EngineDeadError) as e:
            raise _engine_error(e) from None
        finally:
            for call in calls:  # one input refused or failed: the others' requests are aborted
                call.cancel()
        data = []
        for i, out in enumerate(outputs):
            if out.embedding is None:
                raise ApiError(f"input[{i}] was aborted before its vector was made", status_code=500,
                               type="server_error", code="aborted")
            vector = out.embedding
            if body.encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = protocol.parse_body(await request.body(), ChatCompletionRequest)
        check_model(body.model)
        messages = protocol.chat_messages(body)
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError("this model's tokenizer has no chat template: use /v1/completions")
        plan = tools.plan(body, tokenizer)
        prompt_ids = encode_chat(tokenizer, tools.render_prompt(tokenizer, messages, plan, body.chat_template_kwargs))
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        think_fields, opened = None, False
        if marker_ids is not None:  # the grammar starts after </think>; a budget may force it
            budget = config.reasoning_budget if body.max_reasoning_tokens is None else body.max_reasoning_tokens
            think_fields, opened = reasoning.sampling_fields(marker_ids, budget, prompt_ids)
        elif body.max_reasoning_tokens not in (None, -1):
            raise ApiError(f"max_reasoning_tokens={body.max_reasoning_tokens!r} needs a server started with "
                           "--reasoning-parser", param="max_reasoning_tokens")
        params = protocol.sampling_params(body, max_tokens_for(requested, len(prompt_ids)),
                                          protocol.chat_logprobs_count(body),
                                          plan.structured_outputs or protocol.structured_outputs(body),
                                          reasoning=think_fields)
        rid = responses.new_id("chatcmpl")
        stream = await submit(prompt_ids, params, rid)
        head = {"id": rid, "object": "chat.completion", "created": responses.now(), "model": model_name}
        k = params.logprobs

        def logprobs(token_ids: list[int], entries) -> dict[str, Any] | None:
            return None if k is None else responses.chat_logprobs(tokenizer, token_ids, entries, k)

        if body.stream:
            named = set()  # OpenAI names the role once per choice, in its first chunk
            parsers: dict[int, tools.ToolDeltas] = {}  # per choice, when its text holds tool calls
            splitters: dict[int, reasoning.ReasoningSplitter] = {}  # per choice, with a reasoning parser

            def chunk_choice(d: StreamDelta) -> dict[str, Any]:
                text, thought = d.text, ""
                if thinks:
                    splitter = splitters.setdefault(d.index, reasoning.ReasoningSplitter(thinks, opened))
                    thought, text = splitter.feed(text)
                    if d.finished:
                        more_thought, more_text = splitter.finish()
                        thought, text = thought + more_thought, text + more_text
                delta, reason = {"content": text}, d.finish_reason if d.finished else None
                if plan.parses_calls:
                    delta, reason = parsers.setdefault(d.index, tools.ToolDeltas(plan)).delta(
                        text, d.finished, d.finish_reason)
                if thought:
                    delta = {"reasoning_content": thought} | ({} if delta.get("content") == "" else delta)
                if d.index not in named:
                    delta = {"role": "assistant"} | delta
                    named.add(d.index)
                return {"index": d.index, "delta": delta, "logprobs": logprobs(d.token_ids, d.logprobs),
                        "finish_reason": reason}

            return _sse(stream, head | {"object": "chat.completion.chunk"}, body, chunk_choice)
        done = await _collect(request, stream)
        choices = []
        for i, c in sorted(done.items()):
            thought, text = reasoning.split(thinks, c.text, opened) if thinks else (None, c.text)
            message, reason = tools.message(plan, text, c.finish_reason) if plan.parses_calls \
                else ({"role": "assistant", "content": text}, c.finish_reason)
            if thinks:
                message["reasoning_content"] = thought
            choices.append({"index": i, "message": message, "logprobs": logprobs(c.token_ids, c.logprobs),
                            "finish_reason": reason})
        return JSONResponse(head | {"choices": choices, "usage": _usage(stream, done)})

    app.include_router(tokenize_routes(engine, check_model))
    return app


@dataclass
class _Completion:
    """One completion of a non-streaming request, gathered from its deltas."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: Any = None  # the request's, where it asked (SamplingParams.prompt_logprobs)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _usage(stream: RequestStream, completions: dict[int, _Completion],
           num_completion_tokens: int | None = None) -> dict[str, int]:
    """Usage; num_completion_tokens: what the response holds, where not every token sampled (None: all)."""
    sampled = sum(len(c.token_ids) for c in completions.values())
    return responses.usage(len(stream.prompt_token_ids), sampled if num_completion_tokens is None else num_completion_tokens)


def _sse(stream: RequestStream, head: dict[str, Any], body: Any, make_choice,
         num_completion_tokens: int | None = None) -> StreamingResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        completions: dict[int, _Completion] = {}
        try:
            try:
                async for delta in stream:
                    completions.setdefault(delta.index, _Completion()).token_ids.extend(delta.token_ids)
                    chunk = head | {"choices": [make_choice(delta)]}
                    if include_usage:
                        chunk["usage"] = None  # OpenAI: null on every chunk but the usage one
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                if include_usage:
                    usage = _usage(stream, completions, num_completion_tokens)
                    yield f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n"
            except (StepFailedError, EngineDeadError) as e:  # the headers are out: the error is an event
                yield f"data: {json.dumps(_engine_error(e).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancelled or closed us): free the blocks
            stream.abort()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(request: Request, stream: RequestStream) -> dict[int, _Completion]:
    """Runs a request to the end, by completion index; aborts it if the client disconnects first."""

    async def consume() -> dict[int, _Completion]:
        completions: dict[int, _Completion] = {}
        async for delta in stream:
            c = completions.setdefault(delta.index, _Completion())
            c.parts.append(delta.text)
            c.token_ids += delta.token_ids
            c.logprobs += delta.logprobs or []
            c.finish_reason = delta.finish_reason
            c.prompt_logprobs = delta.output.prompt_logprobs
        return completions

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    generation = asyncio.create_task(consume())
    watcher = asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not generation.done():
            generation.cancel()
            stream.abort()
        watcher.cancel()
    if generation not in done:
        await asyncio.gather(generation, return_exceptions=True)
        raise ApiError("the client disconnected", status_code=499, code="client_disconnected")
    try:
        return generation.result()
    except (StepFailedError, EngineDeadError) as e:
        raise _engine_error(e) from None


def _engine_error(e: StepFailedError | EngineDeadError) -> ApiError:
    """A request the engine failed: its step raised (500), or the engine is dead (503)."""
    if isinstance(e, StepFailedError):
        return ApiError(str(e), status_code=500, type="server_error", code="step_failed")
    return ApiError(str(e), status_code=503, type="server_error", code="engine_dead")
