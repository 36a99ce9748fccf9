"""build_inputs: length groups for ragged decodes, checked by hand and against transformers."""

from __future__ import annotations

from conftest import make_hf_llama, nanoserve_model_from_hf
from test_llama import assert_logits_match, run_and_capture

from nanoserve import Engine, EngineConfig
from nanoserve.inputs import split_by_length
from nanoserve.model import attention


def test_split_by_length_takes_a_group_only_when_it_pays():
    # One group: area 4 x 10 = 40. Two: [1, 1, 1] -> 3 and [10] -> 10, 13 in all. A third saves nothing.
    assert split_by_length([1, 10, 1, 1]) == [[0, 2, 3], [1]]
    assert split_by_length([5, 5, 5, 5]) == [[0, 1, 2, 3]]
    # [2, 3, 4, 5]: one group 20; two: [2, 3] -> 6 + [4, 5] -> 10 = 16 (20% less, taken);
    # three: [2] 2 + [3] 3 + [4, 5] 10 = 15 (6% less than 16, not taken).
    assert split_by_length([5, 4, 3, 2]) == [[3, 2], [1, 0]]


def test_grouped_decode_logits_equal_transformers(monkeypatch):
    calls = []
    original = attention._grouped_decode

    def spy(q, k_cache, v_cache, meta):
        calls.append(len(meta.decode_groups))
        return original(q, k_cache, v_cache, meta)

    monkeypatch.setattr(attention, "_grouped_decode", spy)
    hf = make_hf_llama(seed=8)
    engine = Engine(nanoserve_model_from_hf(hf), None, EngineConfig(block_size=4, num_kv_blocks=128, max_num_seqs=8))
    prompts = [[5, 6], [7 + i % 60 for i in range(60)], [9, 10, 11], [12] * 5, [13 + i % 50 for i in range(41)], [14], [15, 16], [17] * 3]
    captured, outputs = run_and_capture(engine, prompts, max_tokens=5)
    assert assert_logits_match(hf, captured, outputs) == 40
    assert calls and max(calls) >= 2  # the ragged decodes really went through more than one group
