"""matmulbench: the decode step's matmuls alone, in every layout this engine has tried, one run.

The weights are random tensors of the default model's shapes (SmolLM2-135M: 30 layers of fused
qkv [960, 576], o [576, 576], fused gate/up [3072, 576], down [576, 1536], and the [49152, 576]
vocabulary head), 30 distinct copies so that a pass streams 425 MB from memory as a real step
does instead of finding them in cache. For each row count M, each layout runs one pass over all
30 layers (and, apart, the head), interleaved round by round, and the median pass is reported:

    linear    F.linear(x, W), W [N, K] as checkpoints store it (MKL)
    skinny    (W @ x^T)^T, the path this engine used for M <= 32 before packing
    xWt       x @ W^T with W^T stored contiguous [K, N] (MKL's other GEMV layout)
    packed    oneDNN's packed linear (torch.ops.mkldnn, weights reordered once): the engine's default

With --quant, the layouts of the lower precisions instead, activations in bf16 (the probe's choice
on a CPU with native bf16; --activations float32 for a CPU without), each against `dense` (what a
quantized linear reads past PlanOverrides.max_kernel_rows): the row count where a kernel stops
beating dense is that crossover.

    dense     dense in the activations' dtype, oneDNN-packed where oneDNN has it
    int8      torch's _weight_int8pack_mm, int8 per output channel
    int4      torch's _weight_int4pack_mm_for_cpu, int4 in groups of 32 (nanoserve's int4, GGUF Q4_1)
    blockdot  nanoserve's own kernel on the same int4 (nanoserve/model/blockdot.c), built for this
              machine or, with --blockdot-build avx2 / plain, as an AVX2-only or plain-C CPU would run it
    blockdot-i16  the same panels on blockdot's int16 path (activations rounded to int16 per block of 32)

    python benchmarks/matmulbench.py            # M = 1 2 4 8 16 32 64, about 3 minutes
    python benchmarks/matmulbench.py --quick    # M = 1 16, 3 rounds
    python benchmarks/matmulbench.py --quant --rows 1 2 4 8 12 16 32
    python benchmarks/matmulbench.py --quant --activations float32 --blockdot-build avx2 --rows 1 4 8

Columns: ms per pass, GB/s of weights read (bytes / time), GFLOP/s (2 M N K / time), and each
layout's time over `packed`'s. A read rate is what bounds a small-M pass; a FLOP rate a large one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.instruments.csv_writer import write_csv
from nanoserve.model import blockdot
from nanoserve.model.forms import pack
from nanoserve.model.quant import QuantLinear, dense_weight, quant_linear, quantize_int4, quantize_int8

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K]: qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)
LAYOUTS = ("linear", "skinny", "xWt", "packed")
QUANT_LAYOUTS = ("int8", "int4", "blockdot", "blockdot-i16", "dense")  # the last is the one the others are divided by


def prepare(weights: list[torch.Tensor], layout: str, dtype: torch.dtype = torch.bfloat16,
            kernel: blockdot.Library | None = None) -> list:
    if layout == "dense":
        return [dense_weight(w.to(dtype), packed=True) for w in weights]
    if layout in ("blockdot", "blockdot-i16"):
        return [blockdot.pack(quantize_int4(w), kernel, int16_rows=1 if layout == "blockdot-i16" else None)
                for w in weights]
    if layout in ("int8", "int4"):
        quantize = quantize_int8 if layout == "int8" else quantize_int4
        return [quant_linear(quantize(w), dtype, None, pack=False) for w in weights]
    if layout == "xWt":
        return [w.t().contiguous() for w in weights]
    if layout == "packed":
        return [pack(w) for w in weights]
    return weights


def apply(layout: str, x: torch.Tensor, w: torch.Tensor | QuantLinear) -> torch.Tensor:
    if layout in ("dense", "packed") or isinstance(w, QuantLinear | blockdot.Panels):
        return w(x)  # a weight form (nanoserve.model.forms), or blockdot's panels
    if layout == "linear":
        return F.linear(x, w)
    if layout == "skinny":
        return torch.mm(w, x.t()).t().contiguous()
    if layout == "xWt":
        return x @ w
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS + QUANT_LAYOUTS}")


def time_pass(layout: str, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    """One pass over `weights`, each fed the input of its K (x@Wt's weights are stored [K, N])."""
    k_dim = 0 if layout == "xWt" else 1
    start = time.perf_counter()
    for w in weights:
        apply(layout, xs[w.shape[k_dim]], w)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--quant", action="store_true", help="int8 and int4 kernels against dense bf16")
    parser.add_argument("--activations", choices=["bfloat16", "float32"], default="bfloat16",
                        help="with --quant: the activations' dtype (and the dense reference's)")
    parser.add_argument("--blockdot-build", choices=list(blockdot.BUILDS), default="native",
                        help="with --quant: the blockdot build to run")
    parser.add_argument("--out", default="runs/matmulbench.csv")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = [1, 16], 3
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=gen) for _ in range(30) for n, k in LAYER_SHAPES]
    head = [torch.randn(*HEAD_SHAPE, generator=gen)]
    layouts = QUANT_LAYOUTS if args.quant else LAYOUTS
    reference = layouts[-1]
    dtype = getattr(torch, args.activations)
    kernel = None
    if args.quant:
        try:
            kernel = blockdot.load(blockdot.BUILDS[args.blockdot_build])
        except OSError as exc:  # no C compiler: torch's kernels alone
            print(f"blockdot not built ({exc}): its column is left out")
            layouts = tuple(name for name in layouts if not name.startswith("blockdot"))
    stacks = {(part, layout): prepare(ws, layout, dtype, kernel) for part, ws in (("layers", plain), ("head", head))
              for layout in layouts}
    nbytes = {"layers": sum(w.numel() for w in plain) * 4, "head": head[0].numel() * 4}
    if args.quant:
        print(f"activations {args.activations}; blockdot built {args.blockdot_build} "
              f"({kernel.simd if kernel else 'no'}-bit vectors)")
    print(f"matmulbench: {args.threads} threads, median of {args.rounds} interleaved rounds; "
          f"layers = 30 x (qkv, o, gate_up, down), {nbytes['layers'] / 1e6:.0f} MB; head {nbytes['head'] / 1e6:.0f} MB")
    print(f"{'part':<7}{'M':>4}" + "".join(f"{name + ' ms':>12}" for name in layouts)
          + f"{reference + ' GF/s':>13}" + "".join(f"{name + '/' + reference[:2]:>11}" for name in layouts[:-1]))
    rows = []
    with torch.inference_mode():
        for part in ("layers", "head"):
            for m in args.rows:
                xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
                if args.quant:
                    xs = {k: x.to(dtype) for k, x in xs.items()}
                samples: dict[str, list[float]] = {name: [] for name in layouts}
                for round_ in range(args.rounds + 1):
                    for name in layouts:
                        t = time_pass(name, stacks[(part, name)], xs)
                        if round_:  # round 0 warms up
                            samples[name].append(t)
                med = {name: statistics.median(v) for name, v in samples.items()}
                flops = 2 * m * nbytes[part] / 4
                row = {"part": part, "rows": m, "threads": args.threads}
                if args.quant:
                    row |= {"activations": args.activations, "blockdot_build": args.blockdot_build}
                row |= {f"{name}_ms": med[name] * 1e3 for name in layouts}
                if not args.quant:
                    row["packed_gb_per_s"] = nbytes[part] / med["packed"] / 1e9
                row[f"{reference}_gflop_per_s"] = flops / med[reference] / 1e9
                row |= {f"{name}_over_{reference}": med[name] / med[reference] for name in layouts[:-1]}
                rows.append(row)
                print(f"{part:<7}{m:>4}" + "".join(f"{med[name] * 1e3:>12.2f}" for name in layouts)
                      + f"{row[reference + '_gflop_per_s']:>13.1f}"
                      + "".join(f"{row[f'{name}_over_{reference}']:>10.2f}x" for name in layouts[:-1]))
    out = Path(args.out)
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
