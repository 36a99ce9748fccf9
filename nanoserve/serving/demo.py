"""`python -m nanoserve demo`: several prompts at once on the embedded default model."""

from __future__ import annotations

import argparse
import time

from nanoserve import Engine, EngineConfig, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for writing clear code.",
    "Explain what a hash table is in two sentences.",
    "What is 12 times 13?",
    "Name a famous physicist and one discovery.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve demo", description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args(argv)

    engine = Engine.from_pretrained(args.model, EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=1024))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    if getattr(engine.tokenizer, "chat_template", None):
        outputs = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    else:
        outputs = engine.generate(QUESTIONS, params)
    wall = time.perf_counter() - start

    for question, out in zip(QUESTIONS, outputs, strict=True):
        print(f"### {question}\n{out.text.strip()}\n")
    print(f"{'request':>7} {'prompt':>6} {'output':>6} {'TTFT s':>7} {'E2E s':>6} {'finish':>6}")
    for out in outputs:
        print(f"{out.request_id:>7} {len(out.prompt_token_ids):>6} {len(out.token_ids):>6} "
              f"{out.first_token_time - out.arrival_time:>7.3f} {out.finished_time - out.arrival_time:>6.2f} "
              f"{out.finish_reason:>6}")
    total = sum(len(out.token_ids) for out in outputs)
    print(f"{len(outputs)} requests, {total} output tokens in {wall:.2f} s: {total / wall:.1f} tokens/s "
          f"(max_num_seqs={args.max_num_seqs}, {engine.plan.dtype}, quantization "
          f"{engine.plan.quantization}, {engine.config.device})")


if __name__ == "__main__":
    main()
