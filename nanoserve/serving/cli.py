"""`nanoserve <command>`: serve, bench-serve, demo, plan. Also `python -m nanoserve <command>`."""

from __future__ import annotations

import argparse
import json
import os
import sys

COMMANDS = {
    "serve": "an OpenAI-compatible HTTP server (loopback unless --host says otherwise)",
    "bench-serve": "drive a running server with Poisson arrivals and report serving metrics",
    "demo": "several prompts at once on the embedded default model",
    "plan": "print the execution plan a model would run on this machine (what runs each step, and why)",
}


def serve_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve serve", description=COMMANDS["serve"])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: the directory name)")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens forwarded per step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from a 512 MiB budget)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="auto: bfloat16 where a start-up probe times it faster than float32")
    parser.add_argument("--quantization", default="auto", choices=["auto", "int8", "int4", "none"],
                        help="weight-only quantization; auto keeps a GGUF's own where its kernel pays")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "blockdot"],
                        help="who runs quantized linears at few rows: auto takes nanoserve's blockdot unless the "
                             "start-up probe times torch's int4 kernel 1.3x faster")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the K/V cache's dtype; auto: float16 where quantized weights on blockdot compute in "
                             "float32 on a CPU, the model's dtype elsewhere; q8_0, q4_0: llama.cpp's blocks of 32 "
                             "(as its -ctk/-ctv), ~1.9x and ~3.6x float16's tokens in the same memory")
    add_batch_invariant(parser)
    parser.add_argument("--speculative-config", default=None, type=speculative_config, metavar="JSON",
                        help='speculative decoding, vLLM\'s spelling: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\' (default: off)')
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="split every layer over N processes this one starts (default 1; under torchrun, "
                             "its WORLD_SIZE: rank 0 serves HTTP, the others run the workers)")
    parser.add_argument("--tensor-parallel-timeout", type=float, default=60.0,
                        help="seconds a collective may wait on a worker before the step fails (a worker dead or hung)")
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY") or None,
                        help="require `Authorization: Bearer KEY` on /v1 and /tokenize, /detokenize "
                             "(default: $NANOSERVE_API_KEY; none when unset)")
    parser.add_argument("--max-waiting-requests", type=int, default=128,
                        help="a request finding this many already waiting for a slot gets a 503 with Retry-After "
                             "(0: no bound)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM; then they are aborted")
    parser.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                        help="chat completions return a reasoning model's <think> block as reasoning_content, "
                             "apart from content (vLLM's flag); structured outputs and tool-call grammars apply "
                             "after </think>")
    parser.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                        help="with --reasoning-parser: a chat completion's think block is ended (</think> forced) "
                             "after N tokens; -1: no limit, 0: ended at once (llama.cpp's flag; a request's "
                             "max_reasoning_tokens overrides it)")
    args = parser.parse_args(argv)
    from nanoserve.parallel.group import is_torchrun

    if is_torchrun():  # one rank of `torchrun --nproc-per-node N -m nanoserve serve ...`
        world_size = int(os.environ["WORLD_SIZE"])
        if args.tensor_parallel_size not in (None, world_size):
            parser.error(f"--tensor-parallel-size={args.tensor_parallel_size}, but torchrun started {world_size} ranks")
        args.tensor_parallel_size = world_size
        if int(os.environ["RANK"]) > 0:  # a worker: what to load and how comes from rank 0
            from nanoserve.parallel.worker import run_torchrun_worker

            sys.exit(run_torchrun_worker(args.tensor_parallel_timeout))
    tensor_parallel_size = 1 if args.tensor_parallel_size is None else args.tensor_parallel_size
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        parser.error(f"--max-waiting-requests={args.max_waiting_requests} must be >= 0 (0: no bound)")

    from nanoserve.config import EngineConfig, PlanOverrides
    from nanoserve.serving.server import serve
    from nanoserve.serving.server.guard import ServerConfig

    try:
        config = EngineConfig(
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
            overrides=PlanOverrides(kernels=args.kernels), kv_cache_dtype=args.kv_cache_dtype, device=args.device,
            seed=args.seed, batch_invariant=BATCH_INVARIANT[args.batch_invariant],
            speculative_config=args.speculative_config, tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_timeout_s=args.tensor_parallel_timeout,
            tensor_parallel_threads=args.num_threads if tensor_parallel_size > 1 else None,
        )
        server_config = ServerConfig(api_key=args.api_key, max_waiting_requests=args.max_waiting_requests or None,
                                     drain_timeout_s=args.drain_timeout, reasoning_parser=args.reasoning_parser,
                                     reasoning_budget=args.reasoning_budget)
    except ValueError as e:
        parser.error(str(e))
    if args.num_threads is not None:
        if args.num_threads < 1:
            parser.error(f"--num-threads={args.num_threads} must be >= 1")
        import torch

        torch.set_num_threads(args.num_threads)  # process start-up: the one place a torch global is set
    from nanoserve.engine import Engine

    try:  # a model file nanoserve refuses (malformed, or asking what it does not run): one line, status 2
        engine = Engine.from_pretrained(args.model, config)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"nanoserve serve: error: {str(e).splitlines()[0] if str(e) else repr(e)}\n")
    serve(args.model, args.host, args.port, config, args.served_model_name, args.log_level, server_config, engine)


