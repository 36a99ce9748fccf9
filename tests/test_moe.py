"""The mixture-of-experts MLP (nanoserve.model.moe): its routing and grouped matmuls against a
row-by-row reference written here, and GGUF files of Qwen3-MoE and Mixtral written by llama.cpp's
converter and llama-quantize, served against transformers on the original checkpoint (F32) and on
gguf-py's dequantized tensors (Q4_K_M, which transformers' GGUF loader misreads: it leaves
moe_intermediate_size at its default), their stacked experts equal to gguf-py's dequantize.

The Q4_K_M files also run in fused_decode.c's one call (the invariant plan, x in float32), greedy
against transformers over their dequantized tensors. The families' logits and greedy tokens against
transformers are tests/test_families.py's; the sparse layer in C against transformers,
tests/test_fused_decode.py's and tests/test_plan.py's; batch invariance and speculative decoding on
an MoE model are tests/test_batch_invariance.py's and tests/test_speculative.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_model
from test_llamacpp_files import (
    VENDOR,
    assert_serves_transformers_logits,
    convert,
    needs_tools,
    quantize,
    save_checkpoint,
)

from nanoserve import Engine, EngineConfig, PlanOverrides, SamplingParams
from nanoserve.model.config import LlamaConfig
from nanoserve.model.forms import Dense
from nanoserve.model.gguf import FileBlocks, load_gguf, read_gguf_file
from nanoserve.model.llama import LlamaModel
from nanoserve.model.moe import MoeWeights, moe_mlp, route

# ---- the MLP against a row-by-row reference ----------------------------------------------------------


def tiny_moe(norm_topk_prob: bool, shared: bool, seed: int = 0) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    E, Ie, X = 16, 8, 5

    def w(*shape):
        return torch.randn(*shape, generator=g)

    extra = {"shared_gate_up": Dense(w(2 * 12, E)), "shared_down": Dense(w(E, 12)),
             "shared_gate": Dense(w(1, E))} if shared else {}
    return MoeWeights(Dense(w(X, E)), tuple(Dense(w(2 * Ie, E)) for _ in range(X)),
                      tuple(Dense(w(E, Ie)) for _ in range(X)), top_k=3, norm_topk_prob=norm_topk_prob, **extra)


def reference(x: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
    """One row at a time, in float64: softmax over the experts, the top 3 by probability, each
    expert's SwiGLU, summed by the (renormalised) probabilities; the shared expert by its sigmoid."""
    rows = []
    for row in x.double():
        probs = torch.softmax(moe.router.weight.double() @ row, dim=0)
        chosen = sorted(range(len(probs)), key=lambda j: -probs[j].item())[:3]
        weights = probs[chosen] / (probs[chosen].sum() if moe.norm_topk_prob else 1.0)
        out = torch.zeros_like(row)
        for j, weight in zip(chosen, weights, strict=True):
            gate, up = (moe.gate_up[j].weight.double() @ row).chunk(2)
            out += weight * (moe.down[j].weight.double() @ (F.silu(gate) * up))
        if moe.shared_gate_up is not None:
            gate, up = (moe.shared_gate_up.weight.double() @ row).chunk(2)
            shared = moe.shared_down.weight.double() @ (F.silu(gate) * up)
            out += torch.sigmoid(moe.shared_gate.weight.double() @ row) * shared
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_the_mixture_equals_a_row_by_row_reference(norm_topk_prob, shared):
    moe = tiny_moe(norm_topk_prob, shared)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe_mlp(x, moe).double(), reference(x, moe), atol=1e-4, rtol=1e-4)
    experts, weights = route(x, moe)
    assert experts.shape == weights.shape == (11, 3) and weights.dtype == torch.float32
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # best first: the order the sum runs in
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))


def test_a_rows_result_is_the_same_alone_and_beside_others():
    # Dense weights run on torch's matmul, which is not row-invariant: a row's result within rounding.
    moe = tiny_moe(True, True)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    together = moe_mlp(x, moe)
    for t in range(9):
        torch.testing.assert_close(moe_mlp(x[t:t + 1], moe)[0], together[t], atol=1e-5, rtol=1e-5)


# ---- GGUF files by llama.cpp's tools -------------------------------------------------------------------

