"""Paged attention: write new K/V through the slot mapping, read the context through slot tables.

Shapes: T tokens forwarded this step (all sequences flattened), B sequences, Tq one sequence's
new tokens, L a context, H query heads, Hkv key/value heads, D head dim.

A step's sequences are attended in groups so that nothing is padded to a length it does not have:
decoding sequences (one query each) batched together, split by context length when that saves
enough; each sequence that forwards several tokens (a prompt or a chunk of one) alone.

A sliding window (a query at position p sees keys p - W + 1 .. p) is a second set of groups and
runs for the same step, AttentionMetadata.windowed, built by build_inputs: their block tables start
at the first block the window reaches and their masks cut what lies before it, so a windowed layer
reads at most W + block_size keys a query. Blocks wholly behind every window stay allocated (the
allocator knows nothing of windows); the mask is what enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.model import kv_quant


@dataclass
class DecodeGroup:
    """Decoding sequences of similar length, attended together so short ones are not padded to long."""

    rows: torch.Tensor | None  # [Bg] int64: the rows of T holding their one query each; None: all of T, in order
    block_table: torch.Tensor  # [Bg, nb_g] int64
    mask: torch.Tensor | None  # [Bg, 1, 1, nb_g * bs] bool, True = may attend; None when nothing needs masking


@dataclass
class PrefillRun:
    """One sequence forwarding Tq > 1 tokens: rows first_row .. first_row + Tq of T."""

    first_row: int
    num_rows: int  # Tq
    block_table: torch.Tensor | None  # [1, nb]; None: nothing cached, attend to the new tokens only
    # [1, 1, Tq, nb * bs] bool, True = may attend: query i sees keys up to its own position (and within
    # the window); [1, 1, Tq, Tq] over the new tokens when block_table is None; None: causal, no mask
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Built once per step by build_inputs and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    decode_groups: list[DecodeGroup]  # sequences with one query this step
    prefill_runs: list[PrefillRun]  # sequences forwarding several tokens, each attended alone
    block_size: int = 16  # tokens per block
    sliding_window: int | None = None  # W the windowed groups and runs were built for; None: not built
    # The same step for layers with a sliding window (its own groups and runs, this slot_mapping);
    # None when no context in the step is longer than W, so the groups above serve those layers too.
    windowed: AttentionMetadata | None = None
    # Each sequence's whole block table [S, nb] (zero-padded) and each row's sequence [T]: what
    # fused_decode.c reads, every row a query over its own context through the cache.
    block_tables: torch.Tensor | None = None
    row_seqs: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D], caches [slots, Hkv, D] -> [T, H, D].

    The new K/V are written before the read, so a token attends to itself and to the tokens
    forwarded with it in this step exactly as it will to cached ones in later steps. Scores q . k
    are multiplied by `scale` (None: D ** -0.5) and, with `softcap` c, become c tanh(scores / c).
    A cache in another dtype than q's (EngineConfig.kv_cache_dtype) is written rounded to its own
    and read back in q's; a prompt with nothing cached attends to its K/V as computed. A cache of
    llama.cpp's blocks (uint8, nanoserve.model.kv_quant) is written quantized and read dequantized,
    and there a prompt with nothing cached attends to its K/V as the cache holds them, as every later
    read and fused_decode.c's attention do; q, k and v are turned by kv_quant's Walsh-Hadamard
    rotations first where it has them, and the output turned back.
    """
    kind = kv_quant.kind_of(k_cache, k.shape[-1])
    rotations = None if kind is None else kv_quant.rotations(k.shape[-1])
    if kind is None:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    else:
        if rotations is not None:
            n_qk, n_v = rotations
            q, k, v = kv_quant.rotate(q, n_qk), kv_quant.rotate(k.float(), n_qk), kv_quant.rotate(v.float(), n_v)
        k_blocks, v_blocks = kv_quant.quantize(k, kind), kv_quant.quantize(v, kind)  # [T, Hkv, W] each
        k_cache.index_copy_(0, meta.slot_mapping, k_blocks)
        v_cache.index_copy_(0, meta.slot_mapping, v_blocks)
        k, v = kv_quant.dequantize(k_blocks, kind, q.dtype), kv_quant.dequantize(v_blocks, kind, q.dtype)
    out = _attend_groups(q, k, v, k_cache, v_cache, meta, scale, softcap)  # [T, H, D]
    return out if rotations is None else kv_quant.rotate(out, rotations[1])


