"""The execution plan: what runs a step, decided once at start-up.

EngineConfig says what the user chose; nanoserve.model.precision turns its "auto" values into
choices by a probe of a few milliseconds; `resolve_plan` adds what the model and the engine's shape
decide (torch.compile, tensor parallelism, whether the family fits the C decode, the exact path)
and names, for each matmul, the form it runs in (nanoserve.model.forms.Form) and, for each kind
and width of step, the driver that runs it. `prepare_model` carries the plan out and
`check_laid_out` holds the laid-out model to it; `ExecutionPlan.render()` is what `nanoserve plan`
prints. Nothing else chooses how a step runs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.model import blockdot
from nanoserve.model.forms import C_DTYPES, STORED, Form, can_pack, dtype_name
from nanoserve.model.fused_decode import DENSE_ONE_CALL_ROWS, why_not
from nanoserve.model.llama import LlamaModel, decoder_layer
from nanoserve.model.precision import DTYPES, Probe, resolve
from nanoserve.model.quant import torch_runs

# Who runs a step's layers.
DRIVERS = {
    "c-one-call": "every layer in one C call (fused_decode.c), its matmuls on blockdot's or dense panels",
    "c-per-layer": "each layer's matmuls as their forms run them, the glue between them in three C calls",
    "torch": "llama.decoder_layer in torch's ops (the reference)",
    "torch-compiled": "llama.decoder_layer through torch.compile",
    "torch-tensor-parallel": "llama.decoder_layer over this rank's slices, o and down all-reduced",
    "c-tensor-parallel": "each rank's slices on blockdot's or dense panels, the glue between them in three C calls "
                         "a layer, o and down summed over the ranks in rank order",
}
EVERY_WIDTH = 2**31  # one_call_rows where the one call takes decode steps of every width


@dataclass(frozen=True)
class MatrixPlan:
    layer: int | None  # None: the head
    name: str  # "qkv", "o", "gate_up", "down" or "head"
    stored: str  # what the loaded model holds: a dtype ("float32"), a quantized kind ("Q4_1", "int8"), or a form
    form: Form  # what it runs as


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything that decides how a step runs, resolved once (module docstring)."""

    device: str
    dtype: str  # the matmuls', rope's and attention's; the residual stream and norms stay float32
    kv_cache_dtype: str
    quantization: str | None  # None (dense), "int8", "int4" or "keep" (the checkpoint's own)
    matrices: tuple[MatrixPlan, ...]
    decode: str  # the driver (DRIVERS) of decode-only steps of up to one_call_rows rows
    one_call_rows: int  # 0 where `decode` is not "c-one-call"; EVERY_WIDTH: no limit
    wide_decode: str  # the driver of decode-only steps wider than one_call_rows
    mixed: str  # the driver of steps with a prompt or a chunk of one
    one_call_copies: bool  # the one call reads dense panels copied from matrices torch runs (Engine.memory's fused_copies)
    pack_weights: bool  # dense copies of quantized linears reordered for oneDNN where it takes them
    threads: int
    exact: bool  # torch's ops only, every matrix dense float32: token-identical to transformers
    batch_invariant: tuple[tuple[str, bool, str], ...]  # (choice, whether a row's result is independent of its batch, why)
    reasons: tuple[str, ...]
    probe: Probe | None = None

    @functools.cached_property
    def _forms(self) -> dict[tuple[int | None, str], Form]:
        return {(m.layer, m.name): m.form for m in self.matrices}

    def form_of(self, layer: int | None, name: str) -> Form:
        return self._forms[(layer, name)]

    def driver(self, num_rows: int, decode_only: bool) -> str:
        """Who runs a step of num_rows rows (decode_only: every row one decoding sequence)."""
        if not decode_only:
            return self.mixed
        return self.decode if num_rows <= self.one_call_rows or self.decode != "c-one-call" else self.wide_decode

    @property
    def is_batch_invariant(self) -> bool:
        """Whether every choice leaves a row's result independent of the rows beside it."""
        return all(ok for _, ok, _ in self.batch_invariant)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @property
    def kernels(self) -> str:
        """Who runs the quantized matmuls' few-row passes: "blockdot", "torch", "blockdot+torch", or ""
        where every matrix is dense."""
        names = {"blockdot" if m.form.name == "blockdot" else "torch" for m in self.matrices
                 if m.form.name in ("blockdot", "torch-int4", "torch-int8")}
        return "+".join(sorted(names))

    def render(self) -> str:
        """The plan as `nanoserve plan` prints it and the engine logs it."""
        lines = [f"device {self.device}, {self.threads} threads; dtype {self.dtype}, KV cache {self.kv_cache_dtype}, "
                 f"quantization {self.quantization}{' (the exact path: torch ops only)' if self.exact else ''}",
                 "matrices:"]
        lines += [f"  {where:<22} {stored:>8} -> {form}" for where, stored, form in _grouped(self.matrices)]
        lines.append("steps:")
        if self.decode == "c-one-call":
            width = "every width" if self.one_call_rows >= EVERY_WIDTH else f"1-{self.one_call_rows} rows"
            lines.append(f"  decode-only, {width}: {self.decode} ({DRIVERS[self.decode]})")
            if self.one_call_rows < EVERY_WIDTH:
                lines.append(f"  decode-only, {self.one_call_rows + 1}+ rows: {self.wide_decode} ({DRIVERS[self.wide_decode]})")
            if self.one_call_copies:
                lines.append("  (the one call reads dense panels copied from the matrices torch runs)")
        else:
            lines.append(f"  decode-only: {self.decode} ({DRIVERS[self.decode]})")
        lines.append(f"  with a prompt: {self.mixed} ({DRIVERS[self.mixed]}{', each token a row' if self.mixed.startswith('c-') else ''})")
        lines.append(f"batch invariance (a row's result independent of the rows beside it): "
                     f"{'yes' if self.is_batch_invariant else 'no'}")
        lines += [f"  {'yes' if ok else 'no '}  {choice}: {why}" for choice, ok, why in self.batch_invariant]
        lines.append("why:")
        lines += [f"  {reason}" for reason in self.reasons]
        if self.probe is not None:
            lines.append(f"probe: {self.probe.describe()}")
        return "\n".join(lines)

    def to_message(self) -> dict[str, Any]:
        """The plan as JSON-ready data (tensor-parallel workers lay their shards out by it); the
        probe's figures stay with rank 0."""
        return dataclasses.asdict(dataclasses.replace(self, probe=None))

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ExecutionPlan:
        fields = dict(message)
        fields["matrices"] = tuple(MatrixPlan(m["layer"], m["name"], m["stored"], Form(**m["form"]))
                                   for m in fields["matrices"])
        fields["batch_invariant"] = tuple(tuple(entry) for entry in fields["batch_invariant"])
        fields["reasons"] = tuple(fields["reasons"])
        return cls(**fields)


