"""model/attention.py's paged attention against transformers' eager attention (repeat_kv, an
additive causal mask, softmax in float32) over each sequence's whole context, laid out contiguously.

The metadata is written by hand here (slots = block_id * block_size + offset, masks True where a
query may look), so these tests hold the attention to its contract, not to build_inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from nanoserve.model.attention import AttentionMetadata, DecodeGroup, PrefillRun, paged_attention

H, HKV, D = 4, 2, 8  # query heads, key/value heads (2 queries share each), head dim
BS = 4  # block size
NUM_BLOCKS = 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence: q [Tq, H, D] at its last Tq positions, k and v [L, Hkv, D] -> [Tq, H, D]."""
    Tq, L = q.shape[0], k.shape[0]
    start = L - Tq
    allowed = torch.arange(L)[None, :] <= torch.arange(start, L)[:, None]  # [Tq, L]
    mask = torch.zeros(Tq, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=H // HKV, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask[None, None], scaling=D**-0.5)
    return out[0]  # [Tq, H, D]


class Sequence:
    """One sequence's random q/k/v for every position and the blocks its K/V live in."""

    def __init__(self, length: int, blocks: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, H, D, generator=gen)
        self.k = torch.randn(length, HKV, D, generator=gen)
        self.v = torch.randn(length, HKV, D, generator=gen)
        self.blocks = blocks

    def slots(self, start: int, end: int) -> list[int]:
        return [self.blocks[p // BS] * BS + p % BS for p in range(start, end)]

    def cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, end: int) -> None:
        """Writes positions 0 .. end - 1 as an earlier step would have."""
        slots = torch.tensor(self.slots(0, end))
        k_cache[slots], v_cache[slots] = self.k[:end], self.v[:end]


def empty_caches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(NUM_BLOCKS * BS, HKV, D), torch.zeros(NUM_BLOCKS * BS, HKV, D)


def test_slot_arithmetic_of_the_helper_by_hand():
    seq = Sequence(7, [5, 2], seed=0)
    assert seq.slots(0, 7) == [20, 21, 22, 23, 8, 9, 10]


def test_prefill_without_cache_is_causal_and_writes_every_slot():
    seq = Sequence(6, [3, 1], seed=1)
    k_cache, v_cache = empty_caches()
    meta = AttentionMetadata(torch.tensor(seq.slots(0, 6)), [], [PrefillRun(0, 6, None, None)], BS)
    out = paged_attention(seq.q, seq.k, seq.v, k_cache, v_cache, meta)
    torch.testing.assert_close(out, reference(seq.q, seq.k, seq.v), rtol=1e-5, atol=1e-5)
    # Slots 12..15 then 4, 5 (block 3 then block 1) hold the new K/V; nothing else was touched.
    written = [12, 13, 14, 15, 4, 5]
    assert torch.equal(k_cache[written], seq.k) and torch.equal(v_cache[written], seq.v)
    untouched = [s for s in range(NUM_BLOCKS * BS) if s not in written]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_prefill_chunk_attends_to_its_cached_prefix():
    # 5 positions cached in blocks 6 and 0; a chunk of 3 (positions 5, 6, 7) completes block 0.
    seq = Sequence(8, [6, 0], seed=2)
    k_cache, v_cache = empty_caches()
    seq.cache(k_cache, v_cache, 5)
    L = 8
    mask = (torch.arange(2 * BS)[None, :] <= torch.arange(5, L)[:, None])[None, None]  # [1, 1, 3, 8]
    run = PrefillRun(0, 3, torch.tensor([seq.blocks]), mask)
    meta = AttentionMetadata(torch.tensor(seq.slots(5, L)), [], [run], BS)
    assert meta.slot_mapping.tolist() == [1, 2, 3]
    out = paged_attention(seq.q[5:], seq.k[5:], seq.v[5:], k_cache, v_cache, meta)
    torch.testing.assert_close(out, reference(seq.q[5:], seq.k, seq.v), rtol=1e-5, atol=1e-5)


def test_decode_group_masks_each_sequence_to_its_own_length():
    # Two sequences decode one token each: a has 7 positions (blocks 5, 2), b has 3 (block 7).
    a, b = Sequence(7, [5, 2], seed=3), Sequence(3, [7], seed=4)
    k_cache, v_cache = empty_caches()
    a.cache(k_cache, v_cache, 6)
    b.cache(k_cache, v_cache, 2)
    # b's table is padded with block 0 (zeros) and its keys past position 2 masked off.
    table = torch.tensor([[5, 2], [7, 0]])
    mask = (torch.arange(2 * BS)[None, :] < torch.tensor([7, 3])[:, None])[:, None, None, :]  # [2, 1, 1, 8]
    meta = AttentionMetadata(torch.tensor(a.slots(6, 7) + b.slots(2, 3)), [DecodeGroup(None, table, mask)], [], BS)
    assert meta.slot_mapping.tolist() == [10, 30]
    q = torch.stack([a.q[6], b.q[2]])  # [T=2, H, D]
    out = paged_attention(q, torch.stack([a.k[6], b.k[2]]), torch.stack([a.v[6], b.v[2]]), k_cache, v_cache, meta)
    torch.testing.assert_close(out[0:1], reference(a.q[6:], a.k, a.v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1:2], reference(b.q[2:], b.k, b.v), rtol=1e-5, atol=1e-5)


def test_a_mixed_step_scatters_each_group_back_to_its_rows():
    # T = [c's 4-token chunk at rows 0..3, a's decode at row 4, d's 2-token prompt at rows 5..6, b's decode at row 7]
    a, b = Sequence(5, [1, 4], seed=5), Sequence(9, [2, 3, 6], seed=6)
    c, d = Sequence(6, [0, 5], seed=7), Sequence(2, [7], seed=8)
    k_cache, v_cache = empty_caches()
    a.cache(k_cache, v_cache, 4)
    b.cache(k_cache, v_cache, 8)
    c.cache(k_cache, v_cache, 2)
    q = torch.cat([c.q[2:6], a.q[4:5], d.q, b.q[8:9]])  # [8, H, D]
    k = torch.cat([c.k[2:6], a.k[4:5], d.k, b.k[8:9]])
    v = torch.cat([c.v[2:6], a.v[4:5], d.v, b.v[8:9]])
    slots = c.slots(2, 6) + a.slots(4, 5) + d.slots(0, 2) + b.slots(8, 9)
    assert slots == [2, 3, 20, 21, 16, 28, 29, 24]
    decode_mask = (torch.arange(3 * BS)[None, :] < torch.tensor([5, 9])[:, None])[:, None, None, :]
    group = DecodeGroup(torch.tensor([4, 7]), torch.tensor([[1, 4, 0], [2, 3, 6]]), decode_mask)
    c_mask = (torch.arange(2 * BS)[None, :] <= torch.arange(2, 6)[:, None])[None, None]
    runs = [PrefillRun(0, 4, torch.tensor([c.blocks]), c_mask), PrefillRun(5, 2, None, None)]
    out = paged_attention(q, k, v, k_cache, v_cache, AttentionMetadata(torch.tensor(slots), [group], runs, BS))
    torch.testing.assert_close(out[0:4], reference(c.q[2:], c.k, c.v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[4:5], reference(a.q[4:], a.k, a.v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[5:7], reference(d.q, d.k, d.v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[7:8], reference(b.q[8:], b.k, b.v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_head", [0, 1])
def test_query_heads_share_key_value_heads_in_repeat_kv_order(kv_head):
    # Hand reference for the sharing rule: query heads 2h and 2h + 1 read kv head h. With one key
    # the softmax is 1, so each query head's output is exactly its kv head's value.
    k_cache, v_cache = torch.zeros(BS, HKV, D), torch.zeros(BS, HKV, D)
    v = torch.zeros(1, HKV, D)
    v[0, kv_head] = torch.arange(1.0, D + 1)
    meta = AttentionMetadata(torch.tensor([0]), [DecodeGroup(None, torch.tensor([[0]]),
                                                             torch.tensor([[[[True, False, False, False]]]]))], [], BS)
    out = paged_attention(torch.randn(1, H, D), torch.randn(1, HKV, D), v, k_cache, v_cache, meta)
    for head in range(H):
        expected = v[0, kv_head] if head // (H // HKV) == kv_head else torch.zeros(D)
        torch.testing.assert_close(out[0, head], expected, rtol=0.0, atol=1e-6)
