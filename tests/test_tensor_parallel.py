"""Tensor parallelism: the split by hand, the step plan's round trip, TP=2 against TP=1, failures
and the end of every process.

The reference for a TP=2 engine is the one-process engine on the same checkpoint (itself checked
against transformers in test_llama and test_families): logits within 1e-5 in float32 at prefill and
every decode step, greedy tokens identical on the real default model. Worker processes are found
in the process table (psutil), never taken on trust from the code that started them.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import TINY, free_port, greedy, make_hf_model, running_server
from conftest import config_of as engine_config
from gguf import GGMLQuantizationType as QT
from test_batch_invariance import HARD_LOAD, answer, run_load
from test_batch_invariance import PROMPTS as INVARIANT_PROMPTS
from test_batch_invariance import params as invariant_params
from test_families import FAMILIES
from test_gguf import write_gguf_from_hf
from test_llama import PROMPTS, run_and_capture
from test_precision import fake

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot, precision
from nanoserve.model.attention import AttentionMetadata, DecodeGroup, PrefillRun
from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import ModelInputs
from nanoserve.model.shard import Shard, local_config, shard_of, slice_of
from nanoserve.parallel import TensorParallelModel, WorkerFailure
from nanoserve.parallel.cpus import cpu_share, parse_cpu_list
from nanoserve.parallel.plan import decode, encode

WORKER = "nanoserve.parallel.worker"
needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")


def config_of(**overrides) -> LlamaConfig:
    return LlamaConfig(**({"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                           "num_heads": 4, "num_kv_heads": 2, "head_dim": 8} | overrides))


# ---- the split, by hand ----------------------------------------------------------------------------


def test_default_model_shapes_split_ceil_first():
    # SmolLM2-135M: H = 9, Hkv = 3, I = 1536, V = 49152. 3 key/value heads on 2 ranks are 2 and 1,
    # each with its 3 query heads; I splits at a multiple of 32; the vocabulary in halves.
    config = config_of(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64)
    assert [shard_of(config, r, 2) for r in (0, 1)] == [
        Shard(0, 2, q_heads=(0, 6), kv_heads=(0, 2), mlp=(0, 768), vocab=(0, 24576)),
        Shard(1, 2, q_heads=(6, 9), kv_heads=(2, 3), mlp=(768, 1536), vocab=(24576, 49152)),
    ]
    local = local_config(config, shard_of(config, 1, 2))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (3, 1, 768, 49152)
    # Which rows or columns of each tensor rank 1 reads: D = 64.
    shard = shard_of(config, 1, 2)
    assert slice_of("model.layers.3.self_attn.q_proj.weight", config, shard) == (0, 384, 576)
    assert slice_of("model.layers.3.self_attn.k_proj.weight", config, shard) == (0, 128, 192)
    assert slice_of("model.layers.3.self_attn.v_proj.bias", config, shard) == (0, 128, 192)
    assert slice_of("model.layers.3.self_attn.o_proj.weight", config, shard) == (1, 384, 576)
    assert slice_of("model.layers.3.mlp.up_proj.weight", config, shard) == (0, 768, 1536)
    assert slice_of("model.layers.3.mlp.down_proj.weight", config, shard) == (1, 768, 1536)
    assert slice_of("lm_head.weight", config, shard) == (0, 24576, 49152)
    for whole in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.3.input_layernorm.weight",
                  "model.layers.3.self_attn.o_proj.bias", "model.layers.3.self_attn.q_norm.weight"):
        assert slice_of(whole, config, shard) is None, whole


def test_key_value_heads_replicated_past_hkv():
    # H = 8, Hkv = 2 on 4 ranks: each key/value head on 2 ranks, which split its 4 query heads.
    config = config_of(num_heads=8, num_kv_heads=2, intermediate_size=128)
    shards = [shard_of(config, r, 4) for r in range(4)]
    assert [(s.kv_heads, s.q_heads) for s in shards] == [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (4, 6)),
                                                        ((1, 2), (6, 8))]
    assert [s.mlp for s in shards] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [s.vocab for s in shards] == [(0, 25), (25, 49), (49, 73), (73, 97)]  # 97 = 25 + 3 x 24
    one = config_of(num_heads=4, num_kv_heads=1)  # Hkv = 1 on 2 ranks
    assert [(shard_of(one, r, 2).kv_heads, shard_of(one, r, 2).q_heads) for r in (0, 1)] == [((0, 1), (0, 2)),
                                                                                            ((0, 1), (2, 4))]


def test_splits_that_do_not_exist_are_refused_by_number():
    with pytest.raises(ValueError, match="tensor_parallel_size=8 exceeds the model's 4 attention heads"):
        shard_of(config_of(), 0, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds num_key_value_heads=2 without being a multiple"):
        shard_of(config_of(num_heads=6, intermediate_size=96), 0, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds intermediate_size=64 in units of 32"):
        shard_of(config_of(num_heads=4, num_kv_heads=4), 0, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: Phi3ForCausalLM's checkpoints hold q/k/v and "
                                         r"gate/up fused \(qkv_proj, gate_up_proj\)"):
        shard_of(config_of(architecture="Phi3ForCausalLM"), 0, 2)
    assert shard_of(config_of(architecture="Phi3ForCausalLM"), 0, 1) == shard_of(config_of(), 0, 1)  # one rank: whole
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="compile=True with tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, compile=True)


def test_cpu_share():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    # One node (this machine): nothing pinned, the cores divided.
    assert cpu_share(1, 2, {0, 1}, [{0, 1}]) == (None, 1)
    assert cpu_share(0, 2, {0, 1, 2, 3}, [{0, 1, 2, 3}], threads=3) == (None, 3)
    # Two nodes, four ranks: ranks 0-1 on node 0, 2-3 on node 1, each half a node's CPUs.
    nodes = [set(range(0, 8)), set(range(8, 16))]
    assert [cpu_share(r, 4, set(range(16)), nodes) for r in range(4)] == [
        (nodes[0], 4), (nodes[0], 4), (nodes[1], 4), (nodes[1], 4)]
    # A node this process may not use is not one to pin to.
    assert cpu_share(0, 2, set(range(8)), nodes) == (None, 4)


# ---- the step plan -----------------------------------------------------------------------------------


def test_plan_round_trip_every_field():
    mask = torch.tensor([[[[True, False, True, True]]]])
    windowed = AttentionMetadata(torch.tensor([7]), [DecodeGroup(None, torch.tensor([[3]]), None)], [], 4, 2)
    inputs = ModelInputs(
        input_ids=torch.tensor([5, 6, 7, 8, 9]), positions=torch.tensor([0, 1, 2, 9, 4]),
        logits_indices=torch.tensor([2, 3, 4]),
        attn=AttentionMetadata(
            slot_mapping=torch.tensor([0, 1, 2, 41, 17]),
            decode_groups=[DecodeGroup(torch.tensor([3]), torch.tensor([[10, 11, 12]]), None),
                           DecodeGroup(torch.tensor([4]), torch.tensor([[4]]), mask)],
            prefill_runs=[PrefillRun(0, 3, None, None)], block_size=4, sliding_window=2, windowed=windowed),
    )
    plan = encode(inputs)
    assert plan.dtype == torch.uint8 and plan.numel() % 8 == 0
    back = decode(plan.clone(), "cpu")

    def same(a, b, where="inputs"):
        assert type(a) is type(b), where
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), where
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{where}[{i}]")
        elif dataclasses.is_dataclass(a):
            for f in dataclasses.fields(a):
                same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        else:
            assert a == b, where

    same(inputs, back)
    with pytest.raises(TypeError, match="a plan cannot carry str"):
        encode(ModelInputs("ids", inputs.positions, inputs.logits_indices, inputs.attn))


# ---- TP=2 against TP=1 on tiny checkpoints -----------------------------------------------------------


def save_char_tokenizer(directory: Path, vocab_size: int) -> None:
    """A one-character-a-token fast tokenizer (ids 0-2 special) that AutoTokenizer loads offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>" if i < 3 else chr(33 + i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>", bos_token="<1>",
                            eos_token="<2>").save_pretrained(directory)


