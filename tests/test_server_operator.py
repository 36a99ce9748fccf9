"""The operator's server: API key, bounded queue, SIGTERM drain, step-fault isolation, the fields it
refuses and those it ignores, /tokenize and /detokenize.

The real default model runs behind `python -m nanoserve serve` (conftest.running_server) and is
driven with the official `openai` client; token ids are checked against the tokenizer itself and
greedy text against `Engine.generate` in this process. The step-fault routes run in process over
a tiny engine (httpx's ASGI transport), where a fault can be injected into the model's forward.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import threading
import time

import pytest
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import (
    error_of,
    fail_on_call,
    greedy,
    make_tiny_engine,
    running_server,
    server_metrics,
    wait_idle,
)

from nanoserve.serving.server.app import create_app
from nanoserve.serving.server.guard import ServerConfig
from nanoserve.serving.server.unimplemented import (
    CHAT_UNIMPLEMENTED_FIELDS,
    IGNORED_FIELDS,
    UNIMPLEMENTED_FIELDS,
)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-test-operator"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
QUEUE_FULL = 'nanoserve_requests_refused_total{reason="queue_full"}'


# ---- in process, over a tiny engine: faults ---------------------------------------------------------------


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    payloads = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_a_step_fault_is_a_500_or_an_sse_error_event_and_the_server_goes_on(monkeypatch):
    httpx2 = pytest.importorskip("httpx2")  # the transport the openai client is built on
    engine = make_tiny_engine(max_num_seqs=3)
    app = create_app(engine, "tiny")
    # The fault lands on the first forward that runs all three requests, so all are the step's.
    calls = fail_on_call(monkeypatch, engine.model, "forward", when=lambda *_: len(engine.scheduler.running) == 3)
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 30, "temperature": 0}

    async def main():
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny")
        client = openai.AsyncOpenAI(base_url="http://tiny/v1", api_key="unused", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))

        async def streamed_through_openai():
            chunks = []
            with pytest.raises(openai.APIError) as e:
                async for chunk in await client.completions.create(**body, stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
            return chunks, e.value

        async def plain_through_openai():
            with pytest.raises(openai.InternalServerError) as e:
                await client.completions.create(**body | {"prompt": "a dog ran"}, extra_body={"ignore_eos": True})
            return e.value

        raw_sse, (chunks, stream_error), plain_error = await asyncio.gather(
            raw.post("/v1/completions", json=body | {"prompt": "one two", "stream": True, "ignore_eos": True}),
            streamed_through_openai(), plain_through_openai())
        after = await client.completions.create(**body | {"prompt": "blue sky", "max_tokens": 8})
        health = await raw.get("/health")
        metrics_text = (await raw.get("/metrics")).text
        await raw.aclose()
        await client.close()
        await app.state.async_engine.shutdown()
        return raw_sse, chunks, stream_error, plain_error, after, health, metrics_text

    raw_sse, chunks, stream_error, plain_error, after, health, metrics_text = asyncio.run(main())
    assert calls["raised"] == 1
    events = sse_events(raw_sse.text)  # on the wire: the chunks before the fault, the error, [DONE]
    assert raw_sse.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "step_failed" and events[-2]["error"]["type"] == "server_error"
    assert all("choices" in e for e in events[:-2])
    assert stream_error.body["code"] == "step_failed" and "Injected" in stream_error.message
    assert all(len(c.choices) == 1 for c in chunks)  # what came before the fault arrived as chunks
    assert plain_error.status_code == 500 and error_of(plain_error)["code"] == "step_failed"
    (want,) = make_tiny_engine().generate(["blue sky"], greedy(8, ignore_eos=False))
    assert after.choices[0].text == want.text and after.choices[0].finish_reason == want.finish_reason
    assert health.status_code == 200
    assert "nanoserve_step_faults_total 1.0" in metrics_text.splitlines()
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_draining_server_refuses_new_requests_and_says_so_on_health():
    import uvicorn

    from nanoserve.serving.server.guard import DrainingServer

    engine = make_tiny_engine()
    app = create_app(engine, "tiny")
    front = app.state.async_engine
    server = DrainingServer(uvicorn.Config(app), front)
    body = {"prompt": "the cat", "max_tokens": 4, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as client:
            before = await client.post("/v1/completions", json=body)
            server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on the signal
            after = await client.post("/v1/completions", json=body)
            health = await client.get("/health")
            metrics_text = (await client.get("/metrics")).text
        await front.shutdown()
        return before, after, health, metrics_text

    before, after, health, metrics_text = asyncio.run(main())
    assert server.should_exit and front.is_draining
    assert before.status_code == 200
    assert after.status_code == 503 and after.json()["error"]["code"] == "draining"
    assert after.headers["connection"] == "close"
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    assert 'nanoserve_requests_refused_total{reason="draining"} 1.0' in metrics_text.splitlines()


def test_server_config_refuses_bad_values():
    with pytest.raises(ValueError, match="max_waiting_requests=0"):
        ServerConfig(max_waiting_requests=0)
    with pytest.raises(ValueError, match="api_key=''"):
        ServerConfig(api_key="")
    with pytest.raises(ValueError, match="drain_timeout_s=-1"):
        ServerConfig(drain_timeout_s=-1)


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (["--kv-cache-dtype", "float16", "--tensor-parallel-size", "2"], "kv_cache_dtype='float16' with tensor_parallel_size=2"),
])
def test_serve_refuses_a_bad_kv_cache_dtype_by_name_before_loading_anything(capsys, flags, message):
    from nanoserve.serving.cli import serve_main

    with pytest.raises(SystemExit) as exit_info:
        serve_main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---- the real server: key, queue bound, fields, tokenize ----------------------------------------------------


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    """One running slot and at most one waiting request, behind an API key."""
    with running_server(tmp_path_factory.mktemp("operator"), "--api-key", KEY, "--max-num-seqs", "1",
                        "--max-waiting-requests", "1") as s:
        yield s.base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.weights
def test_the_api_key_guards_v1_and_tokenize_not_health_or_metrics(server, client):
    before = server_metrics(server)["nanoserve_requests_rejected_total"]
    for key in ("sk-wrong", KEY + "x", KEY[:-1]):
        wrong = openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and error_of(e.value)["code"] == "invalid_api_key"
    # Without any Authorization header:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/tokenizer_info")):
        r = httpx.request(method, f"{server}{path}", json={}, timeout=10)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    assert httpx.get(f"{server}/metrics", timeout=5).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]  # with the key
    r = httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, headers={"authorization": f"bearer {KEY}"}, timeout=10)
    assert r.status_code == 200  # the scheme is case-insensitive
    assert server_metrics(server)["nanoserve_requests_rejected_total"] - before == 8


@pytest.mark.weights
def test_past_the_queue_bound_a_request_gets_503_with_retry_after(server, client):
    before = wait_idle(server)
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "stream": True, "extra_body": {"ignore_eos": True}}
    running = client.completions.create(**long)  # takes the one slot
    next(iter(running))
    waiting = client.completions.create(**long)  # holds the one waiting place

    try:
        deadline = time.monotonic() + 20
        while server_metrics(server)["nanoserve_num_requests_waiting"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and error_of(e.value)["code"] == "queue_full"
        assert e.value.response.headers["retry-after"] == "1"
        assert "max_waiting=1" in error_of(e.value)["message"]
    finally:
        running.close()
        waiting.close()
    after = wait_idle(server)
    assert after[QUEUE_FULL] - before[QUEUE_FULL] == 1
    # The bound is on waiting requests only: with the queue empty again, a request is served.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"


REFUSED = [  # (endpoint, field, a value that asks for something)
    ("completions", "logit_bias", {"50": 100}),
    ("chat", "echo", True),  # served on completions (tests/test_prompt_logprobs.py)
    ("completions", "suffix", " the end"),
    ("completions", "best_of", 3),
    ("chat", "prompt_logprobs", 1),
    ("chat", "functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("chat", "function_call", "auto"),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "reasoning_effort", "high"),
    ("chat", "skip_special_tokens", False),
    ("chat", "continue_final_message", True),
    ("chat", "guided_json", {"type": "object"}),
    ("completions", "guided_regex", "[0-9]+"),
]


@pytest.mark.weights
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(server, client):
    assert {field for _, field, _ in REFUSED} <= set(UNIMPLEMENTED_FIELDS) | set(CHAT_UNIMPLEMENTED_FIELDS)
    before = wait_idle(server)
    for endpoint, field, value in REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            if endpoint == "completions":
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={field: value})
            else:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={field: value})
        err = error_of(e.value)
        assert (err["param"], err["code"]) == (field, "unsupported_parameter"), field
        assert field in err["message"]
    after = wait_idle(server)
    assert after["nanoserve_requests_rejected_total"] - before["nanoserve_requests_rejected_total"] == len(REFUSED)
    finished = 'nanoserve_requests_finished_total{finish_reason="length"}'
    assert after[finished] == before[finished]  # none reached the engine


@pytest.mark.weights
def test_neutral_values_and_harmless_unknown_fields_are_served(server, client, default_engine):
    prompt_ids = default_engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    (want,) = default_engine.generate([prompt_ids], greedy(6, ignore_eos=False))
    harmless = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "k", "safety_identifier": "s", "prediction": {"type": "content", "content": "x"},
                "priority": 0, "some_future_field": {"x": 1}}
    neutral = {"logit_bias": {}, "modalities": ["text"], "best_of": 1, "echo": False, "skip_special_tokens": True,
               "add_generation_prompt": True, "function_call": "none", "audio": None}
    assert set(harmless) - {"some_future_field"} <= set(IGNORED_FIELDS)
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body=harmless | neutral)
    assert got.choices[0].message.content == want.text


@pytest.mark.weights
def test_tokenize_and_detokenize_agree_with_the_tokenizer(server, client, default_engine):
    tok = default_engine.tokenizer
    auth = {"authorization": f"Bearer {KEY}"}

    def post(path, body):
        r = httpx.post(f"{server}{path}", json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    text = "The capital of France is Paris."
    ids = tok(text)["input_ids"]
    got = post("/tokenize", {"model": MODEL, "prompt": text})
    assert got == {"count": len(ids), "max_model_len": default_engine.max_model_len, "tokens": ids, "token_strs": None}
    got = post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert got["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])

    chat_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert post("/tokenize", {"messages": MESSAGES})["tokens"] == chat_ids
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, return_dict=False)
    assert post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})["tokens"] == no_prompt
    assert no_prompt != chat_ids
    # The chat endpoint counts the same prompt.
    usage = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == len(chat_ids)

    assert post("/detokenize", {"model": MODEL, "tokens": chat_ids}) == {"prompt": tok.decode(chat_ids)}
    info = httpx.get(f"{server}/tokenizer_info", headers=auth, timeout=10).json()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == default_engine.max_model_len
    if importlib.util.find_spec("lm_eval") is not None:  # lm-evaluation-harness' own check, where installed
        from lm_eval.utils import check_remote_tokenizer_support

        assert check_remote_tokenizer_support(server, auth_token=KEY)
    assert post("/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids)
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [1, 10**9]}, headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES, "continue_final_message": True},
                      headers=auth, timeout=10)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    wrong = httpx.post(f"{server}/tokenize", json={"model": "gpt-4", "prompt": "hi"}, headers=auth, timeout=10)
    assert wrong.status_code == 404


# ---- SIGTERM: the stream in flight finishes, new requests are refused, exit 0 ---------------------------------


@pytest.mark.weights
def test_sigterm_drains_the_stream_in_flight_then_exits_0(default_model_dir, default_engine, tmp_path):
    prompt = "Once upon a time"
    (want,) = default_engine.generate([prompt], greedy(48))
    with running_server(tmp_path, "--drain-timeout", "60") as s:
        client = openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        received = [next(chunks) for _ in range(3)]
        s.proc.send_signal(signal.SIGTERM)
        refused: dict = {}

        def try_a_new_request():
            time.sleep(0.5)  # uvicorn closes its listener on the signal
            try:
                r = httpx.post(f"{s.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
                refused["status"] = r.status_code
            except httpx.TransportError as e:
                refused["error"] = type(e).__name__

        late = threading.Thread(target=try_a_new_request)
        late.start()
        received += list(chunks)
        late.join(timeout=30)
        assert s.proc.wait(timeout=60) == 0, s.log_tail()
    assert "".join(c.choices[0].text for c in received) == want.text
    assert received[-1].choices[0].finish_reason == "length"
    assert refused in ({"status": 503}, {"error": "ConnectError"}), refused


@pytest.mark.weights
def test_past_the_drain_timeout_the_stream_is_cut_and_the_server_still_exits_0(default_model_dir, tmp_path):
    with running_server(tmp_path, "--drain-timeout", "1", "--log-level", "info") as s:
        client = openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2000, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIConnectionError):  # cut mid-stream, long before its 2000 tokens
            for _ in chunks:
                pass
        assert s.proc.wait(timeout=30) == 0, s.log_tail()
        assert time.monotonic() - signalled < 15
    assert "timeout graceful shutdown exceeded" in s.log_tail(20000)
