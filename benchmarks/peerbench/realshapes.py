"""Real-shape GGUF files for peerbench's precision axis: random weights in the layer shapes of the
models people run on CPUs, converted by llama.cpp's convert_hf_to_gguf.py and quantized by its
llama-quantize, so nanoserve and llama-batched-bench can be set against each other on one file.

- "qwen3-moe": Qwen3-30B-A3B's layers (Qwen3MoeForCausalLM: hidden 2048, 32 heads, 4 KV heads of
  128, 128 experts of width 768, top 8 renormalised, rope_theta 1e6, head untied), 8 of its 48.
  At Q4_K_M (a 3.16 GB file, 5.2B parameters) a token at one sequence reads 360 MB: 277 MB of the
  layers (95 MB of attention, router and norms, 183 MB for 8 of 128 experts) and 83 MB of head
  (Q6_K), so the layers dominate.
- "gemma3-1b": Gemma 3 1B's whole stack (Gemma3ForCausalLM: hidden 1152, 26 layers, 4 heads, one
  KV head of 256, MLP 6912, windows of 512 on five layers in six, local rope base 1e4, global 1e6).
- "phi4-mini": Phi-4-mini's whole stack (Phi3ForCausalLM: hidden 3072, 32 layers, 24 heads, 8 KV
  heads, MLP 8192, rope on 0.75 of each head, LongRoPE with Phi-4-mini's own factors, tied head).

Each takes the default model's tokenizer (49152 tokens; the converter reads it as GPT-2 BPE) in place
of the real vocabulary (151936, 262144, 200064), as precision.SHAPES' Llama-shaped files do: the
layers are real, the embedding and head are narrower than the real model's.

A checkpoint this size is never held in float32: the random weights are drawn tensor by tensor in
bfloat16 (normal with std initializer_range, 0.02, as transformers initializes; RMSNorm weights at
their initial value, 1, or 0 where the norm multiplies by 1 + w as Gemma's does), each drawn from
its own seed (the shape's seed and the tensor's name), written one safetensors shard per layer
under the names and shapes of transformers' own model's state dict (read from the model built on
the meta device). The converter then writes a BF16 GGUF, llama-quantize the requested type; the
checkpoint and the BF16 GGUF are deleted after (about 10 GB each for the MoE), only the quantized
file is kept under .peers/.

    python -m benchmarks.peerbench.realshapes qwen3-moe gemma3-1b phi4-mini   # make the Q4_K_M files
    python -m benchmarks.peerbench.realshapes --read-bytes FILE                 # a token's read bytes

`token_read_bytes` counts what one token reads at one sequence from a file's own tensor types:
every tensor once except the token embedding (one row), and of each stacked expert tensor only
top-k of its X experts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import zlib
from pathlib import Path

from benchmarks.peerbench.llamacpp import BATCHED_BENCH, PEERS_DIR, convert_checkpoint

QUANTIZE = BATCHED_BENCH.parent / "llama-quantize"
TOKENS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}  # the default tokenizer's

# Phi-4-mini-instruct's LongRoPE factors (its config.json): one per pair of its 96 rotary dimensions.
PHI4_MINI_LONG_FACTOR = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
    5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
    14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
    32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

# name -> (transformers' config class, its arguments, the value an RMSNorm weight starts at)
REAL_SHAPES = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False), 1.0),
    "gemma3-1b": ("Gemma3TextConfig", dict(
        architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True), 0.0),
    "phi4-mini": ("Phi3Config", dict(
        architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75, rope_theta=10_000.0,
        max_position_embeddings=131072, original_max_position_embeddings=4096, sliding_window=262144,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": PHI4_MINI_LONG_FACTOR},
        rms_norm_eps=1e-5, tie_word_embeddings=True), 1.0),
}


def real_shape_config(name: str):
    """The transformers config of the REAL_SHAPES entry `name`, with the default tokenizer's ids."""
    import transformers

    class_name, fields, _ = REAL_SHAPES[name]
    return getattr(transformers, class_name)(**fields, **TOKENS)


