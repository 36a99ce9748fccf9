"""quantbench --file-types' and --kv-cache-dtype's scoring: llama-perplexity's protocol over nanoserve's
logits, held to the same arithmetic done over transformers' logits by hand (with its K/V rounded through
gguf-py for a quantized cache), and its agreement measures against a reference. --model's reader of
llama-perplexity's saved log-probabilities against bytes packed by hand, and the comparison itself on a
file llama.cpp's converter wrote, against llama-perplexity (skipped where the tools are not built)."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from conftest import make_hf_llama, make_hf_model, nanoserve_model_from_hf
from test_llamacpp_files import convert, needs_tools, save_checkpoint

import quantbench
from benchmarks.peerbench.realshapes import PHI4_MINI_LONG_FACTOR
from nanoserve import EngineConfig


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


def logits_file(path, context: int, vocab_size: int, tokens: list[int], rows: list[tuple]) -> None:
    """llama-perplexity's --kl-divergence-base layout packed by hand: each row (scale, min_log_prob, codes)."""
    width = 2 * ((vocab_size + 1) // 2)  # codes and padding, in uint16
    data = b"_logits_" + struct.pack("<3i", context, vocab_size, len(tokens) // context)
    data += struct.pack(f"<{len(tokens)}i", *tokens)
    for scale, low, codes in rows:
        data += struct.pack(f"<2f{width}H", scale, low, *codes, *[0] * (width - len(codes)))
    path.write_bytes(data)


def test_llama_perplexitys_log_probabilities_are_read_as_it_writes_them(tmp_path):
    # n_ctx 4: each window scores its logits at 2 (4 - 1 - 4 // 2 = 1 row); 3 tokens, padded to 4 codes
    file = tmp_path / "base.bin"
    logits_file(file, 4, 3, [1, 7, 8, 9, 1, 10, 11, 12], [(0.25, -12.5, [0, 4, 65535]), (0.0, -1.5, [0, 0, 0])])
    read = quantbench.LlamaLogProbs.read(file)
    assert (read.context, read.vocab_size, read.num_chunks, read.scored) == (4, 3, 2, 1)
    assert read.tokens == [1, 7, 8, 9, 1, 10, 11, 12]
    assert read.chunk(0).tolist() == [[-12.5, -11.5, -12.5 + 0.25 * 65535]]
    assert read.chunk(1).tolist() == [[-1.5, -1.5, -1.5]]
    with pytest.raises(ValueError, match="window 2 is outside \\[0, 2\\)"):
        read.chunk(2)
    file.write_bytes(file.read_bytes()[:-2])
    with pytest.raises(ValueError, match="holds 82 bytes; its header .* says 84"):
        quantbench.LlamaLogProbs.read(file)
    file.write_bytes(b"_logitz_" + bytes(76))
    with pytest.raises(ValueError, match="does not start with b'_logits_'"):
        quantbench.LlamaLogProbs.read(file)
    logits_file(file, 2, 3, [1, 7], [])
    with pytest.raises(ValueError, match="n_ctx=2"):
        quantbench.LlamaLogProbs.read(file)


@needs_tools
@pytest.mark.skipif(not quantbench.perplexity_binary().is_file(),
                    reason=f"llama-perplexity is not built at {quantbench.perplexity_binary()} (cmake --build "
                           ".peers/llama.cpp-build --target llama-perplexity)")
@pytest.mark.parametrize("family", ["llama", "phi4-mini-rope"])
def test_nanoserve_scores_a_converter_file_as_llama_perplexity_does(tmp_path, family):
    # A tiny Llama (and a tiny Phi-3 with Phi-4-mini's rope: on 0.75 of each head, LongRoPE's factors
    # and attention factor, a window wider than the text) converted to F32 by llama.cpp's converter,
    # its final norm raised to 4 so the logits spread (std about 1.3) but stay within 16 of the top
    # one, where llama.cpp's saved log-probabilities are exact to its 16-bit codes: the same windows of
    # the same tokens by both, in float32 here.
    wide = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    if family == "llama":
        hf = make_hf_model("llama", seed=51, num_attention_heads=4, num_key_value_heads=2, head_dim=64, **wide)
    else:
        hf = make_hf_model("phi3", seed=51, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                           partial_rotary_factor=0.75, max_position_embeddings=131072, pad_token_id=0,
                           original_max_position_embeddings=4096, sliding_window=262144, **wide,
                           rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                         "long_factor": PHI4_MINI_LONG_FACTOR})
    with torch.no_grad():
        hf.model.norm.weight.fill_(4.0)
    folder = save_checkpoint(hf, tmp_path / "hf")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"  # the one Phi-3's converter reads a BPE vocabulary under
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    file = convert(folder, tmp_path / "tiny-f32.gguf")
    row = quantbench.against_llamacpp(file, 128, 2, 2, EngineConfig(dtype="float32", quantization=None,
                                                                   max_model_len=136))
    assert (row["windows"], row["positions"], row["vocab_size"]) == (2, 2 * 63, 49152)
    # llama.cpp's perplexity from the saved log-probabilities is the one it printed
    assert math.isclose(row["llamacpp_perplexity_saved"], row["llamacpp_perplexity"], rel_tol=2e-4)
    assert math.isclose(row["nanoserve_perplexity"], row["llamacpp_perplexity"], rel_tol=5e-3), row
    assert row["mean_kl"] < 1e-3 and row["top1_agreement"] > 0.97, row
    # not flat: the agreement means something, the KL far below a model that ignored its input
    assert row["llamacpp_top1_prob"] > 20 / 49152 and row["mean_kl"] < row["llamacpp_kl_from_uniform"] / 100, row
