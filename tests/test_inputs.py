"""build_inputs: length groups for ragged decodes, checked by hand and against transformers."""

from __future__ import annotations

from conftest import config_of, make_hf_llama, nanoserve_model_from_hf
from test_llama import assert_logits_match, run_and_capture

from nanoserve import Engine, EngineConfig
from nanoserve.inputs import split_by_length
from nanoserve.model import llama


def test_split_by_length_takes_a_group_only_when_it_pays():
    # One group: area 4 x 10 = 40. Two: [1, 1, 1] -> 3 and [10] -> 10, 13 in all. A third saves nothing.
    assert split_by_length([1, 10, 1, 1]) == [[0, 2, 3], [1]]
    assert split_by_length([5, 5, 5, 5]) == [[0, 1, 2, 3]]
    # [2, 3, 4, 5]: one group 20; two: [2, 3] -> 6 + [4, 5] -> 10 = 16 (20% less, taken);
    # three: [2] 2 + [3] 3 + [4, 5] 10 = 15 (6% less than 16, not taken).
    assert split_by_length([5, 4, 3, 2]) == [[3, 2], [1, 0]]


def spy_on_groups(monkeypatch) -> list[tuple[int, list[tuple[int, bool]]]]:
    """Records, per layer call: (decode groups, [(Tq, has cached context) per prefill run])."""
    calls = []
    original = llama.paged_attention

    def spy(q, k, v, k_cache, v_cache, meta, *args):
        runs = [(run.num_rows, run.block_table is not None) for run in meta.prefill_runs]
        calls.append((len(meta.decode_groups), runs))
        return original(q, k, v, k_cache, v_cache, meta, *args)

    monkeypatch.setattr(llama, "paged_attention", spy)
    return calls


def test_grouped_decode_logits_equal_transformers(monkeypatch):
    calls = spy_on_groups(monkeypatch)
    hf = make_hf_llama(seed=8)
    # decoder_layer's grouped attention (the fused decode reads each row's table itself: test_fused_decode)
    engine = Engine(nanoserve_model_from_hf(hf), None, config_of(dtype="float32", quantization=None, block_size=4,
                                                                    num_kv_blocks=128, max_num_seqs=8, fused_decode=False))
    prompts = [[5, 6], [7 + i % 60 for i in range(60)], [9, 10, 11], [12] * 5, [13 + i % 50 for i in range(41)], [14], [15, 16], [17] * 3]
    captured, outputs = run_and_capture(engine, prompts, max_tokens=5)
    assert assert_logits_match(hf, captured, outputs) == 40
    decode_only = [groups for groups, runs in calls if not runs]
    assert decode_only and max(decode_only) >= 2  # the ragged decodes really went through more than one group


def test_mixed_steps_attend_each_prompt_alone_and_equal_transformers(monkeypatch):
    # A budget of 9 tokens: ten one-token decodes cannot all fit with a chunk, so steps mix decodes
    # with chunks of a later, longer prompt, whose second chunk has cached context to read.
    calls = spy_on_groups(monkeypatch)
    hf = make_hf_llama(seed=9)
    config = EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=160, max_num_seqs=12, max_num_batched_tokens=9)
    engine = Engine(nanoserve_model_from_hf(hf), None, config)
    prompts = [[20 + i] for i in range(8)] + [[5 + i % 70 for i in range(23)], [3, 4, 5], [40 + i % 30 for i in range(17)]]
    captured, outputs = run_and_capture(engine, prompts, max_tokens=6)
    assert assert_logits_match(hf, captured, outputs) == len(prompts) * 6
    mixed = [(groups, runs) for groups, runs in calls if groups and runs]
    assert mixed, "no step mixed decodes with a prompt chunk"
    assert any(cached for _, runs in mixed for _, cached in runs)  # a chunk that read earlier chunks' K/V
    assert any(not cached for _, runs in calls for _, cached in runs)  # a first chunk: causal, no gather
    engine.check_invariants()