# Widths multiples of 256 so Q4_K_M's tensors are K-quants; the default model's tokenizer (the
# converter reads Qwen's and Llama's vocabularies as GPT-2 BPE); weights 5x wider than transformers'
# init, so greedy text does not collapse onto one token.
WIDE = dict(vocab_size=49152, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            tie_word_embeddings=True, initializer_range=0.1)
GGUF_FAMILIES = {
    # llama.cpp renormalises Qwen3-MoE's top k weights always (as Qwen3-MoE's releases do)
    "qwen3_moe": WIDE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    "mixtral": WIDE | dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=256),  # written as "llama"
    # llama.cpp's converter maps no dense layer of Qwen2-MoE: every layer sparse
    "qwen2_moe": WIDE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                             shared_expert_intermediate_size=256, intermediate_size=256),
    "olmoe": WIDE | dict(num_experts=4, num_experts_per_tok=2, intermediate_size=256, eos_token_id=2, pad_token_id=0),
}
PROMPT = [1, 504, 3303, 314, 253, 1345, 2617, 30, 378, 2060, 314]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (its checkpoint folder, the F32 file, the Q4_K_M file)."""
    files = {}
    for family, overrides in GGUF_FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        checkpoint = save_checkpoint(make_hf_model(family, seed=53, **overrides), folder / "hf")
        f32 = convert(checkpoint, folder / f"{family}-f32.gguf")
        files[family] = (checkpoint, f32, quantize(f32, "Q4_K_M"))
    return files


def original(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@needs_tools
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_mixture_of_experts_file_is_token_identical_to_transformers_on_its_checkpoint(moe_files, family):
    checkpoint, f32, _ = moe_files[family]
    config, tensors = load_gguf(f32)
    hf_config = LlamaConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_layers", "shared_expert_intermediate_size", "qk_norm", "qk_norm_whole", "qkv_bias",
                  "head_dim", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf_config, field), field
    engine = Engine(LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu"), None,
                    EngineConfig(dtype="float32", quantization=None, block_size=16, num_kv_blocks=64))
    hf = original(checkpoint)
    for prompt in (PROMPT, list(range(100, 160))):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        assert len(want) >= 8 and list(out.token_ids)[:len(want)] == want
        assert len(set(want)) > 1  # text, not one token repeated


def gguf_py():
    sys.path.insert(0, str(VENDOR / "gguf-py"))
    import gguf

    return gguf


@needs_tools
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_stacked_experts_are_views_of_the_file_equal_to_gguf_pys_dequantize(moe_files, family):
    gguf = gguf_py()
    _, _, file = moe_files[family]
    parsed = read_gguf_file(file)
    _, tensors = load_gguf(file)
    prefix = "block_sparse_moe.experts.{j}.w" if family == "mixtral" else "mlp.experts.{j}."
    suffixes = ({"gate": "1", "up": "3", "down": "2"} if family == "mixtral"
                else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    kinds = set()
    for i in range(2):
        for part, suffix in suffixes.items():
            name = f"blk.{i}.ffn_{part}_exps.weight"
            kinds.add(parsed.type_name(name))
            stacked = gguf.quants.dequantize(np.asarray(parsed.data(name)),
                                             gguf.GGMLQuantizationType(parsed.tensors[name].type_id))
            stacked = stacked.reshape(parsed.tensors[name].shape)  # [X, N, K]
            experts = [tensors[f"model.layers.{i}." + prefix.format(j=j) + suffix + ".weight"] for j in range(4)]
            for j, expert in enumerate(experts):
                assert isinstance(expert, FileBlocks)
                np.testing.assert_array_equal(expert.dequantize().numpy(), stacked[j], err_msg=f"{name} expert {j}")
                (piece,) = expert.pieces  # expert j's rows of the stacked tensor, a view of the file's map: no copy
                rows = piece.file.data(name)
                N = rows.shape[0] // parsed.tensors[name].shape[0]
                view = rows[j * N:(j + 1) * N]
                assert (piece.raw.ctypes.data, piece.raw.shape) == (view.ctypes.data, view.shape)
    assert "Q4_K" in kinds, kinds


@needs_tools
@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.expert_used_count", 5, "num_experts_per_tok=5 must be an integer from 1 to 4"),
    ("qwen3moe.expert_used_count", 0, "num_experts_per_tok=0 must be an integer from 1 to 4"),
    ("qwen3moe.expert_count", 3, r"GGUF tensor 'blk.0.ffn_down_exps.weight' has shape \[4, 256, 256\], expected "
                                 r"\[3, 256, 256\]"),
    ("qwen3moe.expert_count", 2**20, f"num_experts={2**20} must be an integer from 1 to {2**12}"),
    ("qwen3moe.expert_feed_forward_length", 128, r"ffn_down_exps.weight. has shape \[4, 256, 256\], expected "
                                                 r"\[4, 256, 128\]"),
])
def test_a_file_whose_experts_disagree_with_its_metadata_is_refused_by_name(moe_files, tmp_path, key, value, message):
    from test_untrusted_files import with_value

    _, f32, _ = moe_files["qwen3_moe"]
    (tmp_path / "bad.gguf").write_bytes(with_value(f32.read_bytes(), tmp_path / "o.gguf", key, value))
    with pytest.raises(ValueError, match=message):
        load_gguf(tmp_path / "bad.gguf")


def dequantized_state_dict(file: Path, family: str) -> dict[str, torch.Tensor]:
    """The file's tensors by gguf-py's dequantize, under transformers' in-memory names (its fused
    experts [X, 2 Ie, E] and [X, E, Ie]), written out here from llama.cpp's tensor names."""
    gguf = gguf_py()
    parsed = read_gguf_file(file)

    def tensor(name: str) -> torch.Tensor:
        qtype = gguf.GGMLQuantizationType(parsed.tensors[name].type_id)
        values = gguf.quants.dequantize(np.asarray(parsed.data(name)), qtype)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(parsed.tensors[name].shape)  # a copy

    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
    out = {}
    for name in parsed.tensors:
        stem, suffix = name.rsplit(".", 1)  # suffix: weight or bias
        if stem in names:
            out[f"{names[stem]}.{suffix}"] = tensor(name)
        elif stem.split(".")[2] in layer:
            i = stem.split(".")[1]
            out[f"model.layers.{i}.{layer[stem.split('.')[2]]}.{suffix}"] = tensor(name)
    for key in [k for k in out if k.endswith("shared_expert_gate.weight")]:
        out[key] = out[key].reshape(1, -1)  # the file's [E], transformers' [1, E]
    for i in range(2):
        gate, up = tensor(f"blk.{i}.ffn_gate_exps.weight"), tensor(f"blk.{i}.ffn_up_exps.weight")
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = tensor(f"blk.{i}.ffn_down_exps.weight")
    if family == "mixtral":  # llama.cpp interleaves q's and k's rotary halves for "llama": undone here
        for i in range(2):
            for proj, heads in (("q_proj", 4), ("k_proj", 2)):
                w = out[f"model.layers.{i}.self_attn.{proj}.weight"]
                out[f"model.layers.{i}.self_attn.{proj}.weight"] = (
                    w.view(heads, 32, 2, 256).transpose(1, 2).reshape(heads * 64, 256))
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@needs_tools
@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_a_q4_k_m_file_serves_transformers_logits_over_its_dequantized_tensors(moe_files, family):
    checkpoint, _, file = moe_files[family]
    hf = original(checkpoint)
    hf.load_state_dict(dequantized_state_dict(file, family), strict=True)
    assert_serves_transformers_logits(file, PROMPT, hf)
    # and the default path ran the experts as stored, in fused_decode.c's one call where the family's
    # attention is there (OLMoE's is not)
    config, tensors = load_gguf(file)
    engine = Engine(LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu"), None,
                    EngineConfig(block_size=16, num_kv_blocks=16))
    assert engine.plan.form_of(0, "experts.gate_up").name in ("blockdot", "blockdot-int8"), engine.plan.render()
    assert engine.plan.drivers == ({"torch"} if family == "olmoe" else {"c-one-call"}), engine.plan.render()


