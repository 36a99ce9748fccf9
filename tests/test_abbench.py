"""abbench's pairs on a tiny random model: each change is a config value, the loaded model is never changed."""

from __future__ import annotations

import pytest
import torch
from conftest import forms, make_tiny_engine

import nanoserve.inputs
from benchmarks.abbench import CHANGES, make_engine, step_times
from nanoserve.model.forms import can_pack


@pytest.fixture(scope="module")
def base():
    # abbench's engines hold 2048 positions; the tiny model's plain weights, as abbench loads them
    return make_tiny_engine(hf_overrides={"max_position_embeddings": 2048}, pack_weights=False, dense_kernel="torch")


# (pack_weights, compile, deferred_output, decode_group_min_rows, fused_decode, blockdot_int16_rows,
# dense_copies, dense_kernel, kv_cache_dtype, batch_invariant) of A (off) and B (on), from abbench's usage
PAIRS = {
    "groups": ((True, False, False, None, "auto", 1, "auto", "auto", "auto", False), (True, False, False, 8, "auto", 1, "auto", "auto", "auto", False)),
    "deferred": ((True, False, False, 8, "auto", 1, "auto", "auto", "auto", False), (True, False, True, 8, "auto", 1, "auto", "auto", "auto", False)),
    "compile": ((True, False, False, 8, "auto", 1, "auto", "torch", "auto", False), (False, True, False, 8, "auto", 1, "auto", "torch", "auto", False)),
    "packed": ((False, False, False, 8, "auto", 1, "auto", "torch", "auto", False), (True, False, False, 8, "auto", 1, "auto", "torch", "auto", False)),
    "fused": ((True, False, False, 8, False, 1, "auto", "auto", "auto", False), (True, False, False, 8, True, 1, "auto", "auto", "auto", False)),
    "int16": ((True, False, False, 8, "auto", None, "auto", "auto", "auto", False), (True, False, False, 8, "auto", 1, "auto", "auto", "auto", False)),
    "dequantize": ((True, False, False, 8, "auto", 1, True, "auto", "auto", False), (True, False, False, 8, "auto", 1, False, "auto", "auto", False)),
    "dense": ((True, False, False, 8, "auto", 1, "auto", "torch", "auto", False), (True, False, False, 8, "auto", 1, "auto", "blockdot", "auto", False)),
    "kv16": ((True, False, False, 8, "auto", 1, "auto", "auto", "auto", False), (True, False, False, 8, "auto", 1, "auto", "auto", "float16", False)),
    "per-layer": ((True, False, False, 8, False, 1, "auto", "auto", "auto", False), (True, False, False, 8, True, 1, "auto", "auto", "auto", False)),
    "invariant": ((True, False, False, 8, "auto", 1, "auto", "auto", "auto", False), (True, False, False, 8, "auto", 1, "auto", "auto", "auto", True)),
}


def test_every_change_has_a_pair():
    assert set(CHANGES) == set(PAIRS)


@pytest.mark.parametrize("change", sorted(PAIRS))
def test_each_side_differs_only_in_its_change(base, change):
    for on, expected in zip((False, True), PAIRS[change], strict=True):
        c = make_engine(base, change, on, slots=2).config
        o = c.overrides
        assert (o.pack_weights, c.compile, c.deferred_output, c.decode_group_min_rows, o.fused_decode,
                o.blockdot_int16_rows, o.dense_copies, o.dense_kernel, c.kv_cache_dtype, c.batch_invariant) == expected, \
            (change, on)
        assert c.max_num_seqs == 2


def test_preparing_either_side_leaves_the_loaded_model_as_it_was(base):
    layer = base.model.layers[0]
    qkv, lm_head, fused = layer.qkv, base.model.lm_head_weight, base.model.fused_layers
    packed = make_engine(base, "packed", True, slots=2)
    plain = make_engine(base, "packed", False, slots=2)
    # Nothing to lay out: the given model's own weights.
    assert plain.model.layers is base.model.layers and plain.model.lm_head_weight is lm_head
    assert forms(base.model) == {"torch"} and base.model.fused_layers is fused
    assert base.model.layers[0] is layer and layer.qkv is qkv and base.model.lm_head_weight is lm_head
    if can_pack(torch.float32):  # oneDNN present: B runs its own packed copy
        assert forms(packed.model) == {"onednn"} and packed.model.layers[0].qkv is not qkv
    # dense: B regroups its own copy into dense panels, A runs torch's (packed as "packed" B is)
    on_panels, on_torch = (make_engine(base, "dense", on, slots=2) for on in (True, False))
    assert forms(on_panels.model) == {"dense-panels"} and forms(on_torch.model) == forms(packed.model)
    assert base.model.layers[0].qkv is qkv


@pytest.mark.parametrize(("on", "expected_splits"), [(False, 0), (True, 3)])
def test_groups_off_never_splits_decode_rows(base, monkeypatch, on, expected_splits):
    calls = []
    split = nanoserve.inputs.split_by_length

    def spy(lengths, **kw):
        calls.append(len(lengths))
        return split(lengths, **kw)

    monkeypatch.setattr(nanoserve.inputs, "split_by_length", spy)
    engine = make_engine(base, "groups", on, slots=8)
    prompts = [[5] * n for n in range(3, 11)]  # 8 ragged prompts: 8 decode rows, the default threshold
    times = step_times(engine, prompts, steps=2)
    assert len(times) == 2
    assert engine.requests == {}  # every request aborted after the timed steps
    # B: the untimed first decode step and the 2 timed ones each split their 8 rows; A: never
    assert calls == [8] * expected_splits


def test_the_prefill_phase_times_the_steps_that_prefill(base):
    engine = make_engine(base, "groups", True, slots=4)
    prompts = [[5] * n for n in (3, 40, 7, 12)]
    times = step_times(engine, prompts, steps=5, phase="prefill")
    # 62 prompt tokens fit one step's 8192: that step alone is timed, no decode step follows
    assert len(times) == engine.num_steps == 1
    assert engine.requests == {}
