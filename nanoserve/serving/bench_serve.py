"""`nanoserve bench-serve`: drive a running OpenAI-compatible server and report vLLM's serving metrics.

As vLLM's `benchmark_serving`: requests are sent at Poisson arrival times (`--rate`, inf for all
at once) under a concurrency cap (`--max-concurrency`); each streams its completion, and the
client stamps every chunk, so TTFT, ITL, TPOT and E2E are what a caller of the server sees,
network and HTTP stack included. A request waiting for the concurrency cap is not yet sent, so
its clock starts when it is (vLLM's convention). Prompts are random token ids of a fixed length
(a prefix cache cannot turn the run into a cache benchmark) and every request asks for exactly
`--output-len` tokens with `ignore_eos`. One uncounted warm-up request goes first.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.load import offline_workload, poisson_arrivals
from nanoserve.instruments.metrics import BenchmarkMetrics, Summary, summarize
from nanoserve.instruments.record import tpot


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from its send."""

    success: bool = False
    num_prompt_tokens: int = 0  # from the server's usage
    num_output_tokens: int = 0  # from the server's usage (completion_tokens)
    ttft_s: float | None = None  # send -> first chunk carrying a choice
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks carrying a choice
    e2e_s: float | None = None  # send -> [DONE]
    error: str | None = None


def serving_metrics(results: list[RequestResult], duration_s: float) -> BenchmarkMetrics:
    """vLLM's serving metrics over the successful requests (TPOT as `nanoserve.instruments.record.tpot`).

    The client cannot see a server-side queue, so `queue` is empty (count 0).

    Raises:
        ValueError: duration_s is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    done = [r for r in results if r.success]
    total_out = sum(r.num_output_tokens for r in done)
    tpots = [t for r in done if (t := tpot(r.num_output_tokens, r.ttft_s, r.e2e_s)) is not None]
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(done),
        total_input_tokens=sum(r.num_prompt_tokens for r in done),
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        output_throughput=total_out / duration_s,
        queue=summarize([]),
        ttft=summarize(r.ttft_s for r in done),
        tpot=summarize(tpots),
        itl=summarize(gap for r in done for gap in r.itl_s),
        e2e=summarize(r.e2e_s for r in done),
    )


async def send_one(client, url: str, payload: dict) -> RequestResult:
    """POSTs one streaming completion and stamps its chunks."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    result.e2e_s = time.perf_counter() - start
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.success = result.e2e_s is not None and result.ttft_s is not None
    if not result.success:
        result.error = "stream ended without [DONE]"
    return result


@dataclass(frozen=True)
class BenchConfig:
    """One bench-serve run."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None  # None: the first id GET /v1/models lists
    rate: float = math.inf  # mean requests per second of the Poisson arrivals
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    num_prompts: int = 32
    input_len: int = 32  # prompt tokens per request
    output_len: int = 16  # output tokens per request (ignore_eos)
    vocab_size: int = 1000  # prompt ids are drawn below this, so any real vocabulary has them
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0  # per request

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate={self.rate} must be > 0 (inf for all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be None or >= 1")
        for name in ("num_prompts", "input_len", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


async def run(config: BenchConfig) -> tuple[BenchmarkMetrics, list[RequestResult], str]:
    """Runs the benchmark; returns the metrics, each request's result and the model id used."""
    import httpx

    workload = offline_workload(config.num_prompts, config.input_len, config.output_len, config.vocab_size,
                                config.seed)
    arrivals = poisson_arrivals(config.num_prompts, config.rate, config.seed)
    cap = config.max_concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=cap + 1, max_keepalive_connections=cap + 1)
    base = config.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        model = config.model
        if model is None:
            response = await client.get(f"{base}/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]

        def payload(prompt: list[int]) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": config.output_len, "ignore_eos": True,
                    "temperature": config.temperature, "stream": True, "stream_options": {"include_usage": True}}

        url = f"{base}/v1/completions"
        warmup = await send_one(client, url, payload(workload.prompts[0]))
        if not warmup.success:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")

        semaphore = asyncio.Semaphore(cap)
        start = time.perf_counter()

        async def launch(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with semaphore:
                return await send_one(client, url, payload(workload.prompts[i]))

        results = await asyncio.gather(*(launch(i) for i in range(config.num_prompts)))
        duration = time.perf_counter() - start
    return serving_metrics(results, duration), results, model


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.2f}"


SUMMARIES = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2e", "End-to-end Latency", "E2E"))


def format_table(m: BenchmarkMetrics, num_failed: int) -> str:
    """vLLM's result table."""
    rows = [("Successful requests:", str(m.completed)), ("Failed requests:", str(num_failed)),
            ("Benchmark duration (s):", f"{m.duration_s:.2f}"), ("Total input tokens:", str(m.total_input_tokens)),
            ("Total generated tokens:", str(m.total_output_tokens)),
            ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title, short in SUMMARIES:
        s: Summary = getattr(m, key)
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        lines += [f"{f'Mean {short} (ms):':<40}{_ms(s.mean):<10}", f"{f'Median {short} (ms):':<40}{_ms(s.median):<10}",
                  f"{f'P99 {short} (ms):':<40}{_ms(s.p99):<10}"]
    lines.append("=" * 50)
    return "\n".join(lines)


def csv_row(config: BenchConfig, model: str, m: BenchmarkMetrics, num_failed: int) -> dict[str, object]:
    """One CSV row per run, units in the column names."""
    row: dict[str, object] = {
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": config.base_url, "model": model, "num_prompts": config.num_prompts,
        "input_len_tokens": config.input_len, "output_len_tokens": config.output_len,
        "request_rate_req_s": config.rate, "max_concurrency": config.max_concurrency or "",
        "completed": m.completed, "failed": num_failed, "duration_s": round(m.duration_s, 4),
        "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
        "request_throughput_req_s": round(m.request_throughput, 4),
        "output_throughput_tok_s": round(m.output_throughput, 4),
    }
    for key, _, _ in SUMMARIES:
        s: Summary = getattr(m, key)
        for stat in ("mean", "median", "p99"):
            value = getattr(s, stat)
            row[f"{stat}_{key}_ms"] = "" if value is None else round(value * 1e3, 3)
    return row


def append_csv(path: str | Path, row: dict[str, object]) -> None:
    """Appends `row` through the one CSV writer, writing the header first when the file is new."""
    write_csv(path, [row], append=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve bench-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model id (default: the server's first)")
    parser.add_argument("--rate", type=float, default=math.inf, help="mean requests/s (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="CSV to append one row to")
    args = parser.parse_args(argv)
    try:
        config = BenchConfig(args.base_url, args.model, args.rate, args.max_concurrency, args.num_prompts,
                             args.input_len, args.output_len, args.vocab_size, args.temperature, args.seed)
    except ValueError as e:
        parser.error(str(e))
    metrics, results, model = asyncio.run(run(config))
    failed = [r for r in results if not r.success]
    print(format_table(metrics, len(failed)))
    for r in failed[:5]:
        print(f"failed: {r.error}")
    if args.out:
        append_csv(args.out, csv_row(config, model, metrics, len(failed)))
        print(f"appended a row to {args.out}")
