"""specbench: speculative decoding against plain decoding, on the default model.

Two kinds of work, as chat prompts: input-grounded (edit this code, repeat or correct this text,
answer from this passage: the answer repeats spans of the prompt) and open-ended (a story, an
explanation: little to look up). Each runs at 1 request at a time and at 16 at once, greedy, on
two engines built side by side in this process, one with speculation and one without, in
interleaved rounds (plain, speculative, plain, ...). Every round checks that the two engines' outputs
are token-identical and the run exits 1 if any differs.

Per workload and concurrency the table gives each system's decode rate (output tokens after the
first over the seconds from first token to finish, summed over requests) and output rate (output
tokens over the wall time, prefill included), their ratio (median of the rounds, with the
smallest and largest), and speculation's drafted and accepted tokens and mean accepted length per
verification.

--method ngram (the default) serves the shipped Q4_1 file with prompt lookup. --method draft_model
serves the same model's dense checkpoint (the GGUF de-quantized, in --target-dtype) with the shipped
Q4_1 file as its draft: a quantized copy of the target, the one draft with SmolLM2's vocabulary
here (a truncated copy, the first layers alone, keeps under a tenth of its drafts: notes/specbench.md).

With --hf (ngram), transformers' `generate` is run with and without
`prompt_lookup_num_tokens` on the same prompts (1 at a time, its own ratio); with --llamacpp,
llama.cpp's `llama-lookup` drafting k and drafting nothing, on the shipped GGUF file, where
`python -m benchmarks.peerbench --setup-llamacpp` built llama.cpp and
`cmake --build .peers/llama.cpp-build --target llama-lookup` built the tool; with --method
draft_model, llama.cpp's `llama-speculative` with the same pair (its float32 GGUF of the dense
checkpoint as target, the Q4_1 file as draft) over `llama-lookup` drafting nothing on the target
(`cmake --build .peers/llama.cpp-build --target llama-speculative` builds it).

    python benchmarks/specbench.py                          # 3 rounds, k = 4, 128 tokens
    python benchmarks/specbench.py --rounds 5 --hf --llamacpp
    python benchmarks/specbench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 8}'
    python benchmarks/specbench.py --method draft_model --target-dtype bfloat16 --llamacpp
    python benchmarks/specbench.py --tensor-parallel-size 2   # both engines on 2 ranks (a draft model on rank 0)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.chat import encode_chat, render_chat
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.model.default import default_model_dir, gguf_path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BIN = ROOT / ".peers" / "llama.cpp-build" / "bin"

CODE = '''import statistics


def average(numbers):
    """Return the average of a list of numbers."""
    if not numbers:
        raise ValueError("average of an empty list")
    return sum(numbers) / len(numbers)


def spread(numbers):
    """Return the difference between the largest and the smallest number."""
    return max(numbers) - min(numbers)


def report(numbers):
    mean = average(numbers)
    width = spread(numbers)
    print(f"average {mean:.2f}, spread {width:.2f}, median {statistics.median(numbers):.2f}")
'''
JS = '''function totalPrice(items) {
  let total = 0;
  for (const item of items) {
    total += item.price * item.quantity;
  }
  return total;
}

function cheapest(items) {
  let best = items[0];
  for (const item of items) {
    if (item.price < best.price) {
      best = item;
    }
  }
  return best;
}
'''
TYPOS = ("The comittee met on tuesday to discuss the new libary. Most members agreed that the bilding was to small "
         "for the growing number of visiters, and that a second floor should be added before next winter. The "
         "treasurer warned that the cost would be higer than expected, but the chairman said the town could aford it.")
STEPS = ("Preheat the oven to 180 degrees. Mix the flour, the sugar and the butter in a large bowl. Add two eggs and "
         "stir until smooth. Pour the batter into a greased tin. Bake for forty minutes, then let the cake cool "
         "for ten minutes before serving.")
PASSAGE_1 = ("The Great Barrier Reef is the world's largest coral reef system. It is composed of over 2,900 individual "
             "reefs and 900 islands stretching for over 2,300 kilometres. The reef is located in the Coral Sea, off "
             "the coast of Queensland, Australia. It can be seen from outer space and is the world's biggest single "
             "structure made by living organisms. The reef was selected as a World Heritage Site in 1981.")
PASSAGE_2 = ("Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. She was the "
             "first woman to win a Nobel Prize, the first person to win a Nobel Prize twice, and the only person to "
             "win a Nobel Prize in two scientific fields. She was born in Warsaw in 1867 and moved to Paris in 1891, "
             "where she studied at the University of Paris.")

WORKLOADS = {
    "grounded": [
        "Rename the function average to mean everywhere in this code and return the whole code:\n\n" + CODE,
        "Rename the variable items to products in this JavaScript code and return the whole code:\n\n" + JS,
        "Repeat the following paragraph, correcting its spelling mistakes:\n\n" + TYPOS,
        "Rewrite these instructions as a numbered list, keeping every sentence:\n\n" + STEPS,
        PASSAGE_1 + "\n\nUsing only the passage above, answer: where is the Great Barrier Reef and how long is it? "
                    "Quote the sentences that support your answer.",
        PASSAGE_2 + "\n\nUsing only the passage above, tell me what Marie Curie was the first to do, quoting it.",
    ],
    "open": [
        "Write a short story about a robot who learns to paint.",
        "Explain how vaccines train the immune system.",
        "Give me ten ideas for a child's birthday party.",
        "Write a poem about autumn in the city.",
    ],
}


def prompts_of(engine: Engine, workload: str, concurrency: int) -> list[list[int]]:
    texts = WORKLOADS[workload]
    chats = [texts[i % len(texts)] for i in range(max(concurrency, len(texts)))]
    return [encode_chat(engine.tokenizer, render_chat(engine.tokenizer, [{"role": "user", "content": t}])) for t in chats]


def run_once(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """The prompts, `concurrency` at a time (in order; each batch waits for the last to finish)."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += engine.generate(prompts[i:i + concurrency], params)
    wall = time.perf_counter() - start
    decode_s = sum(o.finished_time - o.first_token_time for o in outputs if len(o.token_ids) > 1)
    return {
        "tokens": [list(o.token_ids) for o in outputs],
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "decode_tok_s": sum(len(o.token_ids) - 1 for o in outputs) / decode_s if decode_s else 0.0,
        "tok_s": sum(len(o.token_ids) for o in outputs) / wall,
        "drafts": sum(o.num_drafts for o in outputs),
        "drafted": sum(o.num_draft_tokens for o in outputs),
        "accepted": sum(o.num_accepted_tokens for o in outputs),
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def speculative_config(args: argparse.Namespace) -> dict:
    """--speculative-config, or the method's: k = 4, and for draft_model the shipped Q4_1 file."""
    if args.speculative_config is not None:
        return json.loads(args.speculative_config)
    if args.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    return {"method": "draft_model", "model": str(gguf_path()), "num_speculative_tokens": 4}


def target_of(args: argparse.Namespace) -> tuple[Path | None, dict]:
    """What both engines serve, and their EngineConfig fields: the shipped GGUF as the plan likes it,
    or (draft_model) its dense checkpoint in --target-dtype on the batch-invariant plan."""
    common = {"max_num_seqs": 16, "tensor_parallel_size": args.tensor_parallel_size}
    if speculative_config(args)["method"] == "ngram":
        return None, common
    return default_model_dir(), common | {"dtype": args.target_dtype, "quantization": None, "batch_invariant": True}


def bench_nanoserve(args: argparse.Namespace) -> tuple[list[dict], int]:
    spec = speculative_config(args)
    target, fields = target_of(args)
    engines = {"plain": Engine.from_pretrained(target, EngineConfig(**fields)),
               "spec": Engine.from_pretrained(target, EngineConfig(**fields, speculative_config=spec))}
    try:
        return measure(args, spec, fields, engines)
    finally:
        for engine in engines.values():
            engine.close()  # a tensor-parallel engine's workers end with it


def measure(args: argparse.Namespace, spec: dict, fields: dict, engines: dict[str, Engine]) -> tuple[list[dict], int]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for engine in engines.values():
        engine.warmup()
    cases = [(w, c) for w in args.workloads for c in args.concurrency]
    runs: dict[tuple[str, int, str], list[dict]] = {}
    differ = 0
    for r in range(args.rounds):
        for workload, concurrency in cases:
            prompts = prompts_of(engines["plain"], workload, concurrency)
            got = {}
            for name, engine in engines.items():
                got[name] = run_once(engine, prompts, concurrency, params)
                runs.setdefault((workload, concurrency, name), []).append(got[name])
            bad = sum(a != b for a, b in zip(got["plain"]["tokens"], got["spec"]["tokens"], strict=True))
            differ += bad
            print(f"  round {r + 1} {workload:<9} x{concurrency:<3} plain {got['plain']['decode_tok_s']:7.1f} "
                  f"spec {got['spec']['decode_tok_s']:7.1f} decode tok/s; {bad} outputs differ", flush=True)
    rows = []
    print(f"\n{'workload':<10}{'conc':>5}{'plain tok/s':>13}{'spec tok/s':>13}{'decode ratio':>20}{'output ratio':>20}"
          f"{'accept':>8}{'per verify':>11}")
    for workload, concurrency in cases:
        plain, spec_runs = runs[(workload, concurrency, "plain")], runs[(workload, concurrency, "spec")]
        decode = [n["decode_tok_s"] / p["decode_tok_s"] for p, n in zip(plain, spec_runs, strict=True)]
        output = [n["tok_s"] / p["tok_s"] for p, n in zip(plain, spec_runs, strict=True)]
        drafted, accepted, drafts = spec_runs[-1]["drafted"], spec_runs[-1]["accepted"], spec_runs[-1]["drafts"]
        rate = accepted / drafted if drafted else 0.0
        per_verify = accepted / drafts if drafts else 0.0
        print(f"{workload:<10}{concurrency:>5}{statistics.median(p['decode_tok_s'] for p in plain):>13.1f}"
              f"{statistics.median(n['decode_tok_s'] for n in spec_runs):>13.1f}{spread(decode):>20}{spread(output):>20}"
              f"{rate:>8.2f}{per_verify:>11.2f}")
        rows.append({"system": "nanoserve", "method": spec["method"], "target": fields.get("dtype", "q4_1"),
                     "tp": args.tensor_parallel_size, "workload": workload, "concurrency": concurrency,
                     "rounds": args.rounds,
                     "k": spec.get("num_speculative_tokens"), "config": json.dumps(spec),
                     "plain_decode_tok_s": round(statistics.median(p["decode_tok_s"] for p in plain), 2),
                     "spec_decode_tok_s": round(statistics.median(n["decode_tok_s"] for n in spec_runs), 2),
                     "decode_ratio": round(statistics.median(decode), 3), "decode_ratio_min": round(min(decode), 3),
                     "decode_ratio_max": round(max(decode), 3), "output_ratio": round(statistics.median(output), 3),
                     "output_ratio_min": round(min(output), 3), "output_ratio_max": round(max(output), 3),
                     "drafted": drafted, "accepted": accepted, "acceptance": round(rate, 3),
                     "accepted_per_verify": round(per_verify, 3), "output_tokens": spec_runs[-1]["output_tokens"],
                     "differing_outputs": differ})
    return rows, differ


def bench_hf(args: argparse.Namespace) -> list[dict]:
    """transformers' generate, greedy, with and without prompt_lookup_num_tokens, 1 request at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = default_model_dir()  # the shipped GGUF de-quantized to float32 safetensors, once
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    k = speculative_config(args).get("num_speculative_tokens", 4)
    rows = []
    for workload in args.workloads:
        ids = [torch.tensor([tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                                             add_generation_prompt=True, tokenize=False),
                                              add_special_tokens=False)]) for t in WORKLOADS[workload]]
        rates: dict[str, list[float]] = {"plain": [], "lookup": []}
        differ = 0
        for _ in range(args.hf_rounds):
            tokens = {}
            for name, extra in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": k})):
                n_out, seconds, tokens[name] = 0, 0.0, []
                for prompt in ids:
                    start = time.perf_counter()
                    with torch.inference_mode():
                        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                             max_new_tokens=args.max_tokens, pad_token_id=tokenizer.eos_token_id, **extra)
                    seconds += time.perf_counter() - start
                    n_out += out.shape[1] - prompt.shape[1]
                    tokens[name].append(out[0, prompt.shape[1]:].tolist())
                rates[name].append(n_out / seconds)
            differ += sum(a != b for a, b in zip(tokens["plain"], tokens["lookup"], strict=True))
        ratio = [b / a for a, b in zip(rates["plain"], rates["lookup"], strict=True)]
        print(f"transformers {workload:<9} x1  plain {statistics.median(rates['plain']):6.1f} lookup "
              f"{statistics.median(rates['lookup']):6.1f} tok/s (prefill included): ratio {spread(ratio)}; "
              f"{differ} outputs differ")
        rows.append({"system": "transformers", "workload": workload, "concurrency": 1, "rounds": args.hf_rounds, "k": k,
                     "config": f"prompt_lookup_num_tokens={k}",
                     "plain_decode_tok_s": round(statistics.median(rates["plain"]), 2),
                     "spec_decode_tok_s": round(statistics.median(rates["lookup"]), 2),
                     "decode_ratio": round(statistics.median(ratio), 3), "decode_ratio_min": round(min(ratio), 3),
                     "decode_ratio_max": round(max(ratio), 3), "differing_outputs": differ})
    return rows


def bench_llamacpp(args: argparse.Namespace) -> list[dict]:
    """llama.cpp, 1 request at a time, 2 threads, greedy: the decode rate each run reports ("decoded N
    tokens in S seconds"). ngram: llama-lookup (prompt lookup, --spec-draft-n-max k) against the same
    binary drafting nothing (--spec-draft-n-max 0: its plain decode) on the shipped Q4_1 file.
    draft_model: llama-speculative, the float32 GGUF of the dense checkpoint (peerbench's) as target
    and the Q4_1 file as draft, against llama-lookup drafting nothing on the target."""
    spec = speculative_config(args)
    k = spec.get("num_speculative_tokens", 4)
    lookup, speculative = LLAMA_BIN / "llama-lookup", LLAMA_BIN / "llama-speculative"
    target = ROOT / ".peers" / "smollm2-135m-f32.gguf"
    drafting = spec["method"] == "draft_model"
    for tool in (lookup, speculative) if drafting else (lookup,):
        if not tool.is_file():
            print(f"llama.cpp: {tool} not built (python -m benchmarks.peerbench --setup-llamacpp, then "
                  f"cmake --build {LLAMA_BIN.parent} --target {tool.name})")
            return []
    if drafting and not target.is_file():
        print(f"llama.cpp: {target} missing (python -m benchmarks.peerbench --setup-llamacpp converts it)")
        return []
    plain_cmd = [str(lookup), "-m", str(target) if drafting else str(gguf_path()), "--spec-draft-n-max", "0"]
    spec_cmd = ([str(speculative), "-m", str(target), "-md", spec["model"]] if drafting
                else [str(lookup), "-m", str(gguf_path())]) + ["--spec-draft-n-max", str(k)]
    tokenizer = Engine.from_pretrained(None, EngineConfig(num_kv_blocks=1)).tokenizer
    rows = []
    for workload in args.workloads:
        texts = [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in WORKLOADS[workload]]
        ratio, accepted, drafted = [], 0, 0
        for _ in range(args.rounds):
            rate = {}
            for name, tool_cmd in (("plain", plain_cmd), ("spec", spec_cmd)):
                tokens, seconds = 0, 0.0
                for text in texts:
                    cmd = tool_cmd + ["-p", text, "-n", str(args.max_tokens), "-t", "2", "--temp", "0", "-c", "2048"]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    log = done.stdout + done.stderr
                    found = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s*s", log)
                    if found is None:
                        print(f"llama.cpp {name}: no 'decoded N tokens in S s' line (rc {done.returncode}):\n{log[-800:]}")
                        return rows
                    tokens += int(found.group(1))
                    seconds += float(found.group(2))
                    if name == "spec":
                        drafted += int(m.group(1)) if (m := re.search(r"n_drafted\s*=\s*(\d+)", log)) else 0
                        accepted += int(m.group(1)) if (m := re.search(r"n_accept\s*=\s*(\d+)", log)) else 0
                rate[name] = tokens / seconds
            ratio.append(rate["spec"] / rate["plain"])
        print(f"llama.cpp {workload:<9} x1  {Path(spec_cmd[0]).name} k={k} over k=0, decode rate: {spread(ratio)}; "
              f"accepted {accepted} of {drafted} drafted")
        rows.append({"system": "llama.cpp", "method": spec["method"], "target": "f32" if drafting else "q4_1",
                     "workload": workload, "concurrency": 1, "rounds": args.rounds, "k": k,
                     "config": " ".join(Path(c).name for c in spec_cmd), "decode_ratio": round(statistics.median(ratio), 3),
                     "decode_ratio_min": round(min(ratio), 3), "decode_ratio_max": round(max(ratio), 3),
                     "drafted": drafted, "accepted": accepted,
                     "acceptance": round(accepted / drafted, 3) if drafted else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram",
                        help="ngram on the shipped file, or draft_model: its dense checkpoint with the file as draft")
    parser.add_argument("--target-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="draft_model: the dense target's dtype")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="nanoserve's engines on this many ranks (the batch-invariant plan's c-tensor-parallel)")
    parser.add_argument("--speculative-config", default=None,
                        help="the speculative engine's EngineConfig.speculative_config, as JSON (default: the method's, k = 4)")
    parser.add_argument("--hf", action="store_true", help="also transformers' prompt_lookup_num_tokens (loads for ~35 s)")
    parser.add_argument("--hf-rounds", type=int, default=3)
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp's llama-lookup, where it is built")
    parser.add_argument("--no-nanoserve", action="store_true", help="only the peers asked for (--hf, --llamacpp)")
    parser.add_argument("--out", default="runs/specbench.csv")
    args = parser.parse_args()
    print(f"specbench: {args.rounds} interleaved rounds, {args.max_tokens} tokens, greedy, "
          f"speculative_config {json.dumps(speculative_config(args))}")
    rows, differ = bench_nanoserve(args) if not args.no_nanoserve else ([], 0)
    if args.hf and speculative_config(args)["method"] != "ngram":
        print("transformers: not run for draft_model (it de-quantizes the GGUF draft: it would be the target itself)")
    elif args.hf:
        rows += bench_hf(args)
    if args.llamacpp:
        rows += bench_llamacpp(args)
    write_csv(args.out, rows)
    print(f"wrote {args.out}; {differ} outputs differed between the plain and the speculative engine")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
