"""GGUF files as a llama.cpp user has them, written by llama.cpp's own tools: `convert_hf_to_gguf.py`
(with its gguf-py) from tiny random checkpoints, and `llama-quantize` to every file type. Each file's
tensors are held to gguf-py's dequantization, and its logits, served by nanoserve, to transformers'
model over the same file (transformers dequantizes GGUF itself). A Llama 3.2-shaped checkpoint, whose
rope scaling the converter writes as the tensor rope_freqs.weight, is held to transformers on the
original checkpoint, token for token; so are Qwen2, Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, Phi-3 and
SmolLM3 checkpoints (with a small SentencePiece tokenizer trained in the test: Gemma's converter reads
no other kind, and the others' refuse the default model's BPE tokenizer under a Qwen or Mistral
config), and their
Q4_K_M files to transformers over the same file where transformers reads that architecture.

The tools come from peerbench's set-up (`python -m benchmarks.peerbench.llamacpp --setup-quantize`, or
the whole `python -m benchmarks.peerbench --setup-llamacpp`: the pinned llama-cpp-python sdist's
llama.cpp, built under .peers/ or $NANOSERVE_PEERS); where they are absent these tests skip and say
so. tests/test_gguf_types.py holds every type to gguf-py without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import LLAMA3_ROPE, config_of, make_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_precision import fake
from test_untrusted_files import gguf_logits, mutated, reader_parts, refused_or_unchanged

from benchmarks.peerbench.llamacpp import LLAMA_CPP_VERSION, QUANTIZE
from benchmarks.peerbench.llamacpp import PEERS_DIR as PEERS
from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.model import blockdot, default
from nanoserve.model.config import LlamaConfig
from nanoserve.model.gguf import load_gguf, load_tensor, read_gguf_file
from nanoserve.model.llama import MATMULS, LlamaModel
from nanoserve.model.plan import check_laid_out, resolve_plan
from nanoserve.model.prepare import prepare_model

ROOT = Path(__file__).resolve().parent.parent
VENDOR = PEERS / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"  # the converter and gguf-py
# The file types a llama.cpp user quantizes to (llama-quantize's names), each a mix of block types.
FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q3_K_M", "Q2_K", "Q4_K_S", "Q5_0", "Q5_1", "IQ4_NL",
              "Q4_0")

needs_tools = pytest.mark.skipif(
    not (QUANTIZE.is_file() and VENDOR.is_dir() and default.is_available()),
    reason=f"llama.cpp's converter and llama-quantize are not built in {PEERS} (python -m "
           "benchmarks.peerbench.llamacpp --setup-quantize) or the default model's tokenizer is not installed")


def convert(checkpoint: Path, out: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a saved checkpoint, in float32."""
    env = os.environ | {"PYTHONPATH": f"{VENDOR / 'gguf-py'}{os.pathsep}{PEERS / 'pylib'}"}
    done = subprocess.run([sys.executable, str(VENDOR / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
                           "--outfile", str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def quantize(f32: Path, file_type: str) -> Path:
    out = f32.with_name(f"{f32.stem}-{file_type}.gguf")
    subprocess.run([str(QUANTIZE), str(f32), str(out), file_type], check=True, capture_output=True)
    return out


def save_checkpoint(hf, folder: Path) -> Path:
    """The model saved with the default model's tokenizer (the converter needs a tokenizer it knows)."""
    hf.save_pretrained(folder)
    source = default.default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama whose widths are multiples of 256 (so the K-quant tensors are real K-quants),
    converted and quantized to every FILE_TYPES."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", seed=41, vocab_size=49152, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    f32 = convert(save_checkpoint(hf, folder / "hf"), folder / "tiny-f32.gguf")
    return {"F32": f32} | {t: quantize(f32, t) for t in FILE_TYPES}


@needs_tools
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_every_tensor_of_a_quantized_file_equals_gguf_pys(tiny_files, file_type):
    parsed = read_gguf_file(tiny_files[file_type])
    kinds = set()
    for name, tensor in parsed.tensors.items():
        kind = parsed.type_name(name)
        kinds.add(kind)
        qtype = gguf.GGMLQuantizationType(tensor.type_id)
        value = load_tensor(parsed, name)
        ours = value.dequantize().numpy() if hasattr(value, "dequantize") else value.float().numpy()
        reference = gguf.quants.dequantize(np.asarray(parsed.data(name)), qtype).astype(np.float32)
        np.testing.assert_array_equal(ours.reshape(reference.shape), reference, err_msg=f"{name} ({kind})")
    assert kinds - {"F32"}, "the file holds quantized tensors"


def _hf_from_gguf(file: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()


PROMPT = [1, 504, 3303, 314, 253, 1345, 2617, 30, 378, 2060, 314]


@needs_tools
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q6_K", "IQ4_XS", "Q3_K_M"])
def test_a_quantized_file_serves_transformers_logits_over_the_same_file(tiny_files, file_type):
    assert_serves_transformers_logits(tiny_files[file_type], PROMPT)


def assert_serves_transformers_logits(file: Path, prompt: list[int], hf=None) -> None:
    """On the exact path, transformers' top-5 tokens and log-probabilities over the same file (1e-4);
    on the default path (the file's blocks on nanoserve's kernels), its first token. hf: transformers'
    model holding the file's weights (default: as transformers reads the file)."""
    hf = _hf_from_gguf(file) if hf is None else hf
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    config, tensors = load_gguf(file)
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    want = torch.log_softmax(expected.double(), -1).topk(5)
    for chosen in ({"dtype": "float32", "quantization": None}, {}):
        engine = Engine(model, None, EngineConfig(block_size=16, num_kv_blocks=16, **chosen))
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
        top = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1])[:5]
        if chosen:
            assert [t for t, _ in top] == want.indices.tolist()
            for (_, got), logprob in zip(top, want.values.tolist(), strict=True):
                assert abs(got - logprob) < 1e-4
        else:
            assert out.token_ids[0] == want.indices[0].item(), engine.plan.render()


@needs_tools
def test_a_llama_3_2_file_is_token_identical_to_transformers_on_its_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    # Llama 3.2's rope: theta 500000 and llama3 frequency scaling (a short original context, so a
    # tiny model's positions reach the scaled band), tied embeddings, head_dim 64.
    hf = make_hf_model("llama", seed=43, vocab_size=49152, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                       rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), max_position_embeddings=512)
    folder = save_checkpoint(hf, tmp_path / "hf")
    file = convert(folder, tmp_path / "llama32-f32.gguf")
    parsed = read_gguf_file(file)
    assert "rope_freqs.weight" in parsed.tensors  # the converter's form of Llama 3.x scaling
    config, tensors = load_gguf(file)
    assert config.rope_freq_factors is not None and max(config.rope_freq_factors) == LLAMA3_ROPE["factor"]
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=16, num_kv_blocks=64))
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [PROMPT, PROMPT[:3] * 20, list(range(100, 180))]  # up to 80 tokens: past the original context of 32
    for prompt in prompts:
        with torch.no_grad():
            want = original.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        assert list(out.token_ids) == want


