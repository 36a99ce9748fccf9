"""invariancebench: how many answers change with the load, on the invariant plan and off it.

On the default model at the default precision, 16 questions sharing a system prompt are each run
alone (the quiet answers), then all together in batches of 3, 8 and 16 slots beside a long prompt
prefilled in chunks of 64 tokens, in a pool small enough to preempt; greedy and seeded sampling, 64
tokens each. An output differs when its tokens differ from its quiet answer's. Run for
EngineConfig.batch_invariant False (the fastest plan) and True (the invariant one), one engine
after the other:

    python benchmarks/invariancebench.py                    # 16 questions x 3 widths x 2 kinds, both plans
    python benchmarks/invariancebench.py --tokens 24 --widths 3 16
"""

from __future__ import annotations

import argparse
import time

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.csv_writer import write_csv

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. "
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 7?", "Explain what a CPU cache is.", "Give a synonym for happy.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "Who wrote Hamlet?", "List two uses of Python.",
    "What is a prime number?", "Describe a cat in one sentence.", "How many legs does a spider have?",
    "What does HTTP stand for?", "Give me a tip for sleeping well.", "What is the boiling point of water?",
]
LONG = "Summarise this: " + " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(80))


def kinds(tokens: int) -> dict[str, SamplingParams]:
    return {"greedy": SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=tokens, ignore_eos=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[3, 8, 16])
    parser.add_argument("--blocks", type=int, default=64, help="the busy engines' KV pool, in blocks of 16 tokens")
    parser.add_argument("--out", default="runs/invariancebench.csv")
    args = parser.parse_args()
    prompts = [SYSTEM + q for q in QUESTIONS]
    rows = []
    print(f"invariancebench: {len(prompts)} questions x {len(args.widths)} widths x 2 kinds, {args.tokens} tokens, "
          f"beside a long prompt in 64-token chunks, a pool of {args.blocks} blocks")
    print(f"{'plan':<10}{'kind':<8}{'width':>6}{'differ':>8}{'of':>4}{'preempted':>11}{'seconds':>9}")
    for invariant in (False, True):
        alone = Engine.from_pretrained(None, EngineConfig(max_num_seqs=1, enable_prefix_caching=False,
                                                          batch_invariant=invariant))
        quiet = {kind: [list(o.token_ids) for o in (alone.generate([p], sp)[0] for p in prompts)]
                 for kind, sp in kinds(args.tokens).items()}
        del alone
        for width in args.widths:
            busy = Engine.from_pretrained(None, EngineConfig(max_num_seqs=width, max_num_batched_tokens=64,
                                                             num_kv_blocks=args.blocks, batch_invariant=invariant))
            for kind, sp in kinds(args.tokens).items():
                start = time.perf_counter()
                outputs = busy.generate([LONG] + prompts, [SamplingParams(max_tokens=args.tokens)] + [sp] * len(prompts))
                seconds = time.perf_counter() - start
                differ = sum(list(o.token_ids) != q for o, q in zip(outputs[1:], quiet[kind], strict=True))
                preempted = sum(o.num_preemptions for o in outputs)
                busy.check_invariants()
                plan = "invariant" if invariant else "fastest"
                rows.append({"plan": plan, "kind": kind, "width": width, "differ": differ, "outputs": len(prompts),
                             "preemptions": preempted, "seconds": round(seconds, 2)})
                print(f"{plan:<10}{kind:<8}{width:>6}{differ:>8}{len(prompts):>4}{preempted:>11}{seconds:>9.1f}")
    for plan in ("fastest", "invariant"):
        mine = [r for r in rows if r["plan"] == plan]
        print(f"{plan}: {sum(r['differ'] for r in mine)} of {sum(r['outputs'] for r in mine)} outputs differ from "
              "their quiet answer")
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
