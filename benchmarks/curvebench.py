"""curvebench: latency against throughput, from a request-rate sweep and a slot sweep, on one pair of axes.

The rate sweep drives Poisson arrivals at each rate into an engine with fixed slots; the slot
sweep offers every request at once at each slot count. Each setting is one point (output tokens/s,
median end-to-end latency). Writes a CSV, and a PNG when matplotlib is installed.

    python benchmarks/curvebench.py            # 32 requests, rates 0.5..8 req/s, slots 1..16
    python benchmarks/curvebench.py --quick
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from nanoserve import Engine, EngineConfig
from nanoserve.baseline import run_concurrent
from nanoserve.instruments.curve import plot_png, point_from_metrics, point_from_run, write_csv
from nanoserve.instruments.load import check_offered_load, drive, offline_workload, rate_sweep
from nanoserve.instruments.metrics import benchmark_metrics, run_duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="runs/curvebench.csv")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = Engine.from_pretrained(args.model, EngineConfig(dtype="float32", quantization=None, max_model_len=1024))
    n, prompt_len, output_len = (8, 16, 8) if args.quick else (32, 32, 32)
    rates = [1.0, 4.0] if args.quick else [0.5, 1.0, 2.0, 4.0, 8.0]
    slot_counts = [1, 4] if args.quick else [1, 2, 4, 8, 16]
    rate_slots = 4 if args.quick else 8
    workload = offline_workload(n, prompt_len, output_len, base.model.config.vocab_size, seed=0)

    def engine(slots: int) -> Engine:
        return Engine(base.model, base.tokenizer, EngineConfig(dtype="float32", quantization=None, max_num_seqs=slots, max_model_len=1024,
                                                                enable_prefix_caching=False))

    drive(engine(rate_slots), offline_workload(2, 8, 4, base.model.config.vocab_size, seed=1))  # warm-up
    points = []
    for rate, metrics in zip(rates, rate_sweep(lambda: engine(rate_slots), workload, rates), strict=True):
        points.append(point_from_metrics("rate", rate, metrics))
    for slots in slot_counts:
        points.append(point_from_run(run_concurrent(engine(slots), workload.prompts, workload.output_lens)))
    # The offline run at the rate sweep's slot count must really have batched.
    outputs = drive(engine(rate_slots), workload)
    check_offered_load(outputs)
    top = benchmark_metrics(outputs, run_duration(outputs))

    print(f"curvebench: {n} requests, prompt {prompt_len}, output {output_len}; rate sweep at {rate_slots} slots")
    print(f"{'sweep':<7}{'setting':>9}{'tok/s':>9}{'e2e median s':>14}")
    for p in points:
        print(f"{p.source:<7}{p.setting:>9g}{p.throughput_tok_s:>9.2f}{p.latency_s:>14.2f}")
    print(f"offline at {rate_slots} slots: {top.output_throughput:.2f} tok/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(points, out)
    print(f"wrote {out}")
    try:
        plot_png(points, out.with_suffix(".png"), title="nanoserve: latency against throughput")
        print(f"wrote {out.with_suffix('.png')}")
    except ImportError as e:
        print(f"no PNG: {e}")


if __name__ == "__main__":
    main()
