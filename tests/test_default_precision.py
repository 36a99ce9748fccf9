"""The real default model at its default precision against float32 on the same weights.

The default is what the probe picks here: on a CPU with native bf16, bf16 activations over the
GGUF's own Q4_1 blocks; elsewhere float32, where both sides are the same run. The floors are the
figures measured on a Sapphire-Rapids-class Xeon (AVX-512 bf16, AMX) on 2026-12-02, less a margin:
top-1 agreement 97.8% over the first 512 tokens of data/quantbench.txt (asserted >= 95%),
perplexity change -0.2% (asserted within 2%), greedy common prefix 21.75 of 24 tokens over the
eight prompts of test_default_model (asserted >= 16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_default_model import PROMPTS

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.accuracy import compare, greedy_agreement, teacher_forced_logits

pytestmark = pytest.mark.weights

TEXT = Path(__file__).resolve().parent.parent / "data" / "quantbench.txt"


def test_the_default_precision_agrees_with_float32():
    reference = Engine.from_pretrained(None, EngineConfig(dtype="float32", quantization=None, max_model_len=1024))
    default = Engine.from_pretrained(None, EngineConfig(max_model_len=1024))
    token_ids = reference.tokenizer.encode(TEXT.read_text())[:512]
    report = compare(teacher_forced_logits(reference.model, token_ids)[:-1],
                     teacher_forced_logits(default.model, token_ids)[:-1], torch.tensor(token_ids[1:]))
    assert report.top1_agreement >= 0.95, (default.plan, report)
    assert abs(report.perplexity_change) <= 0.02, (default.plan, report)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    agreement = greedy_agreement([o.token_ids for o in reference.generate(PROMPTS, greedy)],
                                 [o.token_ids for o in default.generate(PROMPTS, greedy)])
    assert agreement["mean_common_prefix"] >= 16, (default.plan, agreement)
