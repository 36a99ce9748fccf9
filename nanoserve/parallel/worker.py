"""Ranks 1 .. N-1 of a tensor-parallel engine: `python -m nanoserve.parallel.worker`, started by
rank 0 (nanoserve.parallel.group.launch), or `nanoserve serve` under torchrun on a rank above 0.

A worker holds its shard and its KV cache and nothing else: it reads what rank 0 publishes (what
to load, then how to lay it out and how many KV blocks), reports each phase, and then loops:
receive a step's plan, forward its shard (meeting the others in every all-reduce), send its
logits to rank 0, until rank 0 says stop. It ends when rank 0 does: a STOP frame, rank 0's
sockets closing under a collective, or (for a worker rank 0 started) its parent process gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

from nanoserve.model.llama import LlamaModel
from nanoserve.model.shard import CollectiveError, vocab_ranges
from nanoserve.parallel.cpus import take_share
from nanoserve.parallel.group import ENV_PARENT, STOP, TensorParallelGroup, join_launched, join_torchrun
from nanoserve.parallel.plan import decode
from nanoserve.parallel.rank import lay_out_rank, load_rank

logger = logging.getLogger("nanoserve")


def run_worker(group: TensorParallelGroup) -> int:
    """Serves rank 0's steps until it says stop; returns the process's exit code."""
    spec = group.read("spec")
    group.device = torch.device(spec["device"])
    if group.device.type == "cuda":  # one GPU a rank: the NCCL path, written for a GPU node, not run here
        group.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", group.rank)))
        torch.cuda.set_device(group.device)
    cpus, threads = take_share(group.rank, group.world_size, spec["threads"])
    logger.info("nanoserve tensor-parallel rank %d: %d threads%s", group.rank, threads,
                f", pinned to CPUs {sorted(cpus)}" if cpus else "")
    group.report("joined")
    group.connect()
    try:
        model = load_rank(group, spec)
    except Exception:
        group.report("loaded", traceback.format_exc())
        return 1
    group.report("loaded")
    layout = group.read("layout")
    if layout.get("stop"):  # rank 0 failed to start
        return 0
    try:
        model, kv = lay_out_rank(model, layout, group.device)
    except Exception:
        group.report("ready", traceback.format_exc())
        return 1
    group.report("ready")
    group.is_running = True
    ranges = vocab_ranges(model.config.vocab_size, group.world_size)
    with torch.inference_mode():
        while True:
            try:
                kind, payload = group.recv_frame()
                if kind == STOP:
                    return 0
                logits = LlamaModel.forward(model, decode(payload, group.device), kv)  # [R, V_r]
                group.gather_logits(logits, ranges)
            except CollectiveError as e:  # rank 0 or another worker is gone: nothing left to serve
                print(f"nanoserve tensor-parallel rank {group.rank}: {e}", file=sys.stderr)
                return 1


def run_torchrun_worker(timeout_s: float) -> int:
    """A rank above 0 of `torchrun ... nanoserve serve`: joins the env:// rendezvous and serves rank
    0's steps. What to load and how comes from rank 0, so the other arguments are rank 0's affair."""
    return run_worker(join_torchrun(timeout_s, torch.device("cpu")))


def _exit_with_parent(parent: int) -> None:
    """A worker rank 0 started ends when that process does, whatever it is doing then."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    # Ctrl-C reaches the terminal's whole process group: rank 0 handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(int(os.environ[ENV_PARENT]),), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    sys.exit(run_worker(join_launched()))


if __name__ == "__main__":
    main()
