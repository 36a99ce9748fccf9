"""hfbench: transformers' generate (one request at a time) against nanoserve at several slot counts.

Same weights, same prompts, greedy on both sides with EOS ignored; token ids are checked equal
(nanoserve.baseline.compare refuses otherwise) before anything is printed. Writes one CSV row per
system with units in the column names.

    python hfbench.py            # 16 requests x 64 tokens, slots 1 2 4 8 16
    python hfbench.py --quick    # about a minute
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from nanoserve import Engine, EngineConfig
from nanoserve.baseline import (
    check_concurrent,
    check_serial,
    compare,
    hf_generate_one,
    marginal_doublings,
    render,
    render_doublings,
    run_concurrent,
    run_serial,
)
from nanoserve.instruments.csv_writer import write_csv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="4 requests x 12 tokens, slots 1 2 4")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--slots", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="runs/hfbench.csv")
    args = parser.parse_args()
    num_requests = args.requests or (4 if args.quick else 16)
    output_len = args.output_len or (12 if args.quick else 64)
    slots_list = args.slots or ([1, 2, 4] if args.quick else [1, 2, 4, 8, 16])
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(args.model, EngineConfig(dtype="float32", quantization=None, max_model_len=1024))
    model_dir = args.model or str(__import__("nanoserve.model.default", fromlist=["x"]).default_model_dir())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(num_requests)]

    # Warm-up, uncounted: first calls pay for allocation and kernel selection on both sides.
    generate_one = hf_generate_one(hf)
    generate_one(prompts[0], 4)
    run_concurrent(Engine(engine.model, engine.tokenizer, engine.config), prompts[:2], 4)

    print(f"hfbench: {num_requests} requests, prompt {args.prompt_len}, output {output_len} tokens, "
          f"fp32, {torch.get_num_threads()} threads, greedy, EOS ignored")
    baseline = check_serial(run_serial(generate_one, prompts, output_len, system="hf-generate"))
    comparisons = []
    for slots in slots_list:
        config = EngineConfig(dtype="float32", quantization=None, max_num_seqs=slots, max_model_len=1024, kv_cache_memory_bytes=256 * 2**20)
        run = run_concurrent(Engine(engine.model, engine.tokenizer, config), prompts, output_len)
        if slots > 1:
            check_concurrent(run)
        comparisons.append(compare(baseline, run))  # refuses different token ids

    print(render(comparisons))
    print()
    print(render_doublings(marginal_doublings([c.candidate for c in comparisons])))
    single = next((c for c in comparisons if c.candidate.slots == 1), None)
    print()
    print(f"{'system':<18}{'decode tok/s':>13}{'vs hf':>8}")
    base_rate = baseline.mean_decode_tok_per_s  # None when every request has a single token
    for run in (baseline, *(c.candidate for c in comparisons)):
        rate = run.mean_decode_tok_per_s
        if rate is None or base_rate is None:
            print(f"{run.system:<18}{'-':>13}{'-':>8}")
        else:
            print(f"{run.system:<18}{rate:>13.2f}{rate / base_rate:>7.2f}x")
    if single is not None:
        for c in comparisons:
            if c.candidate.slots > 1:
                print(f"throughput at {c.candidate.slots} slots / at 1 slot: "
                      f"{c.candidate.throughput / single.candidate.throughput:.2f}x")

    out = Path(args.out)
    base_row = compare(baseline, baseline).as_row()
    rows = [base_row | {"decode_tok_per_s": baseline.mean_decode_tok_per_s or ""}]
    rows += [c.as_row() | {"decode_tok_per_s": c.candidate.mean_decode_tok_per_s or ""} for c in comparisons]
    doublings = {d.to_slots: d for d in marginal_doublings([c.candidate for c in comparisons])}
    for row in rows:
        d = doublings.get(row["slots"]) if row["system"] != "hf-generate" else None
        row["doubling_throughput_x"] = d.throughput_ratio if d else ""
        row["doubling_per_slot_x"] = d.per_slot_ratio if d else ""
        row["date"] = time.strftime("%Y-%m-%d")
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
