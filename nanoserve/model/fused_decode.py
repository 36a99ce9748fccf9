"""A step's layers with the glue in C (fused_decode.c), in the two ways the execution plan routes
steps to (nanoserve.model.plan: which kinds and widths of step go to which):

- `FusedDecode.one_call` (Driver.C_ONE_CALL): every matmul of every layer in C (blockdot's panels,
  or dense float32 or bf16 in blockdot's dense panels: the model's own where the engine put its dense
  matrices there, dense_kernel, else a copy of torch's made once), the whole stack of decoder layers
  in one C call, inside one OpenMP parallel region, activations in float32;
- `FusedDecode.per_layer` (Driver.C_PER_LAYER, and Driver.C_TENSOR_PARALLEL between a rank's
  all-reduces): the model's linears as their forms run them, and between them three C calls a layer
  in place of ~25 torch operations: rope, the K/V write and attention (fused_attention), the
  residual add with the next norm (fused_add_norm), and the gate (fused_gate_mul), in the linears'
  dtype at their edges and float32 inside.

Why: at one sequence the default model's linears take 8-10 ms a step back to back, but 15 ms when
each follows ~25 small torch operations of glue (notes/blockdot.md: a call after a gap runs slower).

Either driver takes a step's prompt tokens as rows like a decode's (the batch-invariant plan routes
every step to them): each row's K/V is written to the cache before any row reads, then its query
attends its own context read back from there, so a row's arithmetic does not depend on the step it
came in. The embedding (and Gemma's scale of it), the final norm and the head stay in llama.py's
forward. It applies to the Llama family's switches that SmolLM, Llama 2/3, Mistral, Qwen2/2.5, Qwen3,
Gemma, Gemma 3 and Phi-3 use (a qkv bias, per-head q/k norms, a sliding window on some or all layers, a
query scale of its own, SiLU or GELU's tanh form, norms on attention's and the MLP's outputs, a
second rope table for the windowed layers, rope on the first dimensions of each head), the model
computing in float32 or bfloat16 on the CPU (LongRoPE included: its factors and attention factor are
in the rope table it reads); soft-capping (Gemma 2), an o bias, layers without rope (SmolLM3) and
OLMoE's norm over the whole q and k projections keep decoder_layer (`why_not`). A mixture-of-experts layer
(nanoserve.model.moe) runs in the one call, its router, its experts and a shared expert read in their
C forms (`moe_table`); on `per_layer`, one more C call (fused_moe) runs it where its experts' forms
are in C at every width, else moe.py's MLP in torch, the experts in their forms, between the calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve.model import blockdot
from nanoserve.model.cabi import FusedLayer, FusedMoe, FusedShape
from nanoserve.model.config import LlamaConfig
from nanoserve.model.forms import CForm
from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import MATMULS, LayerWeights, LlamaModel, ModelInputs
from nanoserve.model.moe import MoeWeights, moe_mlp
from nanoserve.model.rope import local_rope_table, rope_table

# fused_decode.c's KV_F32, KV_BF16, KV_F16, KV_Q8_0, KV_Q4_0: the caches it reads and writes, by KVCache.dtype
KV_KINDS: dict[torch.dtype | str, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "q8_0": 3, "q4_0": 4}
# A dense model whose matrices torch runs decodes in one call up to this many rows, by its dtype;
# wider steps take oneDNN's packed linears between the C glue (a model on blockdot's dense panels
# decodes in one call at every width, and so does bf16 where the start-up probe times bf16 slower
# than float32: Precision.bf16_one_call_rows). A constant, not probed; the measurements behind it:
# notes/execution-plan.md, "Why the constants are what they are".
DENSE_ONE_CALL_ROWS = {torch.float32: 2**31, torch.bfloat16: 2}
C_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP gates fused_decode.c runs, by its code: ACT_SILU, ACT_GELU_TANH


def why_not(config: LlamaConfig, device: torch.device) -> str | None:
    """Why the fused decode cannot run a model of this family on this device; None when it can (the
    model's dtype, float32 or bf16, is the plan's to check)."""
    if device.type != "cpu":
        return f"the model is on {device}"
    if blockdot.library() is None:
        return f"fused_decode.c could not be built: {blockdot.failure()}"
    switches = {"o_bias": config.o_bias, "attn_logit_softcap": config.attn_logit_softcap is not None,
                "activation": config.hidden_act not in C_ACTIVATIONS,
                # fused_decode.c rotates every layer's heads (their first rotary_dim dimensions)
                "no_rope_layers": bool(config.no_rope_layers), "qk_norm_whole": config.qk_norm_whole,
                # moe_mlp's gate is SiLU's
                "moe_activation": config.is_moe and config.hidden_act != "silu"}
    if any(switches.values()):
        return f"the family's {[name for name, on in switches.items() if on]} are not in fused_decode.c"
    return None


@dataclass
class FusedDecode:
    """What fused_decode.c reads of a laid-out model, and its two entries: `one_call` and
    `per_layer` each take a step's h [T, E] float32 (the embedding's rows) and return h after the
    last layer (the same tensor, updated in place). Which steps each runs is the plan's routes'."""

    layers: list[LayerWeights]
    shape: FusedShape
    cos: torch.Tensor  # [P, Dr] float32
    sin: torch.Tensor  # [P, Dr] float32
    ropes: list[tuple[torch.Tensor | None, ...]]  # per layer: its own cos, sin [P, Dr] float32 (Gemma 3's windowed layers), or None
    dtype: torch.dtype  # the linears' (and the K/V cache's): float32 or bfloat16
    kernel: blockdot.Library
    switches: list[tuple[torch.Tensor | None, ...]]  # per layer: qkv_bias, q_norm, k_norm in float32, or None
    windows: list[int]  # per layer: its sliding window W, 0 for none
    # per layer, its MATMULS as the one call reads them (each weight's c_form); empty where there is no one call
    forms: list[list[tuple[torch.Tensor | None, int]]]
    # per layer, its mixture of experts as fused_decode.c reads it; None for a dense layer, or where the
    # experts run in torch (moe_mlp) between the per-layer calls. Every sparse layer has one with the one call.
    moe: list[MoeTable | None]
    copy_bytes: int = 0  # the dense panels among them copied from torch's matrices
    _table: ctypes.Array | None = None  # the layers' structs, for the cache they were built against
    _cache: KVCache | None = None

    def _rows(self, h: torch.Tensor, inputs: ModelInputs, kv: KVCache) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The step's rows as the C reads them, checked: the tensors (the caller holds them for the
        call) and the arguments that point into them. The layers' structs are rebuilt for a new cache."""
        if self._cache is not kv:
            self._table, self._cache = self._layer_table(kv), kv
            self.shape.block_size, self.shape.kv_kind = kv.block_size, KV_KINDS[kv.dtype]
        tables = _row_tables(inputs)  # [T, nb]
        positions, slots = inputs.positions.contiguous(), inputs.attn.slot_mapping.contiguous()
        _check_rows(h, self.shape.E, positions, slots, tables)
        return (tables, positions, slots), (h.shape[0], positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                            tables.shape[1], self.cos.data_ptr(), self.sin.data_ptr())

    def one_call(self, h: torch.Tensor, inputs: ModelInputs, kv: KVCache) -> torch.Tensor:
        """Every layer in one C call (Driver.C_ONE_CALL): every matmul read in its C form."""
        held, rows = self._rows(h, inputs, kv)
        if self.kernel.lib.fused_decode(ctypes.byref(self.shape), self._table, len(self.layers), h.data_ptr(), *rows,
                                        torch.get_num_threads()):
            raise MemoryError(f"fused_decode: no memory for the scratch of a {h.shape[0]}-row step")
        del held  # alive until the call has returned
        return h

    def per_layer(self, h: torch.Tensor, inputs: ModelInputs, kv: KVCache) -> torch.Tensor:
        """The weights' own linears, the glue between them in three C calls a layer
        (Driver.C_PER_LAYER, and Driver.C_TENSOR_PARALLEL between a rank's all-reduces)."""
        held, rows = self._rows(h, inputs, kv)
        h = self._per_layer(h, kv, rows)
        del held  # alive until the calls have returned
        return h

    def _per_layer(self, h: torch.Tensor, kv: KVCache, rows: tuple) -> torch.Tensor:
        """The weights' own linears (torch's, or panels between a rank's all-reduces), the glue
        between them in three C calls a layer."""
        lib, shape, T = self.kernel.lib, self.shape, h.shape[0]
        io_bf16 = int(self.dtype == torch.bfloat16)

        def add_norm(add: torch.Tensor | None, out_norm: torch.Tensor | None,
                     norm: torch.Tensor | None) -> torch.Tensor | None:
            """h += add (normed by out_norm first, where given); x = h normed by `norm` (None: no x)."""
            x = None if norm is None else torch.empty(T, shape.E, dtype=self.dtype)  # [T, E]
            lib.fused_add_norm(h.data_ptr(), None if add is None else add.contiguous().data_ptr(), _address(out_norm),
                               _address(norm), _address(x), io_bf16, T, shape.E, shape.eps, torch.get_num_threads())
            return x

        x = add_norm(None, None, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x).contiguous()  # [T, (H + 2 Hkv) D]
            att = torch.empty(T, shape.H * shape.D, dtype=self.dtype)  # [T, H D]
            if lib.fused_attention(ctypes.byref(shape), ctypes.byref(self._table[i]), qkv.data_ptr(), att.data_ptr(),
                                   io_bf16, *rows, torch.get_num_threads()):
                raise MemoryError(f"fused_attention: no memory for the scratch of a {T}-row step")
            x = add_norm(layer.o(att), layer.attn_out_norm, layer.post_norm)  # [T, E]
            if self.moe[i] is not None and self.moe[i].per_layer:  # the whole sparse MLP in one C call
                out = torch.empty(T, shape.E, dtype=self.dtype)  # [T, E]
                if lib.fused_moe(ctypes.byref(shape), ctypes.byref(self.moe[i].table), x.data_ptr(), out.data_ptr(),
                                 io_bf16, T, torch.get_num_threads()):
                    raise MemoryError(f"fused_moe: no memory for the scratch of a {T}-row step")
            elif layer.moe is not None:  # its experts' matmuls grouped by expert, in torch between the C calls
                out = moe_mlp(x, layer.moe)  # [T, E]
            else:
                gate_up = layer.gate_up(x).contiguous()  # [T, 2 I]
                act = torch.empty(T, shape.I, dtype=self.dtype)  # [T, I]
                lib.fused_gate_mul(gate_up.data_ptr(), act.data_ptr(), io_bf16, T, shape.I, shape.activation,
                                   torch.get_num_threads())
                out = layer.down(act)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            x = add_norm(out, layer.mlp_out_norm, following)
        return h

    def _layer_table(self, kv: KVCache) -> ctypes.Array:
        table = (FusedLayer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            forms = self.forms[i] if self.forms else [(None, 0)] * len(MATMULS)  # none: torch's linears run them
            table[i] = FusedLayer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                                  *(_address(t) for t, _ in forms), *(planes for _, planes in forms),
                                  kv.k[i].data_ptr(), kv.v[i].data_ptr(), *(_address(t) for t in self.switches[i]),
                                  self.windows[i], None if self.moe[i] is None else ctypes.addressof(self.moe[i].table),
                                  _address(layer.attn_out_norm), _address(layer.mlp_out_norm),
                                  *(_address(t) for t in self.ropes[i]))
        return table


