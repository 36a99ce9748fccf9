"""cachebench: what prefix caching and chunked prefill buy, measured on real weights.

1. prefix: TTFT of requests sharing a long system prompt, the cache cold (caching off) against
   warm (one earlier request with the same system prompt), paired question by question.
2. chunked: inter-token latency of running decodes while a long prompt arrives, with the prompt
   prefilled in chunks within max_num_batched_tokens against in one step; greedy outputs of the
   decodes are checked equal between the two.

    python benchmarks/cachebench.py            # system prompt 1024 tokens, long prompt 1536 tokens
    python benchmarks/cachebench.py --quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.csv_writer import write_csv


def ttft(engine: Engine, prompt: list[int]) -> float:
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    return out.first_token_time - out.arrival_time


def prefix_rows(base: Engine, system: list[int], questions: list[list[int]]) -> list[dict]:
    rows = []
    for i, question in enumerate(questions):
        cold_engine = Engine(base.model, base.tokenizer, EngineConfig(dtype="float32", quantization=None, max_model_len=4096, enable_prefix_caching=False))
        cold = ttft(cold_engine, system + question)
        warm_engine = Engine(base.model, base.tokenizer, EngineConfig(dtype="float32", quantization=None, max_model_len=4096))
        ttft(warm_engine, system + [7, 8, 9])  # another question warms the shared system prompt
        warm = ttft(warm_engine, system + question)
        rows.append({"bench": "prefix", "case": i, "system_tokens": len(system), "cold_ttft_s": cold,
                     "warm_ttft_s": warm, "speedup_x": cold / warm})
    return rows


def chunked_row(base: Engine, chunked: bool, decodes: list[list[int]], long_prompt: list[int], budget: int,
                output_len: int) -> tuple[dict, list[list[int]]]:
    config = EngineConfig(dtype="float32", quantization=None, max_model_len=4096, max_num_seqs=len(decodes) + 1, enable_prefix_caching=False,
                          enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 4096)
    engine = Engine(base.model, base.tokenizer, config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in decodes]
    for _ in range(4):  # the decodes are running before the long prompt arrives
        engine.step()
    arrived = time.perf_counter()
    long_id = engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    long_out = final[long_id]
    window = (arrived, long_out.first_token_time)
    gaps = []  # decode ITLs that ended inside the window the long prompt was being prefilled
    for rid in ids:
        times = final[rid].token_times
        gaps += [b - a for a, b in zip(times, times[1:], strict=False) if window[0] < b <= window[1] + 1e-9]
    row = {"bench": "chunked", "case": "chunked" if chunked else "one step", "budget_tokens": config.max_num_batched_tokens,
           "long_prompt_tokens": len(long_prompt), "long_ttft_s": long_out.first_token_time - long_out.arrival_time,
           "itl_in_window_mean_s": statistics.mean(gaps), "itl_in_window_max_s": max(gaps), "itl_samples": len(gaps)}
    return row, [final[rid].token_ids for rid in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="runs/cachebench.csv")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    base = Engine.from_pretrained(args.model, EngineConfig(dtype="float32", quantization=None, max_model_len=4096))
    vocab = base.model.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    system_len, long_len, budget = (256, 512, 128) if args.quick else (1024, 1536, 256)
    system = tokens(system_len)
    questions = [tokens(rng.randint(8, 24)) for _ in range(2 if args.quick else 5)]
    ttft(Engine(base.model, base.tokenizer, base.config), tokens(32))  # warm-up, uncounted
    rows = prefix_rows(base, system, questions)

    decodes = [tokens(16) for _ in range(4)]
    long_prompt = tokens(long_len)
    output_len = 24 if args.quick else 48
    one_step, one_step_ids = chunked_row(base, False, decodes, long_prompt, budget, output_len)
    chunked, chunked_ids = chunked_row(base, True, decodes, long_prompt, budget, output_len)
    if chunked_ids != one_step_ids:
        raise SystemExit("chunked prefill changed the decodes' greedy tokens: refusing to print timings")
    rows += [one_step, chunked]

    print(f"prefix cache: system prompt {system_len} tokens, TTFT cold (caching off) vs warm")
    print(f"{'case':>5}{'cold TTFT s':>13}{'warm TTFT s':>13}{'speedup':>9}")
    for r in rows[:len(questions)]:
        print(f"{r['case']:>5}{r['cold_ttft_s']:>13.3f}{r['warm_ttft_s']:>13.3f}{r['speedup_x']:>8.2f}x")
    speedups = [r["speedup_x"] for r in rows[:len(questions)]]
    print(f"median speedup {statistics.median(speedups):.2f}x")
    print()
    print(f"chunked prefill: {len(decodes)} decodes running, a {long_len}-token prompt arrives; decode ITL while it prefills")
    print(f"{'mode':>9}{'budget':>8}{'long TTFT s':>13}{'ITL mean s':>12}{'ITL max s':>11}{'samples':>9}")
    for r in (one_step, chunked):
        print(f"{r['case']:>9}{r['budget_tokens']:>8}{r['long_ttft_s']:>13.3f}{r['itl_in_window_mean_s']:>12.3f}"
              f"{r['itl_in_window_max_s']:>11.3f}{r['itl_samples']:>9}")
    print(f"max ITL, one step / chunked: {one_step['itl_in_window_max_s'] / chunked['itl_in_window_max_s']:.2f}x; "
          f"long prompt TTFT, chunked / one step: {chunked['long_ttft_s'] / one_step['long_ttft_s']:.2f}x")

    out = Path(args.out)
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
