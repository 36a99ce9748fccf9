"""Tensor-parallel shards: which slice of every weight each of N ranks holds, and the weight form
that completes a split matmul with an all-reduce.

The split is Megatron's, as vLLM, SGLang and gpt-fast make it:

- attention by heads: a rank holds whole key/value heads with the query heads that read them, so
  its q, k and v rows (and their biases) and o's matching columns; o's partial sums meet in one
  all-reduce. Ranks take ceil-first shares: 3 key/value heads on 2 ranks are 2 and 1 (the
  default model's 9 query heads are 6 and 3). When N exceeds Hkv, each key/value head is
  replicated on N / Hkv ranks that split its query heads, as vLLM does;
- the MLP by I: gate and up rows, down columns, one all-reduce; I is split in units of 32 columns
  (a quantization group) where it divides, so a quantized down matrix splits between groups;
- the head by vocabulary rows: each rank's logits [R, V / N] are gathered to rank 0
  (nanoserve.parallel), where the sampler runs.

The embedding, the norms, q/k's per-head norms and o's bias are whole on every rank: the embedding
[V, E] is the largest of them (28 M of the default model's 135 M parameters), and splitting it
would add one more all-reduce a step. Dimension names as in nanoserve.model.llama.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nanoserve.model.config import PHI3, LlamaConfig
from nanoserve.model.forms import Form, Regroup, Weight
from nanoserve.model.gguf import BLOCK
from nanoserve.model.llama import LlamaModel

Range = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world_size` holds, as index ranges of the whole model's dimensions."""

    rank: int
    world_size: int
    q_heads: Range  # of H
    kv_heads: Range  # of Hkv
    mlp: Range  # of I
    vocab: Range  # of V, the head's rows