def _grouped(matrices: tuple[MatrixPlan, ...]) -> list[tuple[str, str, Form]]:
    """Runs of layers whose matrix of one name is stored and runs alike, as ("layers 0-29 qkv", ...)."""
    rows: list[tuple[str, str, Form]] = []
    by_name: dict[str, list[MatrixPlan]] = {}
    for m in matrices:
        by_name.setdefault(m.name, []).append(m)
    for name, entries in by_name.items():
        start = 0
        for i in range(1, len(entries) + 1):
            if i == len(entries) or (entries[i].stored, entries[i].form) != (entries[start].stored, entries[start].form):
                first, last = entries[start].layer, entries[i - 1].layer
                where = name if first is None else (f"layer {first} {name}" if first == last
                                                     else f"layers {first}-{last} {name}")
                rows.append((where, entries[start].stored, entries[start].form))
                start = i
    return rows


def _stored(form: Form) -> str:
    if form.name == STORED:
        return form.stored or STORED
    return form.dtype if form.name == "torch" else form.name


def resolve_plan(config: Any, model: LlamaModel, world_size: int = 1, probe: Any = None) -> ExecutionPlan:
    """The plan for running `model` (as loaded, or laid out by another engine) under `config` (an
    EngineConfig) on `world_size` tensor-parallel ranks. probe: in place of precision.probe_cpu.

    config.batch_invariant True or "auto" asks for the invariant plan: every step, prompts included,
    in one C call at every width, every matmul on blockdot's panels or dense panels (see
    _batch_invariance); "auto" takes the other plan where the config's own choices rule it out
    (the exact path among them), True refuses them.

    Raises:
        ValueError: a choice the config names that cannot run here (precision.resolve's), or
            batch_invariant=True with a choice no invariant plan can make, named.
    """
    wanted = config.batch_invariant
    blockers = [] if wanted is False else invariance_blockers(config, model, world_size)
    if wanted is True and blockers:
        raise ValueError(f"batch_invariant=True, but {'; '.join(blockers)}; use batch_invariant='auto' or False")
    if wanted is not False and not blockers:
        plan = _resolve(config, model, world_size, probe, True, ())
        off_c = [m for m in plan.matrices if m.form.name not in ("blockdot", "dense-panels")]
        if not off_c:
            return plan
        blockers = [f"{_where(off_c[0])} stored {off_c[0].stored} runs on {off_c[0].form.name}, outside C"]
        if wanted is True:
            raise ValueError(f"batch_invariant=True, but {blockers[0]}; use batch_invariant='auto' or False")
    return _resolve(config, model, world_size, probe, False, tuple(blockers))