def _attend_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float | None, softcap: float | None) -> torch.Tensor:
    """paged_attention's read, the new K/V already in the cache: q [T, H, D], k and v [T, Hkv, D] in q's dtype -> [T, H, D]."""
    groups = meta.decode_groups
    if len(groups) == 1 and groups[0].rows is None:  # a decode step in one group: T == B, no scatter
        return _decode(q, k_cache, v_cache, groups[0], meta.block_size, scale, softcap)
    out = torch.empty_like(q)  # [T, H, D]
    for group in groups:
        queries = q.index_select(0, group.rows)  # [Bg, H, D]
        out.index_copy_(0, group.rows, _decode(queries, k_cache, v_cache, group, meta.block_size, scale, softcap))
    for run in meta.prefill_runs:
        rows = slice(run.first_row, run.first_row + run.num_rows)
        queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if run.block_table is None:  # nothing cached: the new tokens are the whole context
            keys, values = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        else:
            keys = _gather_blocks(k_cache, run.block_table, meta.block_size, q.dtype, q.shape[-1])  # [1, Hkv, L, D]
            values = _gather_blocks(v_cache, run.block_table, meta.block_size, q.dtype, q.shape[-1])
        is_causal = run.block_table is None and run.mask is None
        result = _attend(queries, keys, values, run.mask, is_causal, scale, softcap)  # [1, H, Tq, D]
        out[rows] = result[0].transpose(0, 1)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            block_size: int, scale: float | None, softcap: float | None) -> torch.Tensor:
    """One query per sequence: q [Bg, H, D] -> [Bg, H, D]."""
    # The context is read whole blocks at a time: one row of bs * Hkv * D per block is a plain
    # memcpy, 1.5-2x faster than indexing token by token on this machine.
    keys = _gather_blocks(k_cache, group.block_table, block_size, q.dtype, q.shape[-1])  # [Bg, Hkv, Lg, D]
    values = _gather_blocks(v_cache, group.block_table, block_size, q.dtype, q.shape[-1])
    return _attend(q.unsqueeze(2), keys, values, group.mask, False, scale, softcap).squeeze(2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
            scale: float | None, softcap: float | None) -> torch.Tensor:
    """q [B, H, Tq, D], k and v [B, Hkv, L, D], mask [B, 1, Tq, L] bool (True = may attend) -> [B, H, Tq, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    # SDPA has no hook between the scores and the softmax, so capped scores are computed explicitly.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, L, D]
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)  # [B, H, Tq, L]
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:  # Tq == L: nothing cached
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()  # [Tq, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [B, H, Tq, D]


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, dtype: torch.dtype,
                   head_dim: int) -> torch.Tensor:
    """cache [slots, Hkv, D] (or [slots, Hkv, W] of kv_quant's blocks), block_table [B, nb]
    -> [B, Hkv, nb * block_size, D] in dtype (a copy)."""
    B = block_table.shape[0]
    slots, Hkv, W = cache.shape
    blocks = cache.view(slots // block_size, block_size * Hkv * W)  # [num_blocks, bs Hkv W]
    rows = blocks.index_select(0, block_table.flatten()).view(B, -1, Hkv, W)  # [B, L, Hkv, W]
    kind = kv_quant.kind_of(cache, head_dim)
    rows = rows.to(dtype) if kind is None else kv_quant.dequantize(rows, kind, dtype)  # [B, L, Hkv, D]
    return rows.transpose(1, 2)
