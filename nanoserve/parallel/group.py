"""The ranks of one tensor-parallel engine: how they meet, what they say, and how they end.

Rendezvous is a torch.distributed store: rank 0 hosts a TCPStore and starts ranks 1 .. N-1 as
`python -m nanoserve.parallel.worker` processes (one machine), or every rank reads torchrun's
env:// variables (several machines). Start-up messages (what to load, the precision to lay it out
in, how many KV blocks) and each rank's report go through the store as JSON; rank 0 waits for the
reports while it watches its worker processes, so a worker that fails to start is named with its
error or exit code rather than timing out.

Two process groups, built on the store: `data` (gloo on a CPU, NCCL on CUDA) carries the
all-reduces and the logits' gather, each bounded by `timeout_s`; `control` (gloo) carries each
step's plan. A worker waits for its next plan on `control` for as long as the server idles, so
that group's own timeout is unbounded; rank 0 sends on it and waits at most `timeout_s`, and a
broadcast's root returns only once every worker has taken the plan, so it never overwrites one a
worker has not read. A dead worker breaks the next collective at once (its sockets close); a hung
one makes it time out; either way the step raises WorkerFailure naming what happened.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanoserve.model.shard import CollectiveError, CollectiveStats

STEP, STOP = 1, 2  # what a frame on the control group announces
FOREVER = datetime.timedelta(days=365)  # a worker's wait for its next plan: the server may idle for days
START_TIMEOUT_S = 600.0  # loading and laying out a shard, while every worker process is alive
PREFIX = "nanoserve/"  # store keys, apart from torchrun's own


class WorkerFailure(RuntimeError):
    """A tensor-parallel collective failed: a worker died or hung. The engine cannot go on."""


@dataclass
class TensorParallelGroup:
    """One rank's view of the group. Rank 0 also holds the worker processes it started."""

    rank: int
    world_size: int
    store: Any  # a torch.distributed Store, every key under PREFIX
    timeout_s: float
    device: torch.device
    processes: list[subprocess.Popen] = field(default_factory=list)  # ranks 1 .. N-1, when rank 0 started them
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    data: Any = None  # ProcessGroup: all-reduces, the logits' gather
    control: Any = None  # ProcessGroupGloo: the per-step plans
    failure: str | None = None  # why the group broke; set once, every later step raises it
    is_running: bool = False  # the workers are in their step loop
    is_closed: bool = False
    # Rank 0: the thread count and CPU affinity this process had before taking its share, put back at close.
    restore: tuple[int, set[int]] | None = None

    def __post_init__(self) -> None:
        # No worker outlives the engine, even one never closed: at exit, or once the group is garbage.
        self._finalizer = weakref.finalize(self, end_processes, self.processes)

    # ---- start-up ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Builds the two process groups (every rank calls this; it returns once all have)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore(PREFIX + "groups/", self.store)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), self.rank, self.world_size, FOREVER)
        if self.device.type == "cuda":  # NCCL path: written for a GPU node, not run here (no GPU)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), self.rank, self.world_size, options)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), self.rank, self.world_size, timeout)

    def publish(self, key: str, message: dict[str, Any]) -> None:
        self.store.set(PREFIX + key, json.dumps(message))

    def read(self, key: str) -> dict[str, Any]:
        """A message another rank published (waits for it)."""
        return json.loads(self.store.get(PREFIX + key))

    def report(self, phase: str, error: str | None = None) -> None:
        """This rank's outcome of a start-up phase, for rank 0."""
        self.publish(f"{phase}/{self.rank}", {"error": error})

    def await_reports(self, phase: str) -> None:
        """Rank 0: waits until every worker reported `phase`, watching the processes it started.

        Raises:
            WorkerFailure: naming the worker that reported an error or exited, or the wait's limit.
        """
        keys = [f"{PREFIX}{phase}/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + max(START_TIMEOUT_S, self.timeout_s)
        while not self.store.check(keys):
            exited = self.exited()
            if exited:
                raise WorkerFailure(f"tensor-parallel start-up ({phase}): {exited}")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"tensor-parallel start-up ({phase}): no report from every worker "
                                    f"within {max(START_TIMEOUT_S, self.timeout_s):.0f} s")
            time.sleep(0.02)
        for rank in range(1, self.world_size):
            error = self.read(f"{phase}/{rank}")["error"]
            if error is not None:
                raise WorkerFailure(f"tensor-parallel rank {rank} failed at {phase}:\n{error}")

    # ---- each step ---------------------------------------------------------------------------

    def send_plan(self, plan: torch.Tensor) -> None:
        """Rank 0: one step's plan (uint8 [bytes], nanoserve.parallel.plan) to every worker."""
        start = time.perf_counter()
        self.send_frame(STEP, plan)
        self.stats.plan_s += time.perf_counter() - start
        self.stats.num_plans += 1
        self.stats.plan_bytes += plan.numel()

    def send_frame(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: a frame to every worker, on the control group: [kind, bytes], then the bytes.

        Raises:
            CollectiveError: a worker did not take it within timeout_s, or is gone.
        """
        sizes = torch.tensor([kind, 0 if payload is None else payload.numel()], dtype=torch.int64)
        try:
            self._wait(self.control.broadcast([sizes], _root()))
            if payload is not None:
                self._wait(self.control.broadcast([payload], _root()))
        except RuntimeError as e:
            raise CollectiveError(f"broadcast of a step's plan failed: {e}") from e

    def recv_frame(self) -> tuple[int, torch.Tensor | None]:
        """A worker: the next frame, however long rank 0 idles first.

        Raises:
            CollectiveError: rank 0 is gone.
        """
        sizes = torch.empty(2, dtype=torch.int64)
        try:
            self.control.broadcast([sizes], _root()).wait()
            kind, num_bytes = sizes.tolist()
            if kind == STOP:
                return kind, None
            payload = torch.empty(num_bytes, dtype=torch.uint8)
            self.control.broadcast([payload], _root()).wait()
        except RuntimeError as e:
            raise CollectiveError(f"receiving a step's plan failed: {e}") from e
        return kind, payload

    def _wait(self, work: Any) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout_s))

    def gather_logits(self, logits: torch.Tensor, vocab_ranges: list[tuple[int, int]]) -> torch.Tensor | None:
        """Every rank's logits [R, V_r] to rank 0 as [R, V]; None on the other ranks. Ranks hold
        ceil-first shares, so rank 0's is the widest and the others pad to it for the gather."""
        width = vocab_ranges[0][1] - vocab_ranges[0][0]
        mine = logits.float()
        if mine.shape[1] < width:
            mine = torch.nn.functional.pad(mine, (0, width - mine.shape[1]))  # [R, V_0]
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(mine) for _ in range(self.world_size)]] if self.rank == 0 else []
        start = time.perf_counter()
        try:
            self.data.gather(outputs, [mine.contiguous()], options).wait()
        except RuntimeError as e:
            raise CollectiveError(f"gather of the logits failed: {e}") from e
        self.stats.gather_s += time.perf_counter() - start
        self.stats.num_gathers += 1
        self.stats.gather_bytes += mine.nbytes
        if self.rank != 0:
            return None
        return torch.cat([part[:, :end - start] for part, (start, end) in zip(outputs[0], vocab_ranges, strict=True)],
                         dim=1)  # [R, V]

    # ---- failure and the end -------------------------------------------------------------------

    def exited(self) -> str | None:
        """Which worker processes have exited, and how; None while all run (or none are ours)."""
        gone = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
        if not gone:
            return None
        return "; ".join(f"worker rank {rank} (pid {p.pid}) exited with "
                         f"{f'signal {-p.returncode}' if p.returncode < 0 else f'code {p.returncode}'}"
                         for rank, p in gone)

    def broke(self, error: BaseException) -> WorkerFailure:
        """Records why the group broke and returns the error a step raises."""
        if self.failure is None:
            time.sleep(0.1)  # a killed worker's exit status lands a moment after its sockets close
            if not isinstance(error, CollectiveError):
                cause = "rank 0's own forward raised while the workers were inside the step's collectives"
            else:
                cause = self.exited() or (f"no worker process has exited: a collective waited past the "
                                          f"{self.timeout_s:g} s timeout, or failed (a worker hung, or its peer broke)")
            self.failure = f"tensor-parallel step failed: {cause}. ({type(error).__name__}: {str(error)[:300]})"
        return WorkerFailure(self.failure)

    def close(self) -> None:
        """Rank 0: stops the workers and waits for their processes; the ones that do not end in
        time are killed. Idempotent."""
        if self.is_closed:
            return
        self.is_closed = True
        broken = self.failure is not None  # a worker gone or hung: nothing to say to the others
        try:
            if self.is_running and not broken:
                self.send_frame(STOP)
            elif not broken:
                self.publish("layout", {"stop": True})  # workers still starting up read this next
        except Exception:
            broken = True
        # Workers that took STOP exit on their own; the others are ended.
        end_processes(self.processes, 0.0 if broken else min(self.timeout_s, 10.0), kill=broken)
        self._finalizer.detach()
        self.data = self.control = None
        if self.restore is not None:
            threads, cpus = self.restore
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, cpus)


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def end_processes(processes: list[subprocess.Popen], wait_s: float = 0.0, kill: bool = False) -> None:
    """Waits up to wait_s in all for the processes to exit; terminates the rest (kills them, with
    `kill`), and kills any still there 5 s later (a stopped process does not act on SIGTERM)."""
    deadline = time.monotonic() + wait_s
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill() if kill else p.terminate()
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- how the ranks meet ------------------------------------------------------------------------

