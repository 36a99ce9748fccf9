"""Each rank's share of the CPU: its intra-op threads and, on a machine of several NUMA nodes, the
node it is pinned to.

N processes each running torch's default team (one thread per core) would put N threads on every
core, and an OpenMP team that shares its cores with another team waits for its slowest member. So
a rank takes its share: the CPUs this process may use, divided by N (or the configured count).
Where Linux reports several NUMA nodes, rank r is pinned to node r * nodes // N and takes that
node's share, so its weights and KV cache stay in the node's own memory (first touch allocates
where the thread runs). On one node nothing is pinned.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> set[int]:
    """Linux's cpulist format: "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(root: Path = NODES) -> list[set[int]]:
    """The CPUs of each NUMA node, in node order; [] where the kernel does not say."""
    files = sorted(root.glob("node[0-9]*/cpulist"), key=lambda f: int(f.parent.name.removeprefix("node")))
    return [parse_cpu_list(f.read_text()) for f in files]


def cpu_share(rank: int, world_size: int, allowed: set[int], nodes: list[set[int]],
              threads: int | None = None) -> tuple[set[int] | None, int]:
    """(the CPUs rank `rank` is pinned to, None when it is not; its intra-op thread count)."""
    usable = [node & allowed for node in nodes if node & allowed]
    if len(usable) > 1:
        index = rank * len(usable) // world_size
        sharing = sum(1 for r in range(world_size) if r * len(usable) // world_size == index)
        return usable[index], threads or max(1, len(usable[index]) // sharing)
    return None, threads or max(1, len(allowed) // world_size)


def take_share(rank: int, world_size: int, threads: int | None = None) -> tuple[set[int] | None, int]:
    """Applies cpu_share to this process (affinity, then torch's thread count) and returns it."""
    cpus, count = cpu_share(rank, world_size, os.sched_getaffinity(0), numa_nodes(), threads)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(count)
    return cpus, count