# Tiny checkpoints of the other families, hidden sizes a multiple of 256 so the K-quant tensors are
# real K-quants. Gemma's head_dim of 256 makes llama.cpp's query scale (1 / sqrt(head_dim)) and
# transformers' (query_pre_attn_scalar, 256 by default and absent from the file) the same.
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            tie_word_embeddings=True)
WIDE = WIDE | dict(vocab_size=1024)
FAMILIES = {
    "qwen2": WIDE,
    # transformers' GGUF loader leaves Qwen3's head_dim at its default of 128 (the file's key_length
    # unread), as every Qwen3 release has it
    "qwen3": WIDE | dict(head_dim=128),
    "mistral": WIDE | dict(sliding_window=None),
    "gemma": WIDE | dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256),
    "gemma2": WIDE | dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256),
    # llama.cpp's pattern of six (the converter writes none): layers 0-4 windowed on their own rope
    # base, layer 5 global on rope_theta slowed 8x
    "gemma3": WIDE | dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                          num_hidden_layers=6, sliding_window=16, rope_theta=10000.0, rope_local_base_freq=100.0,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # rope on half of each head's 64; LongRoPE past an original context of 8 (both prompts are
    # longer: transformers takes the long factors from their prefill on, as nanoserve does)
    "phi3": WIDE | dict(pad_token_id=0, partial_rotary_factor=0.5, sliding_window=24, max_position_embeddings=512,
                        original_max_position_embeddings=8,
                        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)],
                                      "long_factor": [1.0 + i for i in range(16)]}),
    "smollm3": WIDE | dict(pad_token_id=0, num_hidden_layers=4),  # layer 3 without rope
}
# transformers' GGUF loader reads these files' architectures ("llama" for Mistral's); not Gemma 1's.
HF_READS_GGUF = ("qwen2", "qwen3", "mistral", "gemma2")