def invariance_blockers(config: Any, model: LlamaModel, world_size: int = 1) -> list[str]:
    """The config's choices that rule the batch-invariant plan out, each said as the reason (empty:
    none does). The exact path is one only where batch_invariant is "auto": asked for by True, its
    float32 runs on dense panels instead of torch's ops."""
    device, overrides = torch.device(config.device), config.overrides
    found = []
    c_reason = why_not(model.config, device)
    if c_reason is not None:
        found.append(f"no C decode: {c_reason}")
    if config.compile:
        found.append("torch.compile runs torch's kernels")
    if config.batch_invariant == "auto" and config.dtype == "float32" and config.quantization is None:
        found.append("the exact path (dtype float32, quantization None) runs torch's ops, whose float32 matmul "
                     "sums a row in another order at 1, 2-3 and 4 or more rows")
    if config.dtype == "float16":
        found.append("fused_decode.c computes in float32 or bfloat16, not float16")
    if config.quantization == "int8":
        found.append("int8 per channel runs on torch's kernels")
    if overrides.fused_decode is False:
        found.append("fused_decode=False keeps decoder_layer")
    if overrides.kernels == "torch":
        found.append("kernels='torch' runs the quantized matmuls on torch's kernels")
    if overrides.dense_kernel == "torch":
        found.append("dense_kernel='torch' runs the dense matmuls on torch's")
    if isinstance(overrides.max_kernel_rows, int):
        found.append(f"max_kernel_rows={overrides.max_kernel_rows} changes a row's matmul past that many rows")
    if overrides.blockdot_int16_rows not in (None, 1):
        found.append(f"blockdot_int16_rows={overrides.blockdot_int16_rows} rounds a row to int16 only in steps that wide")
    return found


def _where(m: MatrixPlan) -> str:
    return "the head" if m.layer is None else f"layer {m.layer} {m.name}"


