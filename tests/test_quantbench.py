"""quantbench --file-types' scoring: llama-perplexity's protocol over nanoserve's logits, held to the
same arithmetic done over transformers' logits by hand, and its agreement measures against a reference."""

from __future__ import annotations

import math

import torch
from conftest import make_hf_llama, nanoserve_model_from_hf

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