@needs_tools
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_q4_k_m_file_in_the_one_call_is_token_identical_to_transformers_on_its_blocks(moe_files, family):
    # The invariant plan in float32, x never rounded (the file's blocks on blockdot's float path): every
    # step in the one call, its sparse layers included, against transformers over gguf-py's
    # dequantized tensors, greedy, several rows a step.
    checkpoint, _, file = moe_files[family]
    hf = original(checkpoint)
    hf.load_state_dict(dequantized_state_dict(file, family), strict=True)
    config, tensors = load_gguf(file)
    engine = Engine(LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu"), None,
                    EngineConfig(dtype="float32", block_size=16, num_kv_blocks=64, batch_invariant=True,
                                 overrides=PlanOverrides(blockdot_int8=False, blockdot_int16_rows=None)))
    assert engine.plan.drivers == {"c-one-call"} and engine.plan.form_of(0, "experts.gate_up").name == "blockdot"
    prompts = [PROMPT, list(range(100, 160)), PROMPT[3:]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        tokens = want.sequences[0, len(prompt):].tolist()
        assert len(tokens) == 16
        for step, (got, expected) in enumerate(zip(out.token_ids, tokens, strict=True)):
            if got != expected:  # only where transformers' own top two are within float32's sums of each other
                best, second = want.scores[step][0].topk(2).values.tolist()
                assert best - second < 2e-3, (step, got, expected, best - second)
                break


def test_tensor_parallelism_refuses_a_mixture_of_experts_before_any_process_starts():
    from nanoserve.model.shard import shard_of

    hf = make_hf_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    config = LlamaConfig.from_hf_dict(hf.config.to_dict())
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with a mixture-of-experts model "
                                         r"\(Qwen3MoeForCausalLM\): nanoserve does not cut experts across ranks"):
        shard_of(config, 0, 2)
    assert shard_of(config, 0, 1) is not None