def _resolve(config: Any, model: LlamaModel, world_size: int, probe: Any, invariant: bool,
             blockers: tuple[str, ...]) -> ExecutionPlan:
    """resolve_plan's plan, the invariant one where `invariant` (blockers: why not, where it was asked for)."""
    device = torch.device(config.device)
    parallel, compiled = world_size > 1, config.compile
    c_parallel = parallel and invariant  # every rank's layers in C calls between its all-reduces
    exact = config.dtype == "float32" and config.quantization is None and not invariant
    overrides = config.overrides
    c_decode = overrides.fused_decode if overrides.fused_decode != "auto" else not exact
    reasons = []
    if c_parallel:
        reasons.append("batch invariant: every step in three C calls a layer between the matmuls at every width, "
                       "every matmul on blockdot's or dense panels, o and down summed over the ranks in rank order")
    elif invariant:
        reasons.append("batch invariant: every step in one C call at every width, every matmul on blockdot's or "
                       "dense panels")
    elif blockers:
        reasons.append(f"not batch invariant: {'; '.join(blockers)}")
    if exact:
        reasons.append("the exact path (dtype float32, quantization None): torch's ops"
                       + (", the C decode as configured" if c_decode else " only"))
    if (parallel and not c_parallel) or compiled:
        c_decode = False
        reasons.append("tensor parallelism: torch's kernels, decoder_layer with all-reduces" if parallel
                       else "torch.compile: torch's kernels, the compiled decoder_layer")
    c_reason = why_not(model.config, device) if c_decode else None
    if c_reason is not None:
        reasons.append(f"no C decode: {c_reason}")
        c_decode = False
    quantized = any(w.form.name == STORED for _, _, w in model.matrices())
    dense_kernel, kernels = overrides.dense_kernel, overrides.kernels
    max_kernel_rows, dense_copies = overrides.max_kernel_rows, overrides.dense_copies
    if parallel or compiled or (exact and not c_decode and dense_kernel == "auto"):
        dense_kernel = "torch"  # the exact path's matmuls are torch's, unless an override asked for the C decode
    if parallel or compiled:
        kernels = "torch"
    if invariant:  # every matmul in C at every width: no dense copies to switch to past a width
        dense_kernel, max_kernel_rows, dense_copies = "blockdot", None, False
        kernels = "blockdot" if quantized or config.quantization == "int4" else kernels
    precision = resolve(config.dtype, config.quantization, device, quantized, probe=probe, kernels=kernels,
                        max_kernel_rows=max_kernel_rows, dense_copies=dense_copies,
                        dense_kernel=dense_kernel, kv_cache_dtype=config.kv_cache_dtype, fused_decode=c_decode,
                        chosen_by="the invariant plan's" if invariant else "as configured")
    reasons += precision.reason.split("; ")
    dtype = precision.torch_dtype
    if c_decode and dtype not in C_DTYPES:
        reasons.append(f"no C decode: the model computes in {dtype_name(dtype)}")
        c_decode = False
    pack_weights = overrides.pack_weights and not compiled
    if precision.dense_kernel == "blockdot":
        dense = Form("dense-panels", precision.dtype)
    else:
        dense = Form("onednn" if pack_weights and can_pack(dtype, device) else "torch", precision.dtype)
    if dense.name == "dense-panels" and dtype not in C_DTYPES:
        dense = Form("torch", precision.dtype)

    unrun: set[str] = set()  # stored kinds no kernel here runs: dequantized at load

    def target(layer: int | None, form: Form) -> Form:
        if form.name not in (STORED, "torch") and form.dtype == precision.dtype:
            return form  # laid out by another engine already: kept as it is
        kind = None
        if precision.quantization == "keep" and form.name == STORED:
            kind = form.stored
        elif precision.quantization == "int8" or (precision.quantization == "int4" and layer is None and not invariant):
            kind = "int8"  # int4's head in int8 (dense where invariant: int8 per channel runs on torch's kernels only)
        elif precision.quantization == "int4":
            kind = "Q4_1"  # nanoserve's int4 is Q4_1's form
        if kind is None:
            return dataclasses.replace(dense, all_reduced=form.all_reduced)
        on_blockdot = precision.kernels == "blockdot" and blockdot.runs(kind) and dtype in blockdot.DTYPES
        # A kind blockdot does not run stays off torch's kernels where blockdot is this machine's
        # choice: they are its slower path (precision's probe), slower than the dense matrix on AVX2.
        on_torch = torch_runs(kind) and (precision.kernels == "torch" or kind == "int8" or blockdot.runs(kind))
        if not on_blockdot and not on_torch:
            unrun.add(kind)
            return dataclasses.replace(dense, all_reduced=form.all_reduced)
        if kind == "int8":
            name = "torch-int8"
        elif on_blockdot:
            name = "blockdot"
        else:
            name = "torch-int4"
        rows = precision.max_kernel_rows
        wide = None if rows is None else ("dequantized" if name == "blockdot" and not precision.dense_copies
                                          else "dense copy")
        int16_rows = overrides.blockdot_int16_rows if name == "blockdot" else None
        return Form(name, precision.dtype, rows, wide, int16_rows, form.all_reduced)

    matrices = tuple(MatrixPlan(layer, name, _stored(w.form), target(layer, w.form))
                     for layer, name, w in model.matrices())
    if unrun:
        kinds = ", ".join(sorted(unrun))
        reasons.append(f"{kinds} dequantized at load to {dense.dtype}: no {precision.kernels} kernel here runs "
                       f"{'them' if len(unrun) > 1 else 'it'}")
    decode = mixed = wide_decode = "torch-tensor-parallel" if parallel else "torch-compiled" if compiled else "torch"
    one_call_rows, copies = 0, False
    if c_parallel:  # fused_decode.c's one call has no place for an all-reduce
        decode = wide_decode = mixed = "c-tensor-parallel"
    elif invariant:
        decode = wide_decode = mixed = "c-one-call"
        one_call_rows = EVERY_WIDTH
    elif c_decode:
        layer_forms = [m.form for m in matrices if m.layer is not None]
        on_torch = [f for f in layer_forms if f.name in ("torch", "onednn")]
        if all(f.name in ("blockdot", "dense-panels") for f in layer_forms if f not in on_torch):
            decode, wide_decode = "c-one-call", "c-per-layer"
            dense_rows = DENSE_ONE_CALL_ROWS | {torch.bfloat16: precision.bf16_one_call_rows}
            one_call_rows = min([dense_rows[dtype]] * bool(on_torch) + [EVERY_WIDTH]
                                + [f.kernel_rows for f in layer_forms if f.kernel_rows is not None])
            copies = bool(on_torch)
        else:
            decode = wide_decode = "c-per-layer"
    return ExecutionPlan(str(device), precision.dtype, precision.kv_cache_dtype, precision.quantization, matrices,
                         decode, one_call_rows, wide_decode, mixed, copies, pack_weights, torch.get_num_threads(),
                         decode == mixed == "torch" and all(m.form.name in ("torch", "onednn") and m.form.dtype == "float32"
                                                            for m in matrices),
                         _batch_invariance(matrices, decode, one_call_rows, wide_decode, mixed, blockers),
                         tuple(reasons), precision.probe)