def sentencepiece_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.model: a SentencePiece BPE model trained on the repository's docs; the converter pads
    its vocabulary to the model's `vocab_size`."""
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]))
    train = ("import sys, sentencepiece as spm; spm.SentencePieceTrainer.train(input=sys.argv[1], "
             "model_prefix=sys.argv[2], vocab_size=int(sys.argv[3]), model_type='bpe', hard_vocab_limit=False)")
    env = os.environ | {"PYTHONPATH": str(PEERS / "pylib")}
    subprocess.run([sys.executable, "-c", train, str(corpus), str(folder / "tokenizer"), str(vocab_size // 2)],
                   check=True, env=env, capture_output=True)


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (its checkpoint folder, the F32 file, the Q4_K_M file), each by llama.cpp's tools."""
    files = {}
    for family, overrides in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        hf = make_hf_model(family, seed=47, **overrides)
        checkpoint = folder / "hf"
        hf.save_pretrained(checkpoint)
        sentencepiece_tokenizer(checkpoint, overrides["vocab_size"])
        f32 = convert(checkpoint, folder / f"{family}-f32.gguf")
        files[family] = (checkpoint, f32, quantize(f32, "Q4_K_M"))
    return files


@needs_tools
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_file_is_token_identical_to_transformers_on_its_checkpoint(family_files, family):
    from transformers import AutoModelForCausalLM

    checkpoint, f32, _ = family_files[family]
    config, tensors = load_gguf(f32)
    hf_config = LlamaConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    if family == "mistral":  # llama.cpp writes Mistral as "llama", without its window
        hf_config = dataclasses.replace(hf_config, architecture="LlamaForCausalLM")
    for field in ("architecture", "head_dim", "num_kv_heads", "rope_theta", "hidden_act", "qkv_bias", "qk_norm",
                  "norm_offset", "embed_scale", "sandwich_norms", "query_pre_attn_scalar", "attn_logit_softcap",
                  "final_logit_softcap", "sliding_window", "sliding_layers", "tie_word_embeddings",
                  "partial_rotary_factor", "rope_local_theta", "no_rope_layers"):
        assert getattr(config, field) == getattr(hf_config, field), field
    ours, theirs = config.rope_scaling or {}, hf_config.rope_scaling or {}
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():  # LongRoPE's factors come back from float32 tensors
        assert value == (pytest.approx(theirs[key], rel=1e-6) if key != "rope_type" else theirs[key]), key
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=16, num_kv_blocks=64))
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt in ([t % 1000 for t in PROMPT], list(range(100, 160))):
        with torch.no_grad():
            want = original.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        assert len(want) >= 8 and list(out.token_ids)[:len(want)] == want  # transformers stops at its EOS


@needs_tools
@pytest.mark.parametrize("family", HF_READS_GGUF)
def test_a_family_k_quant_file_serves_transformers_logits_over_the_same_file(family_files, family):
    _, _, file = family_files[family]
    kinds = {read_gguf_file(file).type_name(name) for name in read_gguf_file(file).tensors}
    assert {"Q4_K", "Q6_K"} <= kinds, kinds
    assert_serves_transformers_logits(file, [t % 1000 for t in PROMPT])


@needs_tools
@pytest.mark.parametrize("family", ["gemma3", "phi3", "smollm3"])
def test_a_family_k_quant_file_serves_transformers_logits_on_its_weights(family_files, family):
    # Families whose files transformers' GGUF loader misreads (Gemma 3's local rope base, Phi-3's
    # LongRoPE) or does not read (SmolLM3): transformers' model of the checkpoint, its matrices
    # replaced by the file's as gguf-py dequantizes them.
    from transformers import AutoModelForCausalLM

    from nanoserve.model.gguf import architecture_of, hf_name

    checkpoint, _, file = family_files[family]
    parsed = read_gguf_file(file)
    assert {"Q4_K", "Q6_K"} <= {parsed.type_name(name) for name in parsed.tensors}
    _, spec = architecture_of(parsed)
    config = LlamaConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    state = {}
    for name, tensor in parsed.tensors.items():
        if name.startswith("rope_"):
            continue
        weights = gguf.quants.dequantize(np.asarray(parsed.data(name)), gguf.GGMLQuantizationType(tensor.type_id))
        hf_key = hf_name(name, spec.names)
        state[hf_key] = spec.as_hf(hf_key, torch.from_numpy(weights.reshape(tensor.shape).astype(np.float32)),
                                   config.head_dim)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    assert_serves_transformers_logits(file, [t % 1000 for t in PROMPT], hf)