def test_off_the_invariant_plan_a_mixture_decodes_in_c_and_the_plan_says_why():
    from conftest import CharTokenizer, config_of, nanoserve_model_from_hf

    from nanoserve.model import blockdot
    from nanoserve.model.driver import Driver

    hf = make_hf_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = config_of(dtype="bfloat16", quantization="int4", batch_invariant=False, block_size=4, num_kv_blocks=16)
    engine = Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), config)
    plan = engine.plan
    # the experts laid out as every other matrix of their width; the router dense in the plan's dtype
    assert plan.form_of(0, "experts.gate_up") == plan.form_of(0, "qkv")
    assert plan.form_of(0, "router").name in ("torch", "onednn") and plan.form_of(0, "router").dtype == "bfloat16"
    moe = engine.model.layers[0].moe
    assert [w.form for w in moe.gate_up + moe.down] == [plan.form_of(0, "experts.gate_up")] * 4 + [
        plan.form_of(0, "experts.down")] * 4
    if blockdot.library() is not None:  # decode steps in the one call, the sparse layers' MLP with them
        assert plan.decode == Driver.C_ONE_CALL and plan.mixed == Driver.TORCH
        assert "the sparse layers' MLP in the one call: routed in float32 in C" in plan.render()
        assert all(table is not None for table in engine.model.fused_layers.moe)
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4
    # OLMoE's norm over the whole q and k projections is not in fused_decode.c: its steps stay on torch
    olmoe = make_hf_model("olmoe", num_experts=4, num_experts_per_tok=2, eos_token_id=2, pad_token_id=0)
    engine = Engine(nanoserve_model_from_hf(olmoe), CharTokenizer(olmoe.config.vocab_size), config)
    assert engine.plan.drivers == {Driver.TORCH} and engine.model.fused_layers is None
    assert ("no C decode: the family's ['qk_norm_whole'] are not in fused_decode.c" in engine.plan.render()
            or blockdot.library() is None)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0]}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 24}),
    ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 2, "pad_token_id": 0}),
])
def test_a_saved_checkpoint_loads_its_per_expert_tensors_as_transformers_wrote_them(tmp_path, family, overrides):
    from safetensors import safe_open

    from nanoserve.model.weights import load_model

    hf = make_hf_model(family, seed=5, initializer_range=0.2, **overrides)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in stored)  # one per expert
    model = load_model(tmp_path, torch.float32, "cpu")
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=32))
    prompt = [5, 9, 13, 22, 7, 41, 3, 8, 60, 33, 21]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1).topk(5)
    top = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1])
    assert [t for t, _ in top] == expected.indices.tolist()
    for (_, got), want in zip(top, expected.values.tolist(), strict=True):
        assert abs(got - want) < 1e-4