def _batch_invariance(matrices: tuple[MatrixPlan, ...], decode: str, one_call_rows: int, wide_decode: str,
                      mixed: str, blockers: tuple[str, ...] = ()) -> tuple[tuple[str, bool, str], ...]:
    """Which of the plan's choices leave a row's result independent of the rows beside it (the other
    rows of its step, its place among them, the step's width, where its prompt was cut into chunks).
    Only what holds by construction is a yes; tests/test_batch_invariance.py holds the plan to it."""
    forms = {m.form for m in matrices}
    entries = []
    one_call = decode == mixed == wide_decode == "c-one-call" and one_call_rows >= EVERY_WIDTH
    per_layer = decode == mixed == wide_decode == "c-tensor-parallel"
    if one_call:
        entries.append(("every step in one C call at every width, prompts too", True,
                        "a prompt's token is a row like a decode's: its K/V written to the cache, then its query "
                        "over its context read back from there, whatever the chunk or step it came in"))
    if per_layer:
        entries.append(("every step in three C calls a layer at every width, prompts too", True,
                        "the one call's glue, row by row, and its attention: a prompt's token is a row like a "
                        "decode's, whatever the chunk or step it came in"))
        entries.append(("o and down summed over the ranks in rank order", True,
                        "every rank's partials gathered and added rank 0 first, on every rank, whatever the step's "
                        "width"))
    if one_call or per_layer:
        entries.append(("attention over parts of a row's context cut by its length alone", True,
                        "a row's context cut where its own length says, the parts merged in order, whatever the "
                        "step's width or the threads"))
    for rows, wide in sorted({(f.kernel_rows, f.wide) for f in forms if f.kernel_rows is not None}):
        entries.append((f"quantized kernels up to {rows} rows, {wide} past", False,
                        f"a row's sums change when its step passes {rows} rows"))
    for rows in sorted({f.int16_rows for f in forms if f.int16_rows is not None}):
        entries.append((f"x rounded to int16 from {rows} row{'s' if rows > 1 else ''}", rows == 1,
                        "each row is rounded on its own at every width" if rows == 1
                        else f"a row is rounded only in steps of {rows} rows or more"))
    if any(f.name in ("torch", "onednn", "torch-int4", "torch-int8") for f in forms):
        entries.append(("torch's matmuls", False, "oneDNN and MKL block a matmul by its row count: in float32 a row "
                        "sums in another order at 1, 2-3 and 4 or more rows"))
    if any(f.name in ("blockdot", "dense-panels") and f.kernel_rows is None for f in forms):
        entries.append(("blockdot's panels and dense panels", True,
                        "a row's sums run in one order whatever tile or call it is in (tests/test_blockdot.py)"))
    if decode == "c-one-call" and one_call_rows < EVERY_WIDTH:
        entries.append((f"decode steps: {decode} up to {one_call_rows} rows, {wide_decode} past", False,
                        "the two compute the glue in a different order"))
    if decode != mixed:
        entries.append((f"decode-only steps on {decode}, steps with a prompt on {mixed}", False,
                        "a decoding row's arithmetic depends on whether a prompt shares its step"))
    if mixed.startswith("torch"):
        entries.append(("prompts on torch's attention", False,
                        "a prompt's token attends the new keys as computed and the cached ones read back, so "
                        "where its prompt was cut into chunks changes its sums"))
    entries += [(blocker, False, "why the invariant plan was not taken") for blocker in blockers]
    return tuple(entries)


