"""model/kv_quant.py and a K/V cache of llama.cpp's blocks (kv_cache_dtype "q8_0", "q4_0").

The references are independent of nanoserve: gguf-py's `gguf.quants.quantize` / `dequantize` (the
bytes llama.cpp writes, and their values), attention by hand in float64 over those values, and
transformers' own models with every key and value rounded through gguf-py before its attention. Heads
of a multiple of 64 are rounded as llama.cpp rounds them (llama-kv-cache.cpp's attn_rot_k / attn_rot_v):
turned by a Walsh-Hadamard matrix written here by hand, H[i, j] = (-1)^popcount(i & j) / sqrt(n),
before they are rounded and turned back after, q . k and the weighted sum of v being unchanged by it.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import CharTokenizer, config_of, make_hf_model, nanoserve_model_from_hf
from gguf import GGMLQuantizationType
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot, default, kv_quant
from nanoserve.model.attention import AttentionMetadata, DecodeGroup, PrefillRun, paged_attention
from nanoserve.model.config import LlamaConfig
from nanoserve.model.kv_cache import KVCache, bytes_per_block

KINDS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def gguf_bytes(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] float32 -> [..., W] uint8 as gguf-py quantizes it."""
    out = gguf.quants.quantize(x.numpy(), KINDS[kind])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(*x.shape[:-1], -1)


def gguf_values(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] float32 rounded through gguf-py: quantized, then dequantized (float32)."""
    return torch.from_numpy(gguf.quants.dequantize(gguf_bytes(x, kind).numpy(), KINDS[kind])).reshape(x.shape)


def hadamard(n: int) -> torch.Tensor:
    """[n, n] float64: Sylvester's Walsh-Hadamard matrix over sqrt(n), entry by entry."""
    return torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64) / n**0.5


