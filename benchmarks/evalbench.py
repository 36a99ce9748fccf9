"""evalbench: lm-evaluation-harness pointed at `nanoserve serve`, against its own `hf` model on the same weights.

Two tasks are written from data/quantbench.txt (CPython's documentation: no dataset hub needed),
as lm-eval task YAMLs over local JSON lines:

- nanoserve_mc, multiple choice (loglikelihood): a sentence's first words, then its true next words
  against three spans of the same length from other sentences. lm-eval's `local-completions` model
  scores each choice with `echo: true, logprobs: 1, max_tokens: 1` over token arrays, as it does
  for any server; its `hf` model runs transformers on the checkpoint directory.
- nanoserve_gen, generate_until: "Complete the sentence" questions, answered through
  `local-chat-completions` (the chat template), to show a generation task runs to the end; its
  exact_match is reported, not compared (the two sides sample through different templates).

The server runs each --server-args set (default: the default plan, then the exact path); the
table gives each side's accuracy and the server's difference from hf in points.

    python benchmarks/evalbench.py                      # the default model, every document
    python benchmarks/evalbench.py --limit 40 --server-args "--dtype float32 --quantization none"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "data" / "quantbench.txt"
WORDS = 6  # words of each choice


def sentences(text: str) -> list[list[str]]:
    """The text's prose sentences of at least 12 words, as word lists (headings, code and rules dropped)."""
    prose = " ".join(line.strip() for line in text.splitlines()[1:] if line.strip() and not re.match(r"^[=*\-#>]", line.strip()))
    found = [s.split() for s in re.split(r"(?<=[.!?])\s+", prose)]
    return [s for s in found if len(s) >= 12 and all(w.isprintable() for w in s)]


def mc_docs(limit: int, seed: int = 0) -> list[dict]:
    """Multiple-choice documents: context, four choices (each " " + WORDS words), the true one's
    index. A sentence gives one document ending at its end, and a long one (3 WORDS or more) a
    second ending WORDS words earlier."""
    rng = random.Random(seed)
    found = sentences(TEXT.read_text())
    docs = []
    for back in (0, WORDS):
        for i, words in enumerate(found):
            if len(words) < 3 * WORDS and back:
                continue
            cut = len(words) - WORDS - back
            true = " " + " ".join(words[cut:cut + WORDS])
            distractors: list[str] = []
            for j in rng.sample(range(len(found)), len(found)):
                span = " " + " ".join(found[j][-WORDS:])
                if j != i and span != true and span not in distractors:
                    distractors.append(span)
                if len(distractors) == 3:
                    break
            label = rng.randrange(4)
            docs.append({"context": " ".join(words[:cut]), "choices": distractors[:label] + [true] + distractors[label:],
                         "label": label})
    return docs[:limit]


def gen_docs(limit: int) -> list[dict]:
    return [{"question": f"Complete the sentence: {d['context']}", "answer": d["choices"][d["label"]].strip()}
            for d in mc_docs(limit)]


MC_YAML = """task: nanoserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = """task: nanoserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, limit: int) -> Path:
    """The two tasks' YAMLs and JSON lines in `folder` (lm-eval's include_path)."""
    for name, docs, yaml in (("mc", mc_docs(limit), MC_YAML), ("gen", gen_docs(limit), GEN_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"nanoserve_{name}.yaml").write_text(yaml.format(data=data))
    return folder


def evaluate(model: str, model_args: str, task: str, include: Path, limit: int, chat: bool = False) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit,
                                  task_manager=TaskManager(include_path=str(include)), apply_chat_template=chat,
                                  log_samples=False, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return {key.split(",")[0]: value for key, value in out["results"][task].items() if "stderr" not in key}


def start_server(port: int, args: list[str], log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=400, help="documents of each task (the text gives 264)")
    parser.add_argument("--server-args", nargs="+", default=["", "--dtype float32 --quantization none --kernels torch"],
                        help="one `nanoserve serve` flag set per server run")
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--out", default="runs/evalbench.csv")
    args = parser.parse_args(argv)
    import httpx

    from nanoserve.instruments.csv_writer import write_csv
    from nanoserve.model import default

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    checkpoint = default.default_model_dir()  # the default model as transformers reads it: the tokenizer and hf's weights
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        include = write_tasks(Path(tmp), args.limit)
        hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu,batch_size=1", "nanoserve_mc",
                      include, args.limit)
        rows.append({"system": "hf", "server_args": "", "task": "nanoserve_mc", **hf})
        for flags in args.server_args:
            proc = start_server(args.port, shlex.split(flags), Path(tmp) / "server.log")
            try:
                base = f"http://127.0.0.1:{args.port}/v1"
                name = httpx.get(f"{base}/models", timeout=10).json()["data"][0]["id"]
                common = f"model={name},tokenizer={checkpoint},tokenizer_backend=huggingface,num_concurrent=1"
                mc = evaluate("local-completions", f"base_url={base}/completions,tokenized_requests=True,{common}",
                              "nanoserve_mc", include, args.limit)
                gen = evaluate("local-chat-completions", f"base_url={base}/chat/completions,{common}",
                               "nanoserve_gen", include, args.limit, chat=True)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            rows.append({"system": "nanoserve", "server_args": flags, "task": "nanoserve_mc", **mc,
                         "acc_points_vs_hf": 100 * (mc["acc"] - hf["acc"]),
                         "acc_norm_points_vs_hf": 100 * (mc["acc_norm"] - hf["acc_norm"])})
            rows.append({"system": "nanoserve", "server_args": flags, "task": "nanoserve_gen", **gen})
    print(f"{'system':<10} {'server args':<52} {'task':<14} {'acc':>7} {'acc_norm':>9} {'vs hf (points)':>15} "
          f"{'exact_match':>12}")
    for r in rows:
        versus = (f"{r['acc_points_vs_hf']:+.1f} / {r['acc_norm_points_vs_hf']:+.1f}"
                  if "acc_points_vs_hf" in r else "")
        print(f"{r['system']:<10} {r['server_args'] or '(defaults)':<52} {r['task']:<14} {r.get('acc', float('nan')):>7.3f} "
              f"{r.get('acc_norm', float('nan')):>9.3f} {versus:>15} {r.get('exact_match', float('nan')):>12.3f}")
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