def check_laid_out(model: LlamaModel, plan: ExecutionPlan) -> list[str]:
    """How a laid-out model differs from its plan (empty: it runs what the plan says): each matmul's
    form, the dtype, and the drivers the model carries."""
    problems = [f"{'head' if layer is None else f'layer {layer} {name}'}: runs {w.form}, the plan says "
                f"{plan.form_of(layer, name)}"
                for layer, name, w in model.matrices() if w.form != plan.form_of(layer, name)]
    if model.dtype != plan.torch_dtype:
        problems.append(f"the model computes in {model.dtype}, the plan says {plan.dtype}")
    fused = model.fused_layers
    compiled = model.layer_fn is not decoder_layer
    if plan.decode.startswith("c-") != (fused is not None):
        problems.append(f"the plan's decode driver is {plan.decode}, the model's fused decode is {fused}")
    elif fused is not None and fused.max_rows != plan.one_call_rows:
        problems.append(f"the one call takes up to {fused.max_rows} rows, the plan says {plan.one_call_rows}")
    elif fused is not None and fused.prompts != plan.mixed.startswith("c-"):
        problems.append(f"the fused decode {'takes' if fused.prompts else 'leaves'} steps with a prompt, the plan's mixed "
                        f"driver is {plan.mixed}")
    if (plan.mixed == "torch-compiled") != compiled:
        problems.append(f"the plan's mixed driver is {plan.mixed}, the model's layer is {model.layer_fn}")
    return problems

