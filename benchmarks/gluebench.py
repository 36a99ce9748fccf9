"""gluebench: how much of a decode step is the linears, and how much everything else.

One engine on the default model (or --model) at the given precision decodes `--slots` requests;
each round times `--steps` decode steps as they are, then the same number with every linear of the
forward (nanoserve.model.llama.linear: the projections, the MLP and the head) answered by a lookup
of the output it gave for that weight and row count the first time. The second step is the
forward's glue (norms, rope, the paged K/V writes and gathers, attention, residual adds, casts)
plus the loop around it; the difference is what the linears cost. The tokens of the second half
are wrong (the cached outputs belong to other inputs): only its time is read. The engine runs
decoder_layer (fused_decode=False): the fused decode's glue is C between its own matmuls, with no
Python linears to answer (`python benchmarks/abbench.py --change fused` times it against this path).

    python benchmarks/gluebench.py                           # the default precision, 1 slot
    python benchmarks/gluebench.py --dtype float32 --quantization none --slots 1 16
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

import nanoserve.model.llama as llama
from nanoserve import Engine, EngineConfig, PlanOverrides
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.runners import decode_step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="auto, int8, int4 or none")
    parser.add_argument("--slots", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/gluebench.csv")
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype=args.dtype, quantization=quantization,
                                                             max_num_seqs=max(args.slots),
                                                             overrides=PlanOverrides(fused_decode=False)))
    real = llama.linear
    cached: dict[tuple[int, int], torch.Tensor] = {}

    def cached_linear(x: torch.Tensor, weight: llama.Weight) -> torch.Tensor:
        key = (x.shape[0], id(weight))
        if key not in cached:
            cached[key] = real(x, weight)
        return cached[key]

    rows = []
    for slots in args.slots:
        full, glue = [], []
        for _ in range(args.rounds):
            full.append(statistics.median(decode_step_times(engine, slots, args.steps)))
            # decoder_layer and the head look `linear` up in their module at each call: patched for
            # this block only (a tensor-parallel model's AllReduced would bypass it: one process here).
            with mock.patch.object(llama, "linear", cached_linear):
                decode_step_times(engine, slots, 2)  # fills the cache for these shapes
                glue.append(statistics.median(decode_step_times(engine, slots, args.steps)))
        step_ms, glue_ms = 1e3 * statistics.median(full), 1e3 * statistics.median(glue)
        rows.append({"slots": slots, "dtype": engine.plan.dtype, "quantization": engine.plan.quantization,
                     "step_ms": step_ms, "without_linears_ms": glue_ms, "linears_ms": step_ms - glue_ms,
                     "linears_share": (step_ms - glue_ms) / step_ms, "rounds": args.rounds, "steps": args.steps,
                     "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()})
    print(f"gluebench: {engine.plan.dtype}, quantization {engine.plan.quantization}, "
          f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds x {args.steps} decode steps")
    print(f"{'slots':>6}{'step ms':>10}{'without linears':>17}{'linears ms':>12}{'share':>8}")
    for r in rows:
        print(f"{r['slots']:>6}{r['step_ms']:>10.2f}{r['without_linears_ms']:>17.2f}{r['linears_ms']:>12.2f}"
              f"{r['linears_share']:>8.0%}")
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