@needs_tools
@pytest.mark.skipif(blockdot.library() is None, reason=f"no blockdot build here: {blockdot.failure()}")
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS"])
def test_every_matrix_of_a_mixed_file_runs_on_blockdot_as_stored(tiny_files, file_type):
    # Where the probe keeps a file's blocks, none of its matrices is dequantized at load: a Q4_K q
    # beside a Q6_K v (Q4_K_M's qkv) and Q2_K's groups of 16 with mins run on the kernel too.
    config, tensors = load_gguf(tiny_files[file_type])
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    probe = fake(0.2, 14.0, int4_ms=0.05, blockdot_ms=0.01, dense_ms=1.0)

    def figures(kernel_dtype=None):
        return dataclasses.replace(probe(kernel_dtype), int4_stream_ms=0.05, blockdot_stream_ms=0.01)

    plan = resolve_plan(config_of(kernels="blockdot"), model, probe=figures)
    forms = {(i, name): plan.form_of(i, name).name for i in range(config.num_layers) for name in MATMULS}
    kinds = {getattr(layer, name).kind for layer in model.layers for name in MATMULS}
    # Q4_K, Q6_K and IQ4_XS matrices (and IQ4_NL, Q5_0, Q5_1, Q8_0) at their file's bits on int8 activations
    # (Q4_K_M's qkv, q and k in Q4_K stacked beside a Q6_K v, too), the rest on blockdot's panels
    file_bits = {(i, name): "blockdot-int8" if blockdot.takes_int8(getattr(layer, name)) else "blockdot"
                 for i, layer in enumerate(model.layers) for name in MATMULS}
    assert forms == file_bits, (forms, plan.reasons)
    assert file_type not in ("Q4_K_M", "IQ4_XS") or set(forms.values()) == {"blockdot-int8"}, kinds
    assert any("+" in kind for kind in kinds) or file_type in ("Q2_K", "IQ4_XS"), kinds  # a stacked mix among them
    assert check_laid_out(prepare_model(model, plan), plan) == []


@pytest.fixture(scope="module")
def narrow_files(tmp_path_factory) -> dict[str, Path]:
    """Two layers in the default model's shapes (hidden 576 = 18 x 32, no whole super-block of 256;
    intermediate 1536), quantized by llama-quantize to IQ4_XS and Q4_K_M: their 576-wide matrices fall
    back to the 32-weight kinds (IQ4_NL; Q5_0 and Q8_0), the down projections stay K-quants."""
    folder = tmp_path_factory.mktemp("narrow-llama")
    hf = make_hf_model("llama", seed=47, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       tie_word_embeddings=True)
    f32 = convert(save_checkpoint(hf, folder / "hf"), folder / "narrow-f32.gguf")
    return {t: quantize(f32, t) for t in ("IQ4_XS", "Q4_K_M")}


@needs_tools
@pytest.mark.skipif(blockdot.library() is None, reason=f"no blockdot build here: {blockdot.failure()}")
@pytest.mark.parametrize("file_type", ["IQ4_XS", "Q4_K_M"])
def test_a_576_wide_files_32_weight_kinds_run_on_file_bit_panels(narrow_files, file_type):
    file = narrow_files[file_type]
    config, tensors = load_gguf(file)
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    kinds = {part for layer in model.layers for name in MATMULS for part in getattr(layer, name).kind.split("+")}
    assert kinds & set(blockdot.BLOCK_KINDS), kinds  # llama-quantize's fallbacks are in it
    engine = Engine(model, None, config_of(block_size=16, num_kv_blocks=16, kernels="blockdot"))
    forms = {engine.plan.form_of(i, name).name for i in range(config.num_layers) for name in MATMULS}
    assert forms == {"blockdot-int8"} and engine.plan.form_of(None, "head").name == "blockdot-int8", \
        engine.plan.render()
    assert_serves_transformers_logits(file, PROMPT)  # the first token: transformers' top-1 over the same file
    # and the same greedy tokens as blockdot's int8-code panels (x rounded to int16) on the same file
    codes = Engine(model, None, config_of(block_size=16, num_kv_blocks=16, kernels="blockdot", blockdot_int8=False))
    assert "blockdot-int8" not in {codes.plan.form_of(0, name).name for name in MATMULS}, codes.plan.render()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate([PROMPT], greedy)[0].token_ids == codes.generate([PROMPT], greedy)[0].token_ids