@dataclass
class MoeTable:
    """A sparse layer's MLP as fused_decode.c reads it (struct fused_moe), and what its addresses point into."""

    table: FusedMoe
    held: tuple  # the matrices' C forms and the ctypes arrays of the experts' addresses and planes
    copy_bytes: int  # dense panels copied from matrices torch runs (the router, the shared expert's gate)
    per_layer: bool = False  # fused_moe runs it on the per-layer route too: its experts' forms run in C at every width


def moe_table(moe: MoeWeights) -> MoeTable | None:
    """What fused_decode.c reads of a sparse layer's MLP: each matrix's C form; None where some
    matrix has none. The experts' own panels; dense panels copied for a router or a shared gate that
    torch runs (X E and E weights: 1 MB a layer in float32 at 128 experts of a 2048 hidden)."""
    forms = {name: w.c_form(blockdot.pack_dense) for name, w in (
        ("router", moe.router), ("shared_gate_up", moe.shared_gate_up), ("shared_down", moe.shared_down),
        ("shared_gate", moe.shared_gate)) if w is not None}
    gate_up, down = [w.c_form(blockdot.pack_dense) for w in moe.gate_up], [w.c_form(blockdot.pack_dense) for w in moe.down]
    if any(form is None for form in [*forms.values(), *gate_up, *down]):
        return None
    X = len(moe.gate_up)
    pointers = [(ctypes.c_void_p * X)(*(f.data.data_ptr() for f in fs)) for fs in (gate_up, down)]
    planes = [(ctypes.c_int64 * X)(*(f.code for f in fs)) for fs in (gate_up, down)]
    shared = {name: forms.get(name) for name in ("shared_gate_up", "shared_down", "shared_gate")}
    table = FusedMoe(forms["router"].data.data_ptr(), ctypes.addressof(pointers[0]), ctypes.addressof(pointers[1]),
                     ctypes.addressof(planes[0]), ctypes.addressof(planes[1]),
                     *(None if f is None else f.data.data_ptr() for f in shared.values()), forms["router"].code,
                     *(0 if f is None else f.code for f in shared.values()), X, moe.top_k, moe.down[0].shape[1],
                     0 if moe.shared_down is None else moe.shared_down.shape[1], int(moe.norm_topk_prob))
    copied = sum(f.data.nbytes for f in [*forms.values(), *gate_up, *down] if f.copied)
    return MoeTable(table, (forms, gate_up, down, pointers, planes), copied)