def tiny_checkpoint(directory: Path, family: str = "llama", gguf_types: dict | None = None, **overrides) -> Path:
    """A tiny random model of `family` (TINY | overrides) saved as safetensors with a tokenizer, or
    as a GGUF whose matrices are stored in gguf_types."""
    hf = make_hf_model(family, seed=3, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    if gguf_types is not None:
        write_gguf_from_hf(directory / "m.gguf", hf, "llama", gguf_types)
        return directory / "m.gguf"
    hf.save_pretrained(directory)
    save_char_tokenizer(directory, TINY["vocab_size"])
    return directory


def tiny_config(tensor_parallel_size: int = 1, **overrides) -> EngineConfig:
    # The ranks run torch's quantized kernels, exact in float32; a one-process engine may take blockdot,
    # whose float path is exact alike (its int16 path rounds x: not what these tests compare). Not the
    # batch-invariant plan, which holds int4's head dense where the ranks hold it in int8.
    return engine_config(**({"dtype": "float32", "quantization": None, "block_size": 4, "num_kv_blocks": 80,
                            "max_num_seqs": 4, "tensor_parallel_size": tensor_parallel_size,
                            "tensor_parallel_timeout_s": 20.0, "blockdot_int16_rows": None,
                            "batch_invariant": False} | overrides))


def worker_processes() -> list[psutil.Process]:
    """This process's descendants that run a tensor-parallel worker, read from the process table."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """Every test here ends with no worker process of this one alive."""
    yield
    deadline = time.monotonic() + 10
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_processes() == []


Q_BLOCKS = {"token_embd": QT.Q8_0, "attn_q": QT.Q4_1, "attn_k": QT.Q8_0, "attn_v": QT.Q4_0, "attn_output": QT.Q4_1,
            "ffn_gate": QT.Q4_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_1, "output": QT.Q8_0}
CASES = {  # name: (family, hf overrides, GGUF types or None for safetensors, engine quantization)
    "gqa-untied": ("llama", {}, None, None),
    "hkv1-replicated-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}, None, None),
    "hkv3-uneven": ("llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3,
                              "intermediate_size": 96}, None, None),
    "int4": ("llama", {"head_dim": 16}, None, "int4"),
    "gguf-blocks-dequantized": ("llama", {"head_dim": 16}, Q_BLOCKS, None),
    "gguf-blocks-kernels": ("llama", {"head_dim": 16}, Q_BLOCKS, "keep"),
} | {  # the families' switches: biases split with their rows, per-head norms and o's bias whole
    name: (*FAMILIES[name], None, None) for name in ("llama-bias", "qwen2-window", "qwen3", "gemma2")
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_logits_equal_tp1(tmp_path, monkeypatch, case):
    family, overrides, gguf_types, quantization = CASES[case]
    path = tiny_checkpoint(tmp_path, family, gguf_types, **overrides)
    if quantization == "keep":  # the file's blocks in the int4 kernels: "auto" with a probe that favours them
        monkeypatch.setattr(precision, "probe_cpu", fake(1.0, 2.0, int4_ms=0.01, dense_ms=1.0))
    config = {"quantization": "auto" if quantization == "keep" else quantization}
    # one process's cache in float32, as the ranks' (kv_cache_dtype "auto" would make it float16 where
    # its int4 runs on blockdot; the ranks keep torch's kernels)
    with Engine.from_pretrained(path, tiny_config(**config, kv_cache_dtype="float32")) as one:
        assert one.plan.quantization == quantization
        want, want_outputs = run_and_capture(one, PROMPTS, max_tokens=6)
    with Engine.from_pretrained(path, tiny_config(2, **config)) as two:
        assert isinstance(two.model, TensorParallelModel) and len(worker_processes()) == 1
        assert two.model.fused_layers is None  # every rank runs decoder_layer, as the workers do
        got, got_outputs = run_and_capture(two, PROMPTS, max_tokens=6)
        stats = two.model.group.stats
        # Each step: one plan, one all-reduce after o and one after down in every layer, one gather.
        num_layers = two.model.config.num_layers
        assert (stats.num_plans, stats.num_all_reduces, stats.num_gathers) == (
            two.num_steps, 2 * num_layers * two.num_steps, two.num_steps)
        heads = overrides.get("num_attention_heads", TINY["num_attention_heads"])
        assert two.model.config.num_heads < heads  # rank 0 holds a share of the heads
    assert [o.token_ids for o in got_outputs] == [o.token_ids for o in want_outputs]
    assert got.keys() == want.keys()
    for request_id, rows in want.items():
        assert [n for n, _ in got[request_id]] == [n for n, _ in rows]
        for (_, a), (_, b) in zip(rows, got[request_id], strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(tmp_path):
    path = tiny_checkpoint(tmp_path)  # H = 4, Hkv = 2
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds num_key_value_heads=2"):
        Engine.from_pretrained(path, tiny_config(3))
    assert worker_processes() == []
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but the model is split over 1 process"):
        Engine(Engine.from_pretrained(path, tiny_config()).model, None, tiny_config(2))


# ---- the batch-invariant plan across ranks ---------------------------------------------------------------

# Its paths for the ranks: blockdot's int4 with x rounded to int16 from one row in bf16, and dense
# panels in float32; 3 ranks (6 heads over 3 key/value heads) sum each partial over more than two.
# int4 reads groups of 32: a rank's share of o's input (its heads' H_r D) must be a multiple. Gemma 3's
# sandwich norms (on o's and down's sums over the ranks), GELU gate and windowed layers' own rope table.
INVARIANT_CASES = {
    "tp2-bf16-int4": (2, "llama", {"head_dim": 16}, {"dtype": "bfloat16", "quantization": "int4"}),
    "tp2-float32-dense": (2, "llama", {}, {"dtype": "float32", "quantization": None, "batch_invariant": True}),
    "tp3-float32-int4": (3, "llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                                      "head_dim": 16, "intermediate_size": 96},
                         {"dtype": "float32", "quantization": "int4"}),
    "tp2-gemma3-float32-dense": (2, "gemma3", {"sliding_window": 6, "sliding_window_pattern": 2,
                                               "query_pre_attn_scalar": 12, "rope_local_base_freq": 100.0},
                                 {"dtype": "float32", "quantization": None, "batch_invariant": True}),
}


def invariant_config(tensor_parallel_size: int, path: dict, **fields) -> EngineConfig:
    return tiny_config(tensor_parallel_size, **({"batch_invariant": "auto", "blockdot_int16_rows": 1,
                                                 "num_kv_blocks": 400, "max_num_seqs": 8} | path | fields))


@needs_build
@pytest.mark.parametrize("case", sorted(INVARIANT_CASES))
def test_ranks_answer_a_request_as_it_is_answered_alone_under_any_load(tmp_path, case):
    # test_batch_invariance's hard load (chunks of 5 tokens, prefix-cache hits, preemption, deferred
    # output, greedy and seeded rows) on every rank: each request's tokens and logprobs (the exact
    # floats) are those of the request alone in a quiet engine of the same ranks.
    size, family, overrides, path = INVARIANT_CASES[case]
    checkpoint = tiny_checkpoint(tmp_path, family, None, **overrides)
    with Engine.from_pretrained(checkpoint, invariant_config(size, path, max_num_seqs=6, max_num_batched_tokens=5,
                                                             num_kv_blocks=48, deferred_output=True)) as busy:
        plan = busy.plan
        assert plan.is_batch_invariant and plan.decode == plan.mixed == "c-tensor-parallel", plan.render()
        assert all(m.form.name in ("blockdot", "dense-panels") for m in plan.matrices)
        assert len(worker_processes()) == size - 1
        finals = run_load(busy, HARD_LOAD)
        stats = busy.model.group.stats
        assert stats.num_all_reduces == 2 * busy.model.config.num_layers * busy.num_steps
    assert sum(f.num_preemptions for f in finals.values()) > 0
    assert sum(f.num_cached_tokens for f in finals.values()) > 0
    with Engine.from_pretrained(checkpoint, invariant_config(size, path, max_num_seqs=1,
                                                             enable_prefix_caching=False)) as alone:
        for n, (index, sampled, _) in enumerate(HARD_LOAD):
            (quiet,) = alone.generate([INVARIANT_PROMPTS[index]], invariant_params(index, sampled))
            assert answer(finals[n]) == answer(quiet), (n, index, sampled)


# ---- failures, and the end of every process ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_killed_worker_fails_the_next_step_at_once_and_close_leaves_no_process(tiny_path):
    engine = Engine.from_pretrained(tiny_path, tiny_config(2, tensor_parallel_timeout_s=5.0))
    (worker,) = worker_processes()
    assert engine.generate([[5, 6, 7]], greedy(3))[0].token_ids  # it runs
    worker.kill()
    while worker.status() != psutil.STATUS_ZOMBIE:  # dead; its parent (this process) reaps it, not psutil
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=rf"worker rank 1 \(pid {worker.pid}\) exited with signal 9"):
        engine.generate([[5, 6, 7]], greedy(3))
    assert time.monotonic() - start < 5.0
    with pytest.raises(WorkerFailure, match="exited with signal 9"):  # the group stays broken
        engine.step()
    engine.close()
    engine.close()  # idempotent


def test_hung_worker_fails_the_step_within_the_timeout(tiny_path):
    engine = Engine.from_pretrained(tiny_path, tiny_config(2, tensor_parallel_timeout_s=2.0))
    (worker,) = worker_processes()
    engine.generate([[5, 6, 7]], greedy(2))
    worker.suspend()  # SIGSTOP: alive, never answering
    try:
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="no worker process has exited: a collective waited past the 2 s timeout"):
            engine.generate([[5, 6, 7]], greedy(2))
        assert 1.5 < time.monotonic() - start < 2.0 + 3.0
    finally:
        engine.close()  # kills the stopped worker


def test_a_fault_in_rank_0s_forward_breaks_the_group_at_once_and_is_fatal(tiny_path):
    # The plan is out, so the worker waits in the step's all-reduces: the step must not be taken
    # for a recoverable one (the next step would stall for the timeout, then fail anyway).
    engine = Engine.from_pretrained(tiny_path, tiny_config(2, tensor_parallel_timeout_s=30.0))
    try:
        engine.add_request([5, 6, 7], greedy(3))

        def boom(*args):
            raise RuntimeError("injected into rank 0's layer")

        engine.model.drivers = dict.fromkeys(engine.model.drivers, boom)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="rank 0's own forward raised.*injected into rank 0's layer") as e:
            engine.step()
        assert time.monotonic() - start < 5.0
        with pytest.raises(RuntimeError, match="cannot recover"):
            engine.fail_step(e.value)
    finally:
        engine.close()


def test_no_worker_left_after_an_exception_in_the_constructor_or_the_with_block(tiny_path):
    # max_model_len past the model's 256 positions: the engine refuses after the workers loaded.
    with pytest.raises(ValueError, match="max_model_len=1000 exceeds the model's 256 positions"):
        Engine.from_pretrained(tiny_path, tiny_config(2, max_model_len=1000))
    assert worker_processes() == []
    with pytest.raises(RuntimeError, match="inside the block"), Engine.from_pretrained(tiny_path, tiny_config(2)):
        assert len(worker_processes()) == 1
        raise RuntimeError("inside the block")
    assert worker_processes() == []


def test_a_worker_that_fails_to_start_is_named_with_its_error(tmp_path):
    # H = 6 of D = 8 over Hkv = 3: rank 0's o holds 4 heads (32 columns), rank 1's 2 (16 columns),
    # which int4's groups of 32 cannot take: only rank 1 fails, laying its shard out.
    path = tiny_checkpoint(tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    with pytest.raises(WorkerFailure, match=r"(?s)tensor-parallel rank 1 failed at ready:.*this matrix has K=16"):
        Engine.from_pretrained(path, tiny_config(2, quantization="int4"))


# ---- the real default model --------------------------------------------------------------------------


@pytest.mark.weights
def test_default_model_tp2_greedy_tokens_equal_tp1_under_preemption_and_chunked_prefill(default_model_dir):
    from nanoserve.model.default import gguf_path

    prompts = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "def fib(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # 8 blocks of 4 tokens for 4 requests of ~22 tokens: preemption; 8 tokens a step: chunked prefill.
    config = {"dtype": "float32", "quantization": None, "num_kv_blocks": 8, "block_size": 4, "max_num_seqs": 4,
              "max_num_batched_tokens": 8}
    with Engine.from_pretrained(gguf_path(), engine_config(**config)) as one:
        want = one.generate(prompts, params)
    with Engine.from_pretrained(gguf_path(), engine_config(**config, tensor_parallel_size=2)) as two:
        got = two.generate(prompts, params)
        assert two.kv.k.shape[2] == 2  # rank 0's KV cache holds 2 of the 3 key/value heads
    assert sum(o.num_preemptions for o in got) > 0, "the small pool was meant to force preemption"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# ---- serving -----------------------------------------------------------------------------------------------


@pytest.mark.weights
def test_server_with_tensor_parallel_size_2_answers_the_openai_client_and_leaves_no_process(
        default_engine, tmp_path):
    openai = pytest.importorskip("openai")
    prompt = "The capital of France is"
    (want,) = default_engine.generate([prompt], greedy(12, ignore_eos=False))
    with running_server(tmp_path, "--tensor-parallel-size", "2") as server:
        workers = [p for p in psutil.Process(server.proc.pid).children() if WORKER in " ".join(p.cmdline())]
        assert len(workers) == 1
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    assert [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE] == []


def test_torchrun_serves_with_rank_0_over_http(tiny_path, tmp_path):
    openai = pytest.importorskip("openai")
    torchrun = Path(sys.executable).with_name("torchrun")
    with Engine.from_pretrained(tiny_path, tiny_config()) as one:
        (want,) = one.generate(["abcdef"], greedy(8))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    launcher = (str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m")
    with running_server(tmp_path, "--model", str(tiny_path), env=env, launcher=launcher) as server:
        ranks = psutil.Process(server.proc.pid).children()
        assert len(ranks) == 2  # torchrun's two ranks: rank 0 serves, rank 1 is the worker
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=tiny_path.name, prompt="abcdef", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    assert [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


# ---- NCCL ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 CUDA devices; none here")
def test_nccl_tp2_logits_equal_tp1(tmp_path):
    path = tiny_checkpoint(tmp_path)
    with Engine.from_pretrained(path, tiny_config(device="cuda")) as one:
        want, _ = run_and_capture(one, PROMPTS, max_tokens=4)
    with Engine.from_pretrained(path, tiny_config(2, device="cuda")) as two:
        got, _ = run_and_capture(two, PROMPTS, max_tokens=4)
    for request_id, rows in want.items():
        for (_, a), (_, b) in zip(rows, got[request_id], strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)