def write_random_checkpoint(config, folder: Path, seed: int, norm_value: float) -> None:
    """A checkpoint of `config`'s model with random bfloat16 weights, written one shard per layer
    (the embedding, final norm and head in the first) so no more than a layer is in memory."""
    import torch
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, []).append(name)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards.values()):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if len(shapes[name]) == 1:  # the RMSNorms' weights, as initialized
                tensors[name] = torch.full(shapes[name], norm_value, dtype=torch.bfloat16)
                continue
            # the CPU generator keeps 32 bits of a seed: the shape's seed starts the name's CRC
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode(), seed))
            tensors[name] = torch.empty(shapes[name], dtype=torch.bfloat16).normal_(
                0.0, config.initializer_range, generator=generator)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)


def shaped_file(name: str, file_type: str) -> Path:
    """The REAL_SHAPES entry `name` in `file_type` (llama-quantize's name), made once under .peers/
    (random checkpoint, seeded; its BF16 GGUF; llama-quantize), deleting the checkpoint and the BF16
    GGUF after."""
    out = PEERS_DIR / f"{name}-shape-random-{file_type.lower()}.gguf"
    if out.is_file():
        return out
    from nanoserve.model.default import default_model_dir

    folder = PEERS_DIR / f"{name}-shape-random"
    bf16 = PEERS_DIR / f"{name}-shape-random-bf16.gguf"
    try:
        if not bf16.is_file():
            write_random_checkpoint(real_shape_config(name), folder, seed=0, norm_value=REAL_SHAPES[name][2])
            shutil.copy(default_model_dir() / "tokenizer.json", folder / "tokenizer.json")
            tokenizer_config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
            # Phi-3's converter reads a BPE vocabulary only under the class Phi-4-mini's own file names
            # (transformers 5 writes TokenizersBackend); the others ignore the class
            tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
            (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
            convert_checkpoint(folder, bf16, "bf16")
            shutil.rmtree(folder)
        subprocess.run([str(QUANTIZE), str(bf16), str(out), file_type], check=True, capture_output=True)
    except BaseException:
        out.unlink(missing_ok=True)  # never leave a half-written file that a later call would take as made
        raise
    bf16.unlink()
    return out


def token_read_bytes(file: Path) -> dict[str, int]:
    """The bytes one token reads from `file` at one sequence, by the file's own tensor types:
    "head" (output.weight, or the tied token embedding), "experts" (top-k of X of each stacked
    expert tensor), "layers" (every other tensor of the blocks: attention, router, norms) and
    "embedding" (one row of token_embd), with "total" and the file's "file" bytes."""
    import gguf

    reader = gguf.GGUFReader(file)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key: str) -> int | None:
        found = reader.fields.get(f"{arch}.{key}")
        return int(found.parts[-1][0]) if found else None

    num_experts, top_k = field("expert_count"), field("expert_used_count")
    tensors = {t.name: t for t in reader.tensors}
    read = {"head": 0, "experts": 0, "layers": 0, "embedding": 0}
    for name, tensor in tensors.items():
        if name == "output.weight" or (name == "token_embd.weight" and "output.weight" not in tensors):
            read["head"] += int(tensor.n_bytes)
        elif name == "token_embd.weight":
            read["embedding"] += int(tensor.n_bytes) // int(tensor.shape[-1])  # one row of [V, E]
        elif "_exps." in name:
            read["experts"] += int(tensor.n_bytes) * top_k // num_experts
        else:
            read["layers"] += int(tensor.n_bytes)
    return read | {"total": sum(read.values()), "file": file.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"the files to make, of {', '.join(REAL_SHAPES)}")
    parser.add_argument("--file-type", default="Q4_K_M", help="llama-quantize's file type")
    parser.add_argument("--read-bytes", nargs="+", type=Path, default=[], metavar="FILE",
                        help="print the bytes a token reads from each file at one sequence")
    args = parser.parse_args()
    if unknown := [name for name in args.names if name not in REAL_SHAPES]:
        parser.error(f"no shape {unknown}: the shapes are {', '.join(REAL_SHAPES)}")
    for name in args.names:
        print(shaped_file(name, args.file_type), flush=True)
    for file in args.read_bytes:
        print(file.name, json.dumps(token_read_bytes(file)))


if __name__ == "__main__":
    main()