@needs_tools
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q2_K"])
def test_a_quantized_file_serves_text_through_from_pretrained(tiny_files, file_type):
    # what `nanoserve serve --model FILE.gguf` builds: the engine, the file's own tokenizer, a text prompt
    engine = Engine.from_pretrained(tiny_files[file_type], EngineConfig(block_size=16, num_kv_blocks=32))
    (out,) = engine.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
    assert len(out.token_ids) == 4 and out.text == engine.tokenizer.decode(out.token_ids)
    assert engine.allocator.num_free == 32  # every block back in the pool


@needs_tools
@pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")
def test_a_q4_k_m_files_answers_on_the_invariant_plan_do_not_change_with_the_load(tiny_files):
    # test_batch_invariance's hard load (chunks of 5 tokens, prefix-cache hits, preemption, deferred
    # output, greedy and seeded rows) on a converter-written Q4_K_M file, its matrices at the file's
    # bits on int8 activations; each request's tokens and logprobs must equal its run alone. Where the
    # CPU has AMX tiles, the runs alone take them at every step (from 1 row) and the load never does
    # (blockdot_amx_rows=False): the tiles must not change a token or a logprob either.
    from test_batch_invariance import HARD_LOAD, PROMPTS, answer, params, run_load

    from nanoserve.model import blockdot

    tiles = {"blockdot_amx_rows": 1 if blockdot.amx() else False}

    def engine(**fields) -> Engine:
        built = Engine.from_pretrained(tiny_files["Q4_K_M"], config_of(
            **{"block_size": 4, "num_kv_blocks": 400, "max_num_seqs": 8, "max_num_batched_tokens": 512,
               "batch_invariant": True} | fields))
        assert built.plan.is_batch_invariant and built.plan.kernels == "blockdot-int8", built.plan.render()
        return built

    alone = engine(max_num_seqs=1, enable_prefix_caching=False, **tiles)
    assert alone.plan.amx_rows == (1 if blockdot.amx() else None)
    quiet = {(index, sampled): answer(alone.generate([PROMPTS[index]], params(index, sampled))[0])
             for index, sampled, _ in set(HARD_LOAD)}
    finals = run_load(engine(max_num_seqs=6, max_num_batched_tokens=5, num_kv_blocks=48, deferred_output=True,
                             blockdot_amx_rows=False), HARD_LOAD)
    assert sum(f.num_preemptions for f in finals.values()) > 0
    assert sum(f.num_cached_tokens for f in finals.values()) > 0
    assert [answer(finals[n]) for n in range(len(HARD_LOAD))] == [quiet[index, sampled]
                                                                   for index, sampled, _ in HARD_LOAD]


_ORIGINAL: dict[Path, tuple[torch.Tensor, list]] = {}  # a file's logits and header numbers, found once


@needs_tools
@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_converter_file_is_refused_or_harmless(tiny_files, tmp_path, data):
    # tests/test_untrusted_files.py's header fuzz, over a file llama.cpp's own tools wrote
    file = tiny_files["Q4_K_M"]
    raw = file.read_bytes()
    if file not in _ORIGINAL:
        _ORIGINAL[file] = gguf_logits(file), reader_parts(raw, tmp_path / "original.gguf")
    original, parts = _ORIGINAL[file]
    what, offset, dtype = data.draw(st.sampled_from(parts), label="field")
    (tmp_path / "bad.gguf").write_bytes(mutated(raw, offset, dtype, data.draw(st.integers(0, 99), label="value")))
    refused_or_unchanged(tmp_path / "bad.gguf", original)