def _share(n: int, world_size: int, rank: int, unit: int = 1) -> Range:
    """Rank `rank`'s ceil-first share of n items in whole units: 3 units on 2 ranks are 2 and 1."""
    units = n // unit
    return -(-rank * units // world_size) * unit, -(-(rank + 1) * units // world_size) * unit


def shard_of(config: LlamaConfig, rank: int, world_size: int) -> Shard:
    """The slices rank `rank` holds.

    Raises:
        ValueError: when N exceeds H, exceeds Hkv without being a multiple of it, or exceeds the
            MLP's or the vocabulary's units, naming the numbers; for a checkpoint whose q/k/v and
            gate/up are fused (Phi-3), which the slices do not cut apart; N > 1 for a mixture of experts.
    """
    H, Hkv, I, V = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    N = world_size
    if config.architecture == PHI3 and N > 1:
        raise ValueError(f"tensor_parallel_size={N}: {PHI3}'s checkpoints hold q/k/v and gate/up fused (qkv_proj, "
                         "gate_up_proj), which nanoserve's tensor-parallel slices do not cut apart; serve it on one rank")
    if not 0 <= rank < N:
        raise ValueError(f"rank={rank} is outside 0 .. {N - 1}")
    if N > 1 and config.is_moe:
        raise ValueError(f"tensor_parallel_size={N} with a mixture-of-experts model ({config.architecture}): nanoserve "
                         "does not cut experts across ranks; use 1")
    if N > H:
        raise ValueError(f"tensor_parallel_size={N} exceeds the model's {H} attention heads")
    group = H // Hkv  # query heads per key/value head
    if Hkv >= N:
        kv = _share(Hkv, N, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        if N % Hkv:
            raise ValueError(f"tensor_parallel_size={N} exceeds num_key_value_heads={Hkv} without being a multiple "
                             f"of it: each key/value head must be replicated on a whole number of ranks")
        replicas = N // Hkv
        head = rank // replicas
        kv = (head, head + 1)
        first, end = _share(group, replicas, rank % replicas)
        q = (head * group + first, head * group + end)
    unit = BLOCK if I % BLOCK == 0 else 1
    if I // unit < N:
        raise ValueError(f"tensor_parallel_size={N} exceeds intermediate_size={I} in units of {unit}")
    return Shard(rank, N, q, kv, _share(I, N, rank, unit), _share(V, N, rank))


def local_config(config: LlamaConfig, shard: Shard) -> LlamaConfig:
    """The config of one rank's model: its heads and MLP width; the vocabulary stays whole, as the
    embedding is and as the gathered logits are."""
    (q0, q1), (k0, k1), (i0, i1) = shard.q_heads, shard.kv_heads, shard.mlp
    return dataclasses.replace(config, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0)


def slice_of(name: str, config: LlamaConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, end): the part of Hugging Face tensor `name` the rank reads; None: all of it."""
    D = config.head_dim
    module, _, kind = name.rpartition(".")
    proj = module.rpartition(".")[2]
    (q0, q1), (k0, k1), (i0, i1) = shard.q_heads, shard.kv_heads, shard.mlp
    if proj == "q_proj":
        return 0, q0 * D, q1 * D  # weight rows, or the bias
    if proj in ("k_proj", "v_proj"):
        return 0, k0 * D, k1 * D
    if proj in ("gate_proj", "up_proj"):
        return 0, i0, i1
    if kind == "weight" and proj == "o_proj":
        return 1, q0 * D, q1 * D
    if kind == "weight" and proj == "down_proj":
        return 1, i0, i1
    if name == "lm_head.weight":
        return 0, *shard.vocab
    return None


class CollectiveError(RuntimeError):
    """A collective of the tensor-parallel group failed (a peer died, hung past the timeout, or broke)."""


@dataclass
class CollectiveStats:
    """What one rank's collectives cost, counted as they run (benchmarks/tpbench.py reads them).
    Seconds are host time inside the call: gloo returns when the result is home."""

    num_all_reduces: int = 0
    all_reduce_bytes: int = 0  # of the tensors this rank contributed
    all_reduce_s: float = 0.0
    num_gathers: int = 0  # the logits' gather to rank 0, one a step
    gather_bytes: int = 0
    gather_s: float = 0.0
    num_plans: int = 0  # step plans broadcast by rank 0 (counted there)
    plan_bytes: int = 0
    plan_s: float = 0.0


@dataclass
class AllReduced:
    """A row-parallel matrix: this rank's columns [N, K_r] of a weight [N, K]. x [M, K_r] times it
    is a partial sum over K; the all-reduce over the group completes it. Each partial comes out of
    its matmul in the model's dtype; the partials are added in float32 and the sum is rounded to
    the dtype once (gloo sums bf16 too, but a bf16 sum would round at every addition)."""

    inner: Weight  # [N, K_r], in any form
    group: Any  # a torch.distributed ProcessGroup
    stats: CollectiveStats
    # The batch-invariant plan's sum: every rank's partial gathered and added in rank order, the same
    # additions whatever the step's width. An all-reduce over three or more ranks adds an element in
    # the order of the ring segment it falls in, which moves with the tensor's size (over two it is
    # one commutative addition either way).
    in_rank_order: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.inner.shape)

    @property
    def form(self) -> Form:
        return dataclasses.replace(self.inner.form, all_reduced=True, in_rank_order=self.in_rank_order)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.dequantize(dtype)  # this rank's columns

    def nbytes_by_kind(self) -> dict[str, int]:
        return self.inner.nbytes_by_kind()

    def c_form(self, regroup: Regroup) -> None:
        return None  # the one call has no collective: a rank runs three C calls a layer, or decoder_layer

    def with_inner(self, inner: Weight, in_rank_order: bool = False) -> AllReduced:
        return AllReduced(inner, self.group, self.stats, in_rank_order)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x).float()  # [M, N] partial
        start = time.perf_counter()
        try:
            if self.in_rank_order:
                parts = [torch.empty_like(out) for _ in range(self.group.size())]
                self.group.allgather([parts], [out]).wait()
                out = parts[0]
                for part in parts[1:]:
                    out += part
            else:
                self.group.allreduce([out], dist.AllreduceOptions()).wait()
        except RuntimeError as e:
            raise CollectiveError(f"all-reduce of {list(out.shape)} float32 failed: {e}") from e
        self.stats.all_reduce_s += time.perf_counter() - start
        self.stats.num_all_reduces += 1
        self.stats.all_reduce_bytes += out.nbytes
        return out.to(x.dtype)  # [M, N]


def shard_model(config: LlamaConfig, tensors: Mapping[str, Any], shard: Shard, group: Any, stats: CollectiveStats,
                dtype: torch.dtype, device: torch.device | str, max_positions: int | None = None,
                model_class: type[LlamaModel] = LlamaModel) -> LlamaModel:
    """One rank's model from its slices (Hugging Face names, cut by slice_of): a `model_class` over
    the local config whose o and down run AllReduced over `group` (counted in `stats`), and whose
    head is its rows of the vocabulary, so its forward returns logits [R, V_r].

    Raises:
        ValueError: LlamaModel.from_state_dict's, for a slice of the wrong shape.
    """
    local = local_config(config, shard)
    tensors = dict(tensors)
    head = tensors.pop("lm_head.weight", None)
    # from_state_dict reads a head [V, E]; this rank's is [V_r, E], attached apart below.
    built = LlamaModel.from_state_dict(dataclasses.replace(local, tie_word_embeddings=True), tensors, dtype, device,
                                       max_positions)
    v0, v1 = shard.vocab
    if head is None:  # tied: the head is the embedding's rows
        embed = built.embed
        head = embed[v0:v1] if isinstance(embed, torch.Tensor) else embed.rows(torch.arange(v0, v1))
    elif isinstance(head, torch.Tensor):
        head = head.to(device=device, dtype=dtype)
    if tuple(head.shape) != (v1 - v0, config.hidden_size):
        raise ValueError(f"rank {shard.rank}'s head slice has shape {list(head.shape)}, expected {[v1 - v0, config.hidden_size]}")
    layers = [dataclasses.replace(layer, o=AllReduced(layer.o, group, stats), down=AllReduced(layer.down, group, stats))
              for layer in built.layers]
    return model_class(local, built.embed, layers, built.norm, head, max_positions, dtype)


def vocab_ranges(vocab_size: int, world_size: int) -> list[Range]:
    """Each rank's rows of the vocabulary, in rank order (Shard.vocab of each)."""
    return [_share(vocab_size, world_size, rank) for rank in range(world_size)]