BATCH_INVARIANT = {"auto": "auto", "true": True, "false": False}
KV_CACHE_DTYPES = ["auto", "float32", "bfloat16", "float16", "q8_0", "q4_0"]  # EngineConfig.kv_cache_dtype's


def speculative_config(text: str) -> dict:
    """--speculative-config's JSON object (checked by EngineConfig)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def add_batch_invariant(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", default="auto", choices=list(BATCH_INVARIANT),
                        help="a request's answer independent of the others running: auto takes the invariant plan "
                             "wherever the other choices allow it, true refuses to start without it, false takes "
                             "the fastest plan (EngineConfig.batch_invariant)")


def plan_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="nanoserve plan", description=COMMANDS["plan"])
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "int8", "int4", "none"])
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "blockdot"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    add_batch_invariant(parser)
    parser.add_argument("--speculative-config", default=None, type=speculative_config, metavar="JSON",
                        help="as serve's: with method draft_model the draft model's own plan is printed too")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the plan of N ranks (the workers are started to lay their shards out, then ended)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    from nanoserve.config import EngineConfig, PlanOverrides
    from nanoserve.engine import Engine

    if args.num_threads is not None:
        if args.num_threads < 1:
            parser.error(f"--num-threads={args.num_threads} must be >= 1")
        import torch

        torch.set_num_threads(args.num_threads)  # process start-up: the one place a torch global is set
    try:
        config = EngineConfig(dtype=args.dtype, quantization=None if args.quantization == "none" else args.quantization,
                              overrides=PlanOverrides(kernels=args.kernels), kv_cache_dtype=args.kv_cache_dtype,
                              num_kv_blocks=8, batch_invariant=BATCH_INVARIANT[args.batch_invariant],
                              speculative_config=args.speculative_config,
                              tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as e:
        parser.error(str(e))
    with Engine.from_pretrained(args.model, config) as engine:  # it lays the model out and holds it to the plan
        model = engine.model.config
        memory = engine.memory()
    print(f"nanoserve plan: {args.model or 'the embedded default model'} ({model.architecture}, {model.num_layers} "
          f"layers, hidden {model.hidden_size}, vocabulary {model.vocab_size})")
    print(engine.plan.render())
    print("weights: " + ", ".join(f"{kind} {size / 2**20:.1f} MiB" for kind, size in memory.items()
                                   if size and not kind.endswith("kv_cache")))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
        usage = "usage: nanoserve <command> [options]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"nanoserve: unknown command {argv[0]!r}\n{usage}")
        print(usage)
        return
    command, rest = argv[0], argv[1:]
    if command == "serve":
        serve_main(rest)
    elif command == "plan":
        plan_main(rest)
    elif command == "bench-serve":
        from nanoserve.serving.bench_serve import main as bench_main

        bench_main(rest)
    else:
        from nanoserve.serving.demo import main as demo_main

        demo_main(rest)