def _experts_in_c(moe: MoeWeights) -> bool:
    """Whether the experts' matrices are in C forms that run so at every width (fused_moe runs them
    there, past a kernel's rows too); the router and a shared gate are copied where torch runs them."""
    return all(w.form.name.in_c and w.form.kernel_rows is None
               for name, w in moe.matrices() if name.startswith(("experts.", "shared.")))


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_rows(h: torch.Tensor, E: int, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor) -> None:
    """What fused_decode.c reads of a step's rows, checked in a few integer comparisons (no tensor
    op: every decode step passes here): h [T, E] float32 contiguous, positions and slot_mapping
    [T] int64, tables [T, nb] int64.

    Raises:
        ValueError: naming the tensor, what it is and what the C reads.
    """
    if h.dim() != 2 or h.shape[1] != E or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"the fused decode takes h [T, {E}] float32, contiguous; got {h.dtype} {list(h.shape)}"
                         f"{'' if h.is_contiguous() else ', not contiguous'}")
    T = h.shape[0]
    for name, t in (("positions", positions), ("slot_mapping", slots)):
        if t.dim() != 1 or t.shape[0] != T or t.dtype != torch.int64:
            raise ValueError(f"the fused decode takes {name} [{T}] int64, one per row of h; got {t.dtype} "
                             f"{list(t.shape)}")
    if tables.dim() != 2 or tables.shape[0] != T or tables.dtype != torch.int64:
        raise ValueError(f"the fused decode takes block tables [{T}, nb] int64, one per row of h; got {tables.dtype} "
                         f"{list(tables.shape)}")


