"""Paged attention: write new K/V through the slot mapping, read the context through slot tables.

Shapes: T tokens forwarded this step (all sequences flattened), B sequences, Tq the longest
query run of one sequence, L the longest context, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Built once per step by build_inputs and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    kv_slots: torch.Tensor  # [B, L] int64: cache slot of each context position (0 past the end)
    mask: torch.Tensor | None  # [B, 1, Tq, L] bool, True = may attend; None = no masking needed
    query_index: torch.Tensor | None  # [B, Tq] int64 rows of T per sequence; None when every Tq is 1
    query_valid: torch.Tensor | None  # [B, Tq] bool, False on padding; None when every Tq is 1
    is_causal: bool = False  # one sequence, whole context new: plain causal attention


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D], caches [slots, Hkv, D] -> [T, H, D].

    The new K/V are written before the read, so a token attends to itself and to the tokens
    forwarded with it in this step exactly as it will to cached ones in later steps.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.is_causal:  # one sequence, nothing cached: no gather, no mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )  # [H, T, D]
        return out.transpose(0, 1)  # [T, H, D]
    keys = k_cache[meta.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[meta.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
    if meta.query_index is None:  # decode: one query per sequence, T == B
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.mask, enable_gqa=True)
        return out.squeeze(2)  # [B, H, D]
    queries = q[meta.query_index].transpose(1, 2)  # [B, H, Tq, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, enable_gqa=True)
    return out.transpose(1, 2)[meta.query_valid]  # [T, H, D]
