"""The accuracy instrument: teacher-forced logits against transformers, and compare() against
perplexities, KL divergences and agreements worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    LLAMA3_ROPE,
    make_hf_llama,
    make_hf_model,
    nanoserve_model_from_hf,
    prepared,
    requires_default_model,
)

from nanoserve.instruments.accuracy import (
    AccuracyReport,
    common_prefix,
    compare,
    greedy_agreement,
    teacher_forced_logits,
    worse_than,
)
from nanoserve.model import blockdot
from nanoserve.model.driver import Driver

QUANTBENCH = Path(__file__).resolve().parents[1] / "data" / "quantbench.txt"


def random_ids(n: int, vocab_size: int = 97, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("num_tokens", "chunk"), [(40, 16), (33, 16), (40, 7), (40, 512), (40, 1)],
                         ids=["chunks-of-blocks", "last-chunk-one-token", "chunks-cut-blocks", "one-chunk", "decode-steps"])
@pytest.mark.parametrize("arch", [{}, {"rope_scaling": LLAMA3_ROPE, "head_dim": 16, "rope_theta": 500000.0}],
                         ids=["gqa", "llama3-rope"])
def test_teacher_forced_logits_equal_transformers(num_tokens, chunk, arch):
    hf = make_hf_llama(seed=3, **arch)
    ids = random_ids(num_tokens)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
    got = teacher_forced_logits(nanoserve_model_from_hf(hf), ids, chunk=chunk)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, 97)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_tokens", "chunk"), [(40, 40), (40, 16), (40, 1)], ids=["one-chunk", "chunks", "decode-steps"])
@pytest.mark.parametrize(("family", "arch"), [
    ("mistral", {"sliding_window": 6}),
    # Gemma 3: windowed layers on their own rope base, every third layer global (transformers' layer_types)
    ("gemma3", {"sliding_window": 6, "num_hidden_layers": 3, "head_dim": 16, "rope_local_base_freq": 100.0,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
], ids=["mistral", "gemma3"])
def test_teacher_forced_logits_of_windowed_layers_equal_transformers(num_tokens, chunk, family, arch):
    hf = make_hf_model(family, seed=5, **arch)
    ids = random_ids(num_tokens)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
    got = teacher_forced_logits(nanoserve_model_from_hf(hf), ids, chunk=chunk)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    hf.config.sliding_window = 10**6  # the window matters at this length: without it, other logits
    with torch.no_grad():
        assert not torch.allclose(hf(torch.tensor([ids])).logits[0], expected, atol=1e-3)


@pytest.mark.skipif(blockdot.library() is None, reason=f"no fused decode here: {blockdot.failure()}")
def test_teacher_forced_decode_steps_run_the_models_fused_decode():
    hf = make_hf_llama(seed=4)
    ids = random_ids(37)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
    model = prepared(nanoserve_model_from_hf(hf), dtype="float32", quantization=None, pack_weights=False, fused_decode=True)
    one_call, calls = model.drivers[Driver.C_ONE_CALL], []
    model.drivers[Driver.C_ONE_CALL] = lambda m, h, inputs, kv: calls.append(h.shape[0]) or one_call(m, h, inputs, kv)
    torch.testing.assert_close(teacher_forced_logits(model, ids, chunk=1), expected, atol=1e-4, rtol=1e-4)
    assert calls == [1] * 37


def test_teacher_forced_logits_refuses_bad_input():
    model = nanoserve_model_from_hf(make_hf_llama(), max_positions=32)
    with pytest.raises(ValueError, match="len\\(token_ids\\)=40 exceeds the model's 32 positions"):
        teacher_forced_logits(model, random_ids(40))
    with pytest.raises(ValueError, match="token id 97 is outside the vocabulary \\[0, 97\\)"):
        teacher_forced_logits(model, [5, 97, 6])
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        teacher_forced_logits(model, [5, 6], chunk=0)
    with pytest.raises(ValueError, match="empty"):
        teacher_forced_logits(model, [])


def test_compare_against_hand_arithmetic():
    # Row 0: reference softmax [1/4, 1/2, 1/4], candidate [1/2, 1/4, 1/4], target 0.
    # Row 1: reference softmax [1/5, 3/5, 1/5], candidate [1/4, 1/2, 1/4], target 1.
    # Constant offsets (+5, -3) change no softmax: raw logits used as log-probabilities would show.
    ln2, ln3 = math.log(2), math.log(3)
    ref = torch.tensor([[5.0, 5.0 + ln2, 5.0], [0.0, ln3, 0.0]])
    cand = torch.tensor([[ln2, 0.0, 0.0], [-3.0, -3.0 + ln2, -3.0]])
    report = compare(ref, cand, torch.tensor([0, 1]))
    # Reference NLL: ln 4 + ln(5/3) = ln(20/3) over 2 rows; candidate: ln 2 + ln 2 = ln 4.
    assert report.perplexity_ref == pytest.approx(math.sqrt(20 / 3), rel=1e-6)
    assert report.perplexity == pytest.approx(2.0, rel=1e-6)
    assert report.perplexity_change == pytest.approx(math.sqrt(0.6) - 1, rel=1e-6)
    # Argmax: row 0 reference 1, candidate 0; row 1 both 1.
    assert report.top1_agreement == 0.5
    # KL row 0: 1/4 ln(1/2) + 1/2 ln 2 = ln2 / 4. Row 1: 2 (1/5) ln(4/5) + 3/5 ln(6/5).
    # KL(candidate || reference) would be 0.0102 rather than 0.0101 (row 1 is not symmetric).
    kl_1 = 0.4 * math.log(0.8) + 0.6 * math.log(1.2)
    assert report.mean_kl == pytest.approx((ln2 / 4 + kl_1) / 2, rel=1e-6)
    assert report.positions == 2


def test_compare_identical_logits():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 4
    report = compare(logits, logits.clone(), torch.tensor([0, 3, 10, 7, 7]))
    assert report.mean_kl == 0.0
    assert report.top1_agreement == 1.0
    assert report.perplexity_change == 0.0
    assert report.perplexity == report.perplexity_ref > 1.0
    assert report.positions == 5


def test_compare_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[2, 4\]"):
        compare(torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"\[3\].*\[2\]"):
        compare(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[3\].*\[3\]"):
        compare(torch.zeros(3), torch.zeros(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        compare(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 3]))


def test_worse_than_is_strictly_more_than_the_limit():
    def report(change: float) -> AccuracyReport:
        return AccuracyReport(10.0, 10.0 * (1 + change), change, 1.0, 0.0, 100)

    assert worse_than(report(0.03))
    assert not worse_than(report(0.02))
    assert not worse_than(report(-0.01))
    assert not worse_than(report(0.03), limit=0.05)
    with pytest.raises(ValueError, match="limit=-0.1 must be finite and >= 0"):
        worse_than(report(0.03), limit=-0.1)


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2),
    ([5], [6], 0), ([7, 1, 2], [8, 1, 2], 0),
])
def test_common_prefix(a, b, expected):
    assert common_prefix(a, b) == expected
    assert common_prefix(b, a) == expected


def test_greedy_agreement():
    ref = [[1, 2, 3], [4, 5], [7], [4, 5]]
    cand = [[1, 2, 9], [4, 5], [8], [4, 5, 6]]  # the last matches as far as it goes but is longer
    assert greedy_agreement(ref, cand) == {"prompts": 4, "mean_common_prefix": (2 + 2 + 0 + 2) / 4,
                                           "full_match": 0.25}
    with pytest.raises(ValueError, match="ref_runs has 2 runs and cand_runs 1"):
        greedy_agreement([[1], [2]], [[1]])
    with pytest.raises(ValueError, match="no runs"):
        greedy_agreement([], [])


@requires_default_model
@pytest.mark.weights
def test_quantbench_text_is_long_enough():
    from transformers import AutoTokenizer

    from nanoserve.model import default

    gguf = default.gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = QUANTBENCH.read_text(encoding="utf-8")
    assert text.startswith("# quantbench evaluation text") and "License" in text.splitlines()[0]
    assert len(tokenizer.encode(text)) >= 5000