def turned(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """x [..., D] with each run of n values times hadamard(n) (its own inverse), in float64; n None: x."""
    if n is None:
        return x
    return (x.double().reshape(*x.shape[:-1], -1, n) @ hadamard(n)).reshape(x.shape)


def widths(D: int) -> tuple[int | None, int | None]:
    """llama.cpp's rotation widths for q and k, and for v, by its rule: heads of a multiple of 64 only;
    k by 64 doubled while it divides D, v by 64."""
    if D % 64:
        return None, None
    n = 64
    while D % (2 * n) == 0:
        n *= 2
    return n, 64


def cache_values(x: torch.Tensor, kind: str, n: int | None) -> torch.Tensor:
    """x [..., D] as a cache of `kind` holds it, read back in x's basis: turned by n, rounded through gguf-py, turned back."""
    return turned(gguf_values(turned(x, n).float(), kind), n).to(x.dtype)


def on_grid(rows: int, D: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[rows, HKV, D] float64 that a cache of `kind` holds exactly: each block of 32 codes times a
    power of two, its largest |code| (127, or q4_0's -8) first and alone, so its scale is that power."""
    blocks = (rows, HKV, D // 32, 32)
    top = 127 if kind == "q8_0" else 8
    codes = torch.randint(1 - top, top, blocks, generator=gen).double()
    codes[..., 0] = top if kind == "q8_0" else -top
    largest = -5 if kind == "q8_0" else 0  # |values| at most 4 (127 / 32, 8 / 2), as the random keys are
    scale = 2.0 ** torch.randint(largest - 3, largest + 1, (*blocks[:-1], 1), generator=gen).double()
    return (codes * scale).reshape(rows, HKV, D)


def awkward(rows: int, D: int, seed: int) -> torch.Tensor:
    """[rows, D] float32 of every scale (1e-6 .. 3e4 a block), with blocks on each rule's edges: all zeros, a
    largest |x| held by two values of opposite sign (q4_0 takes the first), values landing exactly on
    halves (amax 127, or largest -8: the scale is 1 and x / d + 8.5 or x / d is a half), a lone large value."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.empty(rows, D // 32, 1).uniform_(-14, 10, generator=gen))  # [rows, nb, 1]
    x = (torch.randn(rows, D // 32, 32, generator=gen) * scales).reshape(rows, D)
    x[0] = 0
    x[1, :32] = torch.linspace(-1, 1, 32)
    x[1, 5], x[1, 20] = -4.0, 4.0  # q4_0: the first of equal |x| (-4) sets the sign of d
    x[1, 32:64] = torch.arange(-16, 16) + 0.5  # halves: q8_0 with amax 127 (next line) rounds them away from zero
    x[1, 40] = 127.0
    x[2, :32] = torch.arange(-16, 16) / 2  # q4_0 with largest -8: d = 1, x + 8.5 on integers and halves
    x[2, 31] = 0.25
    x[3, :32] = torch.randn(32, generator=gen) * 1e-3
    x[3, 7] = 3.0e4  # one large value beside small ones
    return x


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_blocks_are_gguf_pys_bytes_and_values(kind):
    x = awkward(64, 128, seed=1)
    ours = kv_quant.quantize(x, kind)
    assert ours.dtype == torch.uint8 and ours.shape == (64, 128 // 32 * kv_quant.BLOCK_BYTES[kind])
    assert torch.equal(ours, gguf_bytes(x, kind))
    assert torch.equal(kv_quant.dequantize(ours, kind), gguf_values(x, kind))  # exact: d q fits float32
    # bf16 activations are quantized from their float32 values and read back rounded to bf16
    assert torch.equal(kv_quant.quantize(x.bfloat16(), kind), gguf_bytes(x.bfloat16().float(), kind))
    assert torch.equal(kv_quant.dequantize(ours, kind, torch.bfloat16), gguf_values(x, kind).bfloat16())


def test_the_edges_by_hand():
    x = awkward(4, 64, seed=1)
    q8 = kv_quant.quantize(x, "q8_0").view(4, 2, 34)
    assert not q8[0].any()  # zeros: d = 0, every code 0
    halves = q8[1, 1, 2:].view(torch.int8).tolist()  # d = 127 / 127 = 1: x + 0.5 rounds away from zero
    assert halves[:3] == [-16, -15, -14] and halves[15:18] == [-1, 1, 2]  # -15.5 -> -16, -0.5 -> -1, 0.5 -> 1
    q4 = kv_quant.quantize(x, "q4_0").view(4, 2, 18)
    assert q4[0, :, 2:].eq(0x88).all()  # zeros: every code 8, (8 - 8) 0 = 0
    assert q4[1, 0, :2].view(torch.float16).item() == 0.5  # d = -4 / -8: the first of -4 and 4
    codes = torch.cat([q4[2, 0, 2:] & 15, q4[2, 0, 2:] >> 4]).tolist()  # d = -8 / -8 = 1: trunc(x + 8.5)
    assert codes[:4] == [0, 1, 1, 2] and codes[31] == 8  # -8 -> 0, -7.5 -> 1, -7 -> 1, -6.5 -> 2; 0.25 -> 8


@pytest.mark.parametrize("D, n_qk, n_v", [(32, None, None), (64, 64, 64), (96, None, None), (128, 128, 64),
                                          (192, 64, 64), (256, 256, 64)])
def test_the_rotation_widths_and_matrices(D, n_qk, n_v):
    assert widths(D) == (n_qk, n_v)  # the rule as llama.cpp writes it, against the values by hand
    assert kv_quant.rotations(D) == (None if n_qk is None else (n_qk, n_v))
    if n_qk is None:
        return
    x = torch.randn(3, 2, D, dtype=torch.float64).float()
    for n in {n_qk, n_v}:
        torch.testing.assert_close(kv_quant.rotate(x, n).double(), turned(x, n), rtol=0, atol=1e-5)
        torch.testing.assert_close(kv_quant.rotate(kv_quant.rotate(x, n), n), x, rtol=0, atol=1e-5)  # its own inverse


# ---- the torch path: paged_attention writes blocks and reads them back ---------------------------

H, HKV, BS = 4, 2, 4


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence, float64: q [Tq, H, D] at its last Tq positions over k, v [L, Hkv, D] -> [Tq, H, D]."""
    Tq, L = q.shape[0], k.shape[0]
    k, v = k.double().repeat_interleave(H // HKV, dim=1), v.double().repeat_interleave(H // HKV, dim=1)  # [L, H, D]
    scores = torch.einsum("thd,lhd->htl", q.double(), k) * q.shape[-1] ** -0.5  # [H, Tq, L]
    allowed = torch.arange(L)[None, :] <= torch.arange(L - Tq, L)[:, None]  # [Tq, L]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", weights, v)  # [Tq, H, D]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("D", [32, 64, 128])  # not turned; turned by 64; q and k by 128, v by 64
def test_a_mixed_step_writes_gguf_bytes_and_attends_over_their_values(kind, D):
    # T = [a's 3-token chunk after 5 cached, b's decode after 6 cached, c's 4-token prompt with nothing cached]
    n_qk, n_v = widths(D)
    gen = torch.Generator().manual_seed(3)
    lengths, blocks = {"a": 8, "b": 7, "c": 4}, {"a": [6, 0], "b": [2, 5], "c": [3]}
    q = {s: torch.randn(n, H, D, generator=gen) for s, n in lengths.items()}
    if n_qk is None:
        k = {s: torch.randn(n, HKV, D, generator=gen) * 3 for s, n in lengths.items()}
        v = {s: torch.randn(n, HKV, D, generator=gen) for s, n in lengths.items()}
    else:  # turned, on the cache's grid: a last-bit difference in the turn cannot move a code
        k = {s: turned(on_grid(n, D, kind, gen), n_qk).float() for s, n in lengths.items()}
        v = {s: turned(on_grid(n, D, kind, gen), n_v).float() for s, n in lengths.items()}
    slots = {s: [blocks[s][p // BS] * BS + p % BS for p in range(n)] for s, n in lengths.items()}
    W = kv_quant.head_bytes(D, kind)
    k_cache, v_cache = torch.zeros(8 * BS, HKV, W, dtype=torch.uint8), torch.zeros(8 * BS, HKV, W, dtype=torch.uint8)

    def stored(x: torch.Tensor, n: int | None) -> torch.Tensor:  # the bytes llama.cpp writes for x
        return gguf_bytes(turned(x, n).float(), kind)

    for s, cached in (("a", 5), ("b", 6)):  # as earlier steps wrote them
        k_cache[slots[s][:cached]], v_cache[slots[s][:cached]] = stored(k[s][:cached], n_qk), stored(v[s][:cached], n_v)
    new = {"a": slice(5, 8), "b": slice(6, 7), "c": slice(0, 4)}
    a_mask = (torch.arange(2 * BS)[None, :] <= torch.arange(5, 8)[:, None])[None, None]  # [1, 1, 3, 8]
    runs = [PrefillRun(0, 3, torch.tensor([blocks["a"]]), a_mask), PrefillRun(4, 4, None, None)]
    b_mask = (torch.arange(2 * BS) < 7)[None, None, None]  # [1, 1, 1, 8]: b's last slot holds nothing yet
    group = DecodeGroup(torch.tensor([3]), torch.tensor([blocks["b"]]), b_mask)
    meta = AttentionMetadata(torch.tensor([x for s in "abc" for x in slots[s][new[s]]]), [group], runs, BS)
    out = paged_attention(torch.cat([q[s][new[s]] for s in "abc"]), torch.cat([k[s][new[s]] for s in "abc"]),
                          torch.cat([v[s][new[s]] for s in "abc"]), k_cache, v_cache, meta)
    for s in "abc":
        assert torch.equal(k_cache[slots[s][new[s]]], stored(k[s][new[s]], n_qk))
        assert torch.equal(v_cache[slots[s][new[s]]], stored(v[s][new[s]], n_v))
    rows = {"a": slice(0, 3), "b": slice(3, 4), "c": slice(4, 8)}
    for s in "abc":  # c's prompt too attends to its K/V as the cache holds them
        expected = by_hand(q[s][new[s]], cache_values(k[s], kind, n_qk), cache_values(v[s], kind, n_v))
        torch.testing.assert_close(out[rows[s]].double(), expected, rtol=1e-5, atol=1e-5)
        if n_qk is None:
            unrounded = by_hand(q[s][new[s]], k[s], v[s])
            assert (unrounded - expected).abs().max() > 1e-3  # the rounding shows: the check above can fail
        else:  # the turn shows: unturned, the same values are other bytes
            assert not torch.equal(k_cache[slots[s][new[s]]], gguf_bytes(k[s][new[s]], kind))


# ---- the cache, the config and the plan ------------------------------------------------------------

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("kind, head_bytes, tokens_vs_f16", [("q8_0", 4 * 34, 1.87), ("q4_0", 4 * 18, 3.55)])
def test_bytes_a_block_and_the_tokens_a_budget_holds(kind, head_bytes, tokens_vs_f16):
    # Llama 3 8B: a head of 128 values is 4 blocks; 2 (K, V) x 32 layers x 8 heads x 16 tokens a block
    assert bytes_per_block(LLAMA3_8B, 16, kind) == 2 * 32 * 8 * 16 * head_bytes
    budget = 512 * 2**20
    ratio = (budget // bytes_per_block(LLAMA3_8B, 16, kind)) / (budget // bytes_per_block(LLAMA3_8B, 16, torch.float16))
    assert tokens_vs_f16 < ratio < tokens_vs_f16 + 0.02  # 256 / 136 = 1.88, 256 / 72 = 3.56
    config = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=32)
    cache = KVCache(config, num_blocks=3, block_size=4, dtype=kind, device=torch.device("cpu"))
    assert cache.k.shape == cache.v.shape == (2, 12, 1, head_bytes // 4) and cache.k.dtype == torch.uint8
    assert cache.nbytes == 3 * bytes_per_block(config, 4, kind) and cache.dtype == kind


def test_bad_kinds_and_head_dims_are_refused_before_allocation():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='q5_0' is not one of \['auto', 'float32', 'bfloat16', "
                                         r"'float16', 'q8_0', 'q4_0'\]"):
        EngineConfig(kv_cache_dtype="q5_0")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='q8_0' with tensor_parallel_size=2"):
        EngineConfig(kv_cache_dtype="q8_0", tensor_parallel_size=2)
    hf = make_hf_model("llama", 0)  # head_dim 8
    with pytest.raises(ValueError, match=r"kv_cache_dtype='q4_0' .* head_dim=8 is not a multiple of 32"):
        Engine(nanoserve_model_from_hf(hf), CharTokenizer(97), EngineConfig(kv_cache_dtype="q4_0", num_kv_blocks=4))
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    with pytest.raises(ValueError, match=r"head_dim=8 is not a multiple of 32"):
        KVCache(config, 4, 4, "q8_0", torch.device("cpu"))


# ---- an engine against transformers with its K/V rounded through gguf-py --------------------------

def _rounding(kind: str):
    def attend(module, query, key, value, *args, **kwargs):
        n_qk, n_v = widths(key.shape[-1])
        rounded = [cache_values(key, kind, n_qk), cache_values(value, kind, n_v)]  # [B, Hkv, L, D] each
        return sdpa_attention_forward(module, query, *rounded, *args, **kwargs)
    return attend


for _kind in KINDS:  # transformers' attention with every key and value rounded as the cache rounds them
    AttentionInterface.register(f"gguf_{_kind}", _rounding(_kind))
    AttentionMaskInterface.register(f"gguf_{_kind}", sdpa_mask)

PROMPTS = [[5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21], [5, 9, 13, 22, 7, 41, 3, 8, 17, 4], [30 + i % 50 for i in range(40)]]
# name -> (family, transformers config overrides): per-head q/k norms (Qwen3), a window shorter than the prompts,
# heads of 64 and 128 (turned by 64; q and k by 128, v by 64)
FAMILIES = {"llama": ("llama", {"head_dim": 32}), "qwen3": ("qwen3", {"head_dim": 32}),
            "mistral-window": ("mistral", {"head_dim": 32, "sliding_window": 6}),
            "llama-64": ("llama", {"head_dim": 64}), "qwen3-128": ("qwen3", {"head_dim": 128})}


def reference(hf, kind: str | None, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens with K/V rounded through gguf-py (kind None: as computed), and each
    token's logprob: the whole sequence forwarded again for each token (EOS is a token like any other)."""
    hf.set_attn_implementation(f"gguf_{kind}" if kind else "sdpa")
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            last = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)  # [V]
            ids.append(int(last.argmax()))
            logprobs.append(last[ids[-1]].item())
    return ids[len(prompt):], logprobs


def quantized_engine(hf, kind: str, **fields) -> Engine:
    config = config_of(**({"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "dtype": "float32",
                           "quantization": None, "kv_cache_dtype": kind} | fields))
    return Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)


# torch's attention (decoder_layer), fused_decode.c's beside torch's matmuls, and the invariant plan's one call
DRIVERS = {"torch": {"fused_decode": False}, "c": {"fused_decode": True, "batch_invariant": False},
           "invariant": {"batch_invariant": True}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_an_engine_equals_transformers_over_the_rounded_cache(family, kind, driver):
    if driver != "torch" and blockdot.library() is None:
        pytest.skip(f"blockdot not built here: {blockdot.failure()}")
    hf = make_hf_model(FAMILIES[family][0], 5, **FAMILIES[family][1])
    engine = quantized_engine(hf, kind, **DRIVERS[driver])
    assert engine.kv.k.dtype == torch.uint8 and f"kv cache {kind}: as configured" in engine.plan.reason
    assert (engine.model.fused_layers is not None) == (driver != "torch")
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = reference(hf, kind, prompt, 8)
        assert list(out.token_ids) == tokens
        ours = [d[t] for d, t in zip(out.logprobs, tokens, strict=True)]
        np.testing.assert_allclose(ours, logprobs, rtol=0, atol=2e-5)
    _, unrounded = reference(hf, None, PROMPTS[2], 8)
    assert max(abs(a - b) for a, b in zip(unrounded, logprobs, strict=True)) > 1e-4  # 5x atol: the rounding shows


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("build", ["avx512", "avx2", "plain", "avx512-simde"])
def test_the_other_builds_attend_over_the_blocks_alike(build, kind):
    # What another CPU (or a compiler without -march=native) would run: the widening of each run with
    # AVX-512's, AVX2's or plain C's instructions, AVX-512's also under SIMDe
    from test_blockdot import build as build_kernel

    kernel = build_kernel(build)
    hf = make_hf_model("llama", 5, head_dim=64)  # heads turned by 64 before the store
    engine = quantized_engine(hf, kind, batch_invariant=True)
    engine.model.fused_layers.kernel = kernel
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = reference(hf, kind, prompt, 6)
        assert list(out.token_ids) == tokens
        np.testing.assert_allclose([d[t] for d, t in zip(out.logprobs, tokens, strict=True)], logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_preemption_and_prefix_hits_over_a_quantized_cache_return_every_block(driver):
    if driver != "torch" and blockdot.library() is None:
        pytest.skip(f"blockdot not built here: {blockdot.failure()}")
    hf = make_hf_model("llama", 5, head_dim=32)
    engine = quantized_engine(hf, "q8_0", num_kv_blocks=14, max_num_batched_tokens=6, **DRIVERS[driver])
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:9] + [70, 71], PROMPTS[2][:30]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) > 0 and sum(o.num_cached_tokens for o in outs) > 0
    engine.check_invariants()
    assert engine.allocator.num_free == 14
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == reference(hf, "q8_0", prompt, 10)[0]


# ---- the command line ------------------------------------------------------------------------------

def test_nanoserve_plan_prints_a_quantized_cache(tmp_path, capsys):
    from nanoserve.serving.cli import plan_main

    make_hf_model("llama", 5, head_dim=32, vocab_size=49152).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer the loader reads: the default model's
        shutil.copy(default.default_model_dir() / name, tmp_path / name)
    plan_main(["--model", str(tmp_path), "--kv-cache-dtype", "q8_0", "--dtype", "float32", "--quantization", "none"])
    out = capsys.readouterr().out
    assert "KV cache q8_0" in out and "kv cache q8_0: as configured; llama.cpp's blocks of 32 values" in out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_serve_takes_the_block_kinds(capsys, kind):
    from nanoserve.serving.cli import serve_main

    with pytest.raises(SystemExit) as exit_info:  # the parser takes the kind; the config then names what it refuses
        serve_main(["--kv-cache-dtype", kind, "--tensor-parallel-size", "2"])
    assert exit_info.value.code == 2 and f"kv_cache_dtype='{kind}' with tensor_parallel_size=2" in capsys.readouterr().err


def test_a_draft_model_drafts_over_the_targets_kind_and_greedy_is_unchanged():
    # the draft's plan takes the engine's kv_cache_dtype: its pool is q8_0 too; verified drafts give
    # the same tokens as the engine without speculation (test_speculative's compare)
    from test_speculative import compare, draft_spec, engine, greedy, tiny_model

    hf = tiny_model(seed=43, lm_head_scale=3.0, head_dim=32)
    spec = draft_spec(hf, k=3)
    speculating = engine(hf, spec, kv_cache_dtype="q8_0")
    assert speculating.speculation.draft.kv.dtype == "q8_0" and speculating.kv.dtype == "q8_0"
    assert speculating.speculation.draft.kv.k.dtype == torch.uint8
    compare(hf, PROMPTS, [greedy(12)] * len(PROMPTS), spec=spec, kv_cache_dtype="q8_0")
