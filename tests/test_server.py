"""The OpenAI-compatible server, as a real process on a free loopback port, through the `openai` client.

References are independent of the server: greedy text from `Engine.generate` in this process on
the same checkpoint, prompt ids from the tokenizer (the chat template's own tokenization), token
counts from `usage` checked against those ids, and the block pool read from /metrics.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import error_of, greedy, wait_idle
from conftest import server_metrics as metrics

from nanoserve import SamplingParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def engine(default_engine):
    return default_engine


ABORTED = 'nanoserve_requests_finished_total{finish_reason="abort"}'
LENGTH = 'nanoserve_requests_finished_total{finish_reason="length"}'

# ---- the plain endpoints ---------------------------------------------------------------------------


@pytest.mark.weights
def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health", timeout=5).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---- completions and chat against Engine.generate ------------------------------------------------------


@pytest.mark.weights
def test_completion_equals_generate_and_counts_usage(server, client, engine):
    prompt = "The capital of France is"
    (want,) = engine.generate([prompt], greedy(12, ignore_eos=False))
    before = wait_idle(server)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    num_prompt = len(engine.tokenizer.encode(prompt))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (num_prompt, len(want.token_ids))
    after = wait_idle(server)
    assert after["nanoserve_prompt_tokens_total"] - before["nanoserve_prompt_tokens_total"] == num_prompt
    assert after["nanoserve_generation_tokens_total"] - before["nanoserve_generation_tokens_total"] \
        == len(want.token_ids)
    assert after["nanoserve_e2e_request_latency_seconds_count"] \
        - before["nanoserve_e2e_request_latency_seconds_count"] == 1


@pytest.mark.weights
def test_completion_stream_equals_generate(server, client, engine):
    prompt = [504, 3458, 282, 4649, 314]  # token ids are a prompt too
    (want,) = engine.generate([prompt], greedy(10, ignore_eos=False))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == want.text
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + [want.finish_reason]
    assert len(with_choices) == len(want.token_ids)  # one chunk per token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt)


MESSAGES = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]


@pytest.mark.weights
def test_chat_equals_generate_streaming_and_not(server, client, engine):
    prompt_ids = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    (want,) = engine.generate([prompt_ids], greedy(14, ignore_eos=False))
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=14, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(want.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=14,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


# ---- sampling controls through the wire: stop strings, n > 1, logprobs ----------------------------------


@pytest.mark.weights
def test_stop_string_streaming_and_not_equals_generate(server, client, engine):
    prompt = "The capital of France is"
    (plain,) = engine.generate([prompt], greedy(12, ignore_eos=False))
    stop = plain.text.split()[2]  # a word inside the greedy continuation
    cut = plain.text[: plain.text.find(stop)]  # by hand: the text ends before the match
    (want,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)))
    assert want.text == cut and want.finish_reason == "stop"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


# The server and the reference engine run the same float32 ops in the same order: their logprobs
# agree to rounding. A server split over ranks ($NANOSERVE_TEST_SERVER_ARGS with
# --tensor-parallel-size) sums o's and down's partial products in another order: 1.1e-5 measured.
LOGPROB_ATOL = 5e-5 if "--tensor-parallel-size" in os.environ.get("NANOSERVE_TEST_SERVER_ARGS", "") else 1e-5


@pytest.mark.weights
def test_n_completions_with_logprobs_equal_generate(server, client, engine):
    prompt = "Once upon a time"
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6, ignore_eos=True, logprobs=2)
    want = engine.generate([prompt], params)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=11, n=2,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == 12
    for choice, out in zip(got.choices, want, strict=True):
        assert choice.text == out.text
        lp = choice.logprobs
        assert lp.token_logprobs == pytest.approx([e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True)],
                                                  abs=LOGPROB_ATOL)
        assert lp.tokens == [engine.tokenizer.decode([t]) for t in out.token_ids]
        # The engine's entry lists the top 2 first (then the sampled token when it is not among them).
        want_top = [{engine.tokenizer.decode([i]): v for i, v in list(e.items())[:2]} for e in out.logprobs]
        assert lp.top_logprobs == [pytest.approx(top, abs=LOGPROB_ATOL) for top in want_top]

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    prompt_ids = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    (ref,) = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))
    content = [item for c in chunks for item in c.choices[0].logprobs.content]
    assert [item.logprob for item in content] == pytest.approx(
        [e[t] for t, e in zip(ref.token_ids, ref.logprobs, strict=True)], abs=LOGPROB_ATOL)
    # Greedy: the sampled token is the most likely, so it heads its own top 3.
    assert all(len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token for item in content)


# ---- disconnects free their blocks -------------------------------------------------------------------------


@pytest.mark.weights
def test_streaming_disconnect_aborts_and_frees_blocks(server, client):
    before = wait_idle(server)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    during = metrics(server)
    assert during["nanoserve_num_requests_running"] == 1 and during["nanoserve_kv_blocks_used"] >= 1
    stream.close()
    after = wait_idle(server)
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[LENGTH] == before[LENGTH]  # it did not run to its 2000 tokens


@pytest.mark.weights
def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 2000 tokens
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0))
    after = wait_idle(server)
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[LENGTH] == before[LENGTH]


# ---- bad requests: 400 each, while a good one completes ---------------------------------------------------

RAW_BAD = [  # (body bytes, param the error names); posted to /v1/completions as they are
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi",', None),  # invalid JSON
    (b'[1, 2]', None),  # JSON, but not an object
    (b'{"prompt": "hi", "temperature": "hot"}', "temperature"),  # wrong type
    (b'{"prompt": "hi", "max_tokens": "16"}', "max_tokens"),  # wrong type, not coerced
    (b'{"prompt": 42}', "prompt"),  # wrong type
    (b'{"max_tokens": 4}', "prompt"),  # missing field
    (b'{"prompt": "hi", "top_p": 2.0}', "top_p"),  # out of range (SamplingParams)
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "top_k": -5}', "top_k"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "n": 0}', "n"),
    (b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "hi", "stop": [""]}', "stop"),
    (b'{"prompt": [], "max_tokens": 4}', "prompt"),
    (b'{"prompt": [99999999], "max_tokens": 4}', None),  # outside the vocabulary
]


@pytest.mark.weights
def test_bad_requests_get_400_while_a_good_request_completes(server, client, engine):
    prompt = "Write a short poem about the sea."
    # ignore_eos: the good request must still be running while the bad ones arrive.
    (want,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    good: dict = {}

    def run_good():
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        good["text"] = "".join(c.choices[0].text for c in chunks)
        good["done_at"] = time.monotonic()

    before = wait_idle(server)
    thread = threading.Thread(target=run_good)
    thread.start()
    answered_at = []
    try:
        deadline = time.monotonic() + 20
        while (m := metrics(server))["nanoserve_num_requests_running"] < 1:  # the good one is in flight
            assert time.monotonic() < deadline and "text" not in good, f"the good request never ran: {good} {m}"
            time.sleep(0.01)
        for raw, param in RAW_BAD:
            r = httpx.post(f"{server}/v1/completions", content=raw, timeout=10,
                           headers={"content-type": "application/json"})
            answered_at.append(time.monotonic())
            assert r.status_code == 400, (raw, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], raw
            assert err["param"] == param, (raw, err)
        # Through the official client: a prompt longer than max_model_len (8192) and bad chats.
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=[100] * 9000, max_tokens=4)
        assert e.value.status_code == 400 and "exceeds max_model_len" in error_of(e.value)["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
        assert error_of(e.value)["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"min_p": 3.0})
        assert error_of(e.value)["param"] == "min_p"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert good["text"] == want.text
    assert good["done_at"] > answered_at[0]  # they overlapped: a 400 came back while it streamed
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    after = wait_idle(server)
    # None of the bad ones reached the engine: one request finished, all the others were rejected.
    assert after[LENGTH] - before[LENGTH] == 1 and after[ABORTED] == before[ABORTED]
    assert after["nanoserve_requests_rejected_total"] - before["nanoserve_requests_rejected_total"] \
        == len(RAW_BAD) + 4


# ---- bench-serve against the live server ------------------------------------------------------------------


@pytest.mark.weights
def test_bench_serve_counts_every_token(server, tmp_path):
    from nanoserve.serving.bench_serve import BenchConfig, append_csv, csv_row, run

    config = BenchConfig(server, rate=50.0, max_concurrency=2, num_prompts=4, input_len=8, output_len=5)
    m, results, model = asyncio.run(run(config))
    assert model == MODEL
    assert [r.success for r in results] == [True] * 4
    assert [(r.num_prompt_tokens, r.num_output_tokens, len(r.itl_s)) for r in results] == [(8, 5, 4)] * 4
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (4, 32, 20)
    assert m.ttft.count == 4 and m.itl.count == 16 and m.tpot.count == 4
    out = tmp_path / "bench.csv"
    append_csv(out, csv_row(config, model, m, 0))
    append_csv(out, csv_row(config, model, m, 0))
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("started_at,") and "mean_ttft_ms" in lines[0]
    wait_idle(server)


def test_serving_metrics_arithmetic():
    from nanoserve.serving.bench_serve import RequestResult, serving_metrics

    results = [
        RequestResult(True, 4, 3, ttft_s=0.1, itl_s=[0.02, 0.04], e2e_s=0.16),  # TPOT (0.16 - 0.1) / 2 = 0.03
        RequestResult(True, 6, 1, ttft_s=0.3, itl_s=[], e2e_s=0.3),  # one token: no TPOT
        RequestResult(False, error="HTTP 400"),
    ]
    m = serving_metrics(results, duration_s=2.0)
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (2, 10, 4)
    assert (m.request_throughput, m.output_throughput) == (1.0, 2.0)
    assert m.ttft.mean == pytest.approx(0.2) and m.ttft.median == pytest.approx(0.2)
    assert m.tpot.count == 1 and m.tpot.mean == pytest.approx(0.03)
    assert m.itl.count == 2 and m.itl.mean == pytest.approx(0.03)
    assert m.e2e.p99 == pytest.approx(0.16 + 0.99 * (0.3 - 0.16))
    assert m.queue.count == 0


def test_metrics_count_speculative_drafts_over_finished_requests():
    from nanoserve.engine import EngineStats
    from nanoserve.request import RequestOutput
    from nanoserve.serving.server.metrics import ServerMetrics

    sm = ServerMetrics()
    for drafts, drafted, accepted in ((3, 10, 7), (1, 4, 0)):
        sm.observe_finished(RequestOutput("r", [1], [5, 6], "", True, "length", 1.0, 1.0, 1.1, 1.2, [1.1, 1.2], 0.2,
                                          num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted))
    lines = sm.render(EngineStats(0, 0, 8, 8, 0)).splitlines()
    assert "nanoserve_spec_decode_num_drafts_total 4.0" in lines
    assert "nanoserve_spec_decode_num_draft_tokens_total 14.0" in lines
    assert "nanoserve_spec_decode_num_accepted_tokens_total 7.0" in lines


def test_metrics_text_format():
    from nanoserve.engine import EngineStats
    from nanoserve.request import RequestOutput
    from nanoserve.serving.server.metrics import ServerMetrics

    sm = ServerMetrics()
    out = RequestOutput("r", [1, 2, 3], [7, 8, 9], "", True, "length", arrival_time=10.0, first_scheduled_time=10.0,
                        first_token_time=10.03, finished_time=10.39, token_times=[10.03, 10.21, 10.39],
                        running_s=0.39)
    sm.observe_finished(out)
    sm.observe_finished(RequestOutput("a", [1], [], "", True, "abort", 5.0, None, None, 6.0))
    text = sm.render(EngineStats(num_running=2, num_waiting=1, num_free_blocks=5, num_total_blocks=8, num_steps=0))
    lines = text.splitlines()  # prometheus_client writes every sample value as a float
    assert 'nanoserve_requests_finished_total{finish_reason="length"} 1.0' in lines
    assert 'nanoserve_requests_finished_total{finish_reason="abort"} 1.0' in lines
    assert "nanoserve_prompt_tokens_total 4.0" in lines and "nanoserve_generation_tokens_total 3.0" in lines
    assert "nanoserve_kv_blocks_used 3.0" in lines and "nanoserve_num_requests_waiting 1.0" in lines
    # TTFT 0.03 s falls in le=0.04 and above; TPOT (0.39 - 0.03) / 2 = 0.18 in le=0.2; E2E 0.39 in le=0.5.
    assert 'nanoserve_time_to_first_token_seconds_bucket{le="0.02"} 0.0' in lines
    assert 'nanoserve_time_to_first_token_seconds_bucket{le="0.04"} 1.0' in lines
    assert 'nanoserve_time_to_first_token_seconds_bucket{le="+Inf"} 1.0' in lines
    assert 'nanoserve_time_per_output_token_seconds_bucket{le="0.15"} 0.0' in lines
    assert 'nanoserve_time_per_output_token_seconds_bucket{le="0.2"} 1.0' in lines
    assert 'nanoserve_e2e_request_latency_seconds_bucket{le="0.3"} 0.0' in lines
    assert 'nanoserve_e2e_request_latency_seconds_bucket{le="0.5"} 1.0' in lines
    assert "nanoserve_e2e_request_latency_seconds_count 1.0" in lines  # the abort is not an E2E
    assert "# TYPE nanoserve_time_to_first_token_seconds histogram" in lines