ENV_STORE, ENV_RANK, ENV_WORLD_SIZE, ENV_PARENT, ENV_TIMEOUT = (
    "NANOSERVE_TP_STORE", "NANOSERVE_TP_RANK", "NANOSERVE_TP_WORLD_SIZE", "NANOSERVE_TP_PARENT", "NANOSERVE_TP_TIMEOUT_S")


def launch(world_size: int, timeout_s: float, device: torch.device) -> TensorParallelGroup:
    """Rank 0 on one machine: hosts the store and starts ranks 1 .. N-1 as worker processes."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=FOREVER, wait_for_workers=False)
    env = os.environ | {ENV_STORE: f"127.0.0.1:{store.port}", ENV_WORLD_SIZE: str(world_size),
                        ENV_PARENT: str(os.getpid()), ENV_TIMEOUT: repr(timeout_s)}
    root = Path(__file__).resolve().parents[2]  # the checkout, so a worker imports this same nanoserve
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    processes = [subprocess.Popen([sys.executable, "-m", "nanoserve.parallel.worker"], env=env | {ENV_RANK: str(rank)},
                                  stdin=subprocess.DEVNULL)
                 for rank in range(1, world_size)]
    return TensorParallelGroup(0, world_size, store, timeout_s, device, processes)


def join_launched() -> TensorParallelGroup:
    """A worker started by `launch`: joins the store its environment names."""
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    world_size = int(os.environ[ENV_WORLD_SIZE])
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=FOREVER)
    return TensorParallelGroup(int(os.environ[ENV_RANK]), world_size, store, float(os.environ[ENV_TIMEOUT]),
                               torch.device("cpu"))


def is_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (env://) launch of more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def join_torchrun(timeout_s: float, device: torch.device) -> TensorParallelGroup:
    """Any rank under torchrun: the env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=FOREVER))
    return TensorParallelGroup(rank, world_size, store, timeout_s, device)