def _row_tables(inputs: ModelInputs) -> torch.Tensor:
    """Each row's block table, [T, nb] int64: its sequence's (a prompt's rows share one)."""
    tables, row_seqs = inputs.attn.block_tables, inputs.attn.row_seqs
    if tables is None or row_seqs is None:
        raise ValueError("the fused decode reads each row's block table: AttentionMetadata.block_tables and row_seqs "
                         "(build_inputs makes them) are None")
    return tables if tables.shape[0] == row_seqs.shape[0] else tables.index_select(0, row_seqs)


def fused_decode(model: LlamaModel, one_call: bool, int16_rows: int | None,
                 amx_rows: int | None = None) -> FusedDecode:
    """What fused_decode.c reads of a laid-out model (the execution plan decides that a C driver
    runs): with `one_call`, every matmul's C form, read from the weight itself or copied (dense
    matrices torch runs); blockdot's panels on their int16 path from int16_rows rows, file-bit panels
    on AMX tiles from amx_rows rows (None: never).

    Raises:
        ValueError: one_call, but some matmul has no form fused_decode.c reads.
    """
    config, shape = model.config, model.shape
    scale = shape.attn_scale if shape.attn_scale is not None else shape.head_dim ** -0.5
    c_shape = FusedShape(config.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         config.intermediate_size, 0, 0, int16_rows or 0, amx_rows or 0,  # block_size, kv_kind: from the cache
                         C_ACTIVATIONS.index(shape.activation), config.rotary_dim, shape.eps, scale)
    cos, sin = rope_table(config, model.cos.shape[0], torch.float32, model.device)
    local = local_rope_table(config, model.cos.shape[0], torch.float32, model.device)
    ropes = [local if local is not None and i in model.sliding_layers else (None, None) for i in range(config.num_layers)]
    forms: list[list[CForm | None]] = []
    moe = [None if layer.moe is None or not (one_call or _experts_in_c(layer.moe)) else moe_table(layer.moe)
           for layer in model.layers]
    for layer, table in zip(model.layers, moe, strict=True):
        if table is not None:
            table.per_layer = _experts_in_c(layer.moe)
    if one_call:
        # a sparse layer's gate_up and down are None: its MLP is moe's
        forms = [[None if getattr(layer, name) is None else getattr(layer, name).c_form(blockdot.pack_dense)
                  for name in MATMULS] for layer in model.layers]
        missing = [f"layer {i} {name}" for i, (layer, layer_forms) in enumerate(zip(model.layers, forms, strict=True))
                   for name, form in zip(MATMULS, layer_forms, strict=True)
                   if form is None and getattr(layer, name) is not None]
        missing += [f"layer {i} experts" for i, layer in enumerate(model.layers) if layer.moe is not None and moe[i] is None]
        if missing:
            raise ValueError(f"the one-call decode reads every matmul in C, but {missing[:4]} have no C form")
    switches = [tuple(None if t is None else t.float().contiguous() for t in (layer.qkv_bias, layer.q_norm, layer.k_norm))
                for layer in model.layers]
    windows = [config.sliding_window if i in model.sliding_layers else 0 for i in range(config.num_layers)]
    copy_bytes = sum(form.data.nbytes for layer_forms in forms for form in layer_forms if form is not None and form.copied)
    copy_bytes += sum(table.copy_bytes for table in moe if table is not None)
    return FusedDecode(model.layers, c_shape, cos, sin, ropes, model.dtype, blockdot.library(), switches, windows,
                       [[(None, 0) if form is None else (form.data, form.code) for form in layer_forms]
                        for layer_forms in forms], moe, copy_bytes)


def run_one_call(model: LlamaModel, h: torch.Tensor, inputs: ModelInputs, kv: KVCache) -> torch.Tensor:
    """Driver.C_ONE_CALL's entry in a model's table."""
    return model.fused_layers.one_call(h, inputs, kv)


def run_per_layer(model: LlamaModel, h: torch.Tensor, inputs: ModelInputs, kv: KVCache) -> torch.Tensor:
    """Driver.C_PER_LAYER's and Driver.C_TENSOR_PARALLEL's entry in a model's table."""
    return model.fused_layers.per_layer(h, inputs, kv)
