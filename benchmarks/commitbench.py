"""commitbench: the decode step (and a prefill) of two commits, timed as an interleaved pair on the default model.

Each commit is checked out into its own git worktree and every measurement is a fresh child
process that imports nanoserve from that tree, so the two sides share nothing but the machine.
The children alternate (base, head, base, head, ...) round by round, and the report is the ratio
of the medians, head / base: below 1.0 the head commit's step is faster.

    python benchmarks/commitbench.py --base 5c0b1c5                # against the working tree
    python benchmarks/commitbench.py --base 5c0b1c5 --head HEAD --slots 1 16 --rounds 4
    python benchmarks/commitbench.py --base 5c0b1c5 --slots 1 16 32 --prefill 512 --precision default

--prefill N also times a lone N-token prompt's prefill (the step that computes it and samples its
first token), a fresh prompt each time, as a row of its own.

The child uses only the public API both commits must share (Engine.from_pretrained,
EngineConfig, SamplingParams, add_request, step), in float32 with the engine's defaults otherwise;
with --precision default, at the engine's default precision (dtype and quantization "auto": the
shipped GGUF's blocks in kernel form where the probe keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nanoserve.instruments.csv_writer import write_csv

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import torch
from nanoserve import Engine, EngineConfig, SamplingParams

slots, steps, threads, prompt_len = (int(a) for a in sys.argv[1:5])
exact = sys.argv[5] == "float32"
prefill = sys.argv[6] == "prefill"
torch.set_num_threads(threads)
fields = EngineConfig.__dataclass_fields__
config = EngineConfig(max_num_seqs=slots, max_model_len=max(1024, prompt_len + 8),
                      **({"dtype": "float32"} if exact and "dtype" in fields else {}),
                      **({"quantization": None} if exact and "quantization" in fields else {}))
engine = Engine.from_pretrained(None, config)
params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
if prefill:  # a lone prompt's prefill step, a fresh prompt each time (no prefix-cache hit); the first uncounted
    times = []
    for i in range(steps + 1):
        request_id = engine.add_request([100 + (i * 31 + j * 7) % 5000 for j in range(prompt_len)], params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.abort(request_id)
    print(json.dumps(times[1:]))
    sys.exit(0)
for i in range(slots):
    engine.add_request([100 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
    engine.step()
engine.step()  # the first decode: uncounted warm-up
times = []
for _ in range(steps):
    start = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def worktree(rev: str, into: Path) -> Path:
    """A detached checkout of `rev` under `into`; "WORKTREE" is this tree as it stands."""
    if rev == "WORKTREE":
        return ROOT
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)
    return path


def step_times(tree: Path, slots: int, steps: int, threads: int, prompt_len: int,
               precision: str = "float32", kind: str = "decode") -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(slots), str(steps), str(threads), str(prompt_len), precision,
                           kind], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit measured against")
    parser.add_argument("--head", default="WORKTREE", help="a commit, or WORKTREE (default): this tree")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--precision", choices=["float32", "default"], default="float32",
                        help="float32 (the exact path), or the engine's default precision")
    parser.add_argument("--prefill", type=int, default=None, metavar="N",
                        help="also time a lone N-token prompt's prefill step (a row 'prefill N')")
    parser.add_argument("--out", default="runs/commitbench.csv")
    args = parser.parse_args()
    for name in ("rounds", "steps", "prompt_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.prefill is not None and args.prefill < 1:
        parser.error(f"--prefill={args.prefill} must be >= 1")
    # each case: (its label, slots, prompt length, the child's kind)
    cases = [(str(slots), slots, args.prompt_len, "decode") for slots in args.slots]
    if args.prefill is not None:
        cases.append((f"prefill {args.prefill}", 1, args.prefill, "prefill"))
    with tempfile.TemporaryDirectory(prefix="commitbench-") as tmp:
        trees = {"base": worktree(args.base, Path(tmp)), "head": worktree(args.head, Path(tmp))}
        try:
            times: dict[tuple[str, str], list[float]] = {}
            rounds: dict[tuple[str, str], list[float]] = {}  # each round's median step
            for r in range(args.rounds):
                for label, slots, prompt_len, kind in cases:
                    for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
                        measured = step_times(trees[side], slots, args.steps, args.threads, prompt_len, args.precision,
                                              kind)
                        times.setdefault((side, label), []).extend(measured)
                        rounds.setdefault((side, label), []).append(statistics.median(measured))
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    rows = []
    print(f"commitbench: decode step, base {args.base} vs head {args.head}, {args.rounds} rounds x "
          f"{args.steps} steps, {args.threads} threads, {args.precision} precision, medians")
    print(f"{'slots':>11} {'base ms':>10} {'head ms':>10} {'head/base':>10} {'per round':>20}")
    for label, *_ in cases:
        base, head = statistics.median(times[("base", label)]), statistics.median(times[("head", label)])
        # the spread: each round's head / base, the pair run back to back
        ratios = [h / b for h, b in zip(rounds[("head", label)], rounds[("base", label)], strict=True)]
        print(f"{label:>11} {base * 1e3:>10.2f} {head * 1e3:>10.2f} {head / base:>10.3f} "
              f"{min(ratios):>9.3f} - {max(ratios):.3f}")
        rows.append({"base": args.base, "head": args.head, "slots": label, "rounds": args.rounds,
                     "steps": args.steps, "threads": args.threads, "precision": args.precision,
                     "base_step_ms": base * 1e3,
                     "head_step_ms": head * 1e3, "head_over_base": head / base,
                     "round_ratio_min": min(ratios), "round_ratio_max": max(ratios)})
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
