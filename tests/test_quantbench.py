"""quantbench --file-types' and --kv-cache-dtype's scoring: llama-perplexity's protocol over nanoserve's
logits, held to the same arithmetic done over transformers' logits by hand (with its K/V rounded through
gguf-py for a quantized cache), and its agreement measures against a reference."""

from __future__ import annotations

import math

import torch
from conftest import make_hf_llama, make_hf_model, nanoserve_model_from_hf

import quantbench


def test_chunked_perplexity_is_llama_perplexitys_protocol_over_transformers_logits():
    hf = make_hf_llama(seed=3, max_position_embeddings=64)
    model = nanoserve_model_from_hf(hf)
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    chunk, bos = 16, 1
    scored = quantbench.chunked_perplexity(model, ids, bos=bos, chunk=chunk)
    # by hand: bos before the text, whole chunks of 16 (71 // 16 = 4), each starting with bos, the
    # logits of positions 8 .. 14 scored against the tokens at 9 .. 15
    text, nll, count = [bos, *ids], 0.0, 0
    for c in range(4):
        piece = [bos, *text[c * chunk + 1:(c + 1) * chunk]]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([piece])).logits[0].double(), -1)
        nll -= sum(logprobs[j, piece[j + 1]].item() for j in range(chunk // 2, chunk - 1))
        count += chunk // 2 - 1
    assert scored["chunks"] == 4 and len(scored["logprobs"]) == 4
    assert math.isclose(scored["perplexity"], math.exp(nll / count), rel_tol=1e-5)
    assert "top1" not in scored  # no reference given
    same = quantbench.chunked_perplexity(model, ids, bos=bos, chunk=chunk, reference=scored["logprobs"])
    assert same["top1"] == 1.0 and abs(same["kl"]) < 1e-9
    # against a reference whose every distribution is uniform: KL(uniform || model) by hand
    uniform = [torch.full_like(lp, -math.log(lp.shape[-1])) for lp in scored["logprobs"]]
    other = quantbench.chunked_perplexity(model, ids, bos=bos, chunk=chunk, reference=uniform)
    by_hand = sum((-math.log(97) - lp.double()).mean(-1).sum().item() for lp in scored["logprobs"]) / count
    assert math.isclose(other["kl"], by_hand, rel_tol=1e-4)  # the reference holds -log 97 in float32


def test_a_quantized_cache_is_scored_over_its_rounded_k_v_read_back(monkeypatch):
    # --kv-cache-dtype's windows fed CHUNK tokens at a time (4 here), each piece after the first
    # reading the q8_0 cache back: the same arithmetic over transformers' logits with every key and
    # value rounded through gguf-py (test_kv_quant's attention)
    import test_kv_quant  # noqa: F401  (registers transformers' attention "gguf_q8_0")

    monkeypatch.setattr(quantbench, "CHUNK", 4)
    hf = make_hf_model("llama", 3, head_dim=32, max_position_embeddings=64)
    model = nanoserve_model_from_hf(hf)
    ids = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    scored = quantbench.chunked_perplexity(model, ids, chunk=16, kv_dtype="q8_0")
    hf.set_attn_implementation("gguf_q8_0")
    nll, count = 0.0, 0
    for c in range(2):
        piece = ids[c * 16:(c + 1) * 16]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([piece])).logits[0].double(), -1)
        nll -= sum(logprobs[j, piece[j + 1]].item() for j in range(8, 15))
        count += 7
    assert scored["chunks"] == 2 and math.isclose(scored["perplexity"], math.exp(nll / count), rel_tol=1e-5)
    unrounded = quantbench.chunked_perplexity(model, ids, chunk=16)
    assert not math.isclose(unrounded["perplexity"], scored["perplexity"], rel_tol=1e-5)


def test_kv_cache_dtype_takes_its_kinds_and_window(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(quantbench, "kv_caches", lambda *args: calls.append(args))
    quantbench.main(["--kv-cache-dtype", "q8_0", "q4_0", "--context", "2048", "--file", str(tmp_path / "m.gguf"),
                     "--threads", "1", "--tokens", "4096", "--out", "runs/x.csv"])
    assert calls == [(["q8_0", "q4_0"], 2048, tmp_path / "m.gguf", 1, "runs/x.csv", 4096)]
