"""The execution plan: what runs a step, decided once at start-up.

EngineConfig says what the user chose; `resolve_plan` decides the rest in stages, each a function
below, each adding its reasons:

0. `refuse`: what no plan runs (the tensor-parallel and speculation rules a config breaks);
1. whether the batch-invariant plan is taken (`invariance_blockers`);
2. the precision: nanoserve.model.precision turns the "auto" values into choices by a probe of a few
   milliseconds;
3. each matmul's form (nanoserve.model.forms.Form, `_form_of`): every choice that changes a row's
   arithmetic is a field of a Form (its kernel, rows, int16 rounding, rank-order sum) or of the plan;
4. the routes (`_routes`): for each kind and width of step, the driver (nanoserve.model.driver.Driver)
   that runs it.

A draft model of speculative decoding gets a plan of its own, held in `ExecutionPlan.draft`.
`prepare_model` carries the plan out, building the laid-out model's table of drivers, and
`check_laid_out` holds the model, draft included, to it; LlamaModel.forward asks the plan which
driver runs each step and calls it from that table. `ExecutionPlan.render()` is what `nanoserve
plan` prints. Nothing else chooses how a step runs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.model import blockdot, kv_quant
from nanoserve.model.driver import EVERY_WIDTH, Driver
from nanoserve.model.forms import C_DTYPES, STORED, Form, FormKind, can_pack, dtype_name
from nanoserve.model.fused_decode import DENSE_ONE_CALL_ROWS, run_one_call, run_per_layer, why_not
from nanoserve.model.kv_quant import BLOCK_BYTES
from nanoserve.model.llama import LlamaModel, Step, run_layers
from nanoserve.model.moe import DENSE_ONLY
from nanoserve.model.precision import DTYPES, Precision, Probe, resolve
from nanoserve.model.quant import torch_runs

DRIVERS = {driver: driver.description for driver in Driver}  # who runs a step's layers (Driver)
# The one dispatch table: what each driver calls (LlamaModel.drivers holds the entries of those its
# plan routes to). The compiled driver's entry holds its own graph, built for each model (prepare_model).
STEPS: dict[Driver, Step] = {
    Driver.C_ONE_CALL: run_one_call,
    Driver.C_PER_LAYER: run_per_layer,
    Driver.C_TENSOR_PARALLEL: run_per_layer,
    Driver.TORCH: run_layers,
    Driver.TORCH_TENSOR_PARALLEL: run_layers,
}


@dataclass(frozen=True)
class Route:
    """One row of the plan's step table: steps of this kind, up to max_rows rows, run on `driver`."""

    with_prompt: bool  # steps with a prompt or a chunk of one; False: decode-only steps
    max_rows: int  # EVERY_WIDTH: no limit
    driver: Driver

    def __post_init__(self) -> None:
        object.__setattr__(self, "driver", Driver(self.driver))  # a plan sent as JSON names it as a string


@dataclass(frozen=True)
class MatrixPlan:
    layer: int | None  # None: the head
    name: str  # "qkv", "o", "gate_up", "down", "head", or a sparse layer's (moe.MoeWeights.matrices: all experts one)
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
    routes: tuple[Route, ...]  # the step table, in the order driver() reads it
    int16_rows: int | None  # blockdot rounds x to int16 from this many rows, in every matrix and C call (None: never)
    one_call_copies: bool  # the one call reads dense panels copied from matrices torch runs (Engine.memory's fused_copies)
    pack_weights: bool  # dense copies of quantized linears reordered for oneDNN where it takes them
    threads: int
    exact: bool  # torch's ops only, every matrix dense float32: token-identical to transformers
    batch_invariant: tuple[tuple[str, bool, str], ...]  # (choice, whether a row's result is independent of its batch, why)
    reasons: tuple[str, ...]
    probe: Probe | None = None
    draft: ExecutionPlan | None = None  # the draft model's own plan (speculative decoding's draft_model)
    amx_rows: int | None = None  # file-bit panels multiply on AMX tiles from this many rows, in every matrix and C call (None: never)

    @functools.cached_property
    def _forms(self) -> dict[tuple[int | None, str], Form]:
        return {(m.layer, m.name): m.form for m in self.matrices}

    def form_of(self, layer: int | None, name: str) -> Form:
        return self._forms[(layer, name)]

    def driver(self, num_rows: int, decode_only: bool) -> Driver:
        """Who runs a step of num_rows rows (decode_only: every row one decoding sequence): the first
        route of its kind that takes its width."""
        with_prompt = not decode_only
        for route in self.routes:
            if route.with_prompt == with_prompt and num_rows <= route.max_rows:
                return route.driver
        raise ValueError(f"no route takes a {'mixed' if with_prompt else 'decode-only'} step of {num_rows} rows")

    @property
    def drivers(self) -> frozenset[Driver]:
        """Every driver a route names: the laid-out model's table holds exactly these."""
        return frozenset(route.driver for route in self.routes)

    def _of_kind(self, with_prompt: bool) -> list[Route]:
        return [route for route in self.routes if route.with_prompt == with_prompt]

    @property
    def decode(self) -> Driver:
        """The driver of the narrowest decode-only steps."""
        return self._of_kind(False)[0].driver

    @property
    def wide_decode(self) -> Driver:
        """The driver of the widest decode-only steps."""
        return self._of_kind(False)[-1].driver

    @property
    def one_call_rows(self) -> int:
        """The widest decode-only step the one call takes (EVERY_WIDTH: no limit); 0 where decode
        steps are not on it."""
        first = self._of_kind(False)[0]
        return first.max_rows if first.driver == Driver.C_ONE_CALL else 0

    @property
    def mixed(self) -> Driver:
        """The driver of steps with a prompt or a chunk of one."""
        return self._of_kind(True)[0].driver

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
        """Who runs the quantized matmuls' few-row passes: "blockdot", "blockdot-int8" (file-bit panels),
        "torch", several joined by "+", or "" where every matrix is dense."""
        quantized = (FormKind.BLOCKDOT, FormKind.BLOCKDOT_INT8, FormKind.TORCH_INT4, FormKind.TORCH_INT8)
        names = {m.form.name if m.form.name.in_c else "torch" for m in self.matrices if m.form.name in quantized}
        return "+".join(sorted(names))

    def render(self) -> str:
        """The plan as `nanoserve plan` prints it and the engine logs it."""
        lines = [f"device {self.device}, {self.threads} threads; dtype {self.dtype}, KV cache {self.kv_cache_dtype}, "
                 f"quantization {self.quantization}{' (the exact path: torch ops only)' if self.exact else ''}",
                 "matrices:"]
        grouped = _grouped(self.matrices)
        width = max((len(where) for where, _, _ in grouped), default=0)  # "layers 0-47 experts.gate_up" and the like
        lines += [f"  {where:<{max(22, width)}} {stored:>8} -> {form}" for where, stored, form in grouped]
        lines.append("steps:")
        for route in self.routes:
            kind = self._of_kind(route.with_prompt)
            lines.append(f"  {'with a prompt' if route.with_prompt else 'decode-only'}{_widths(kind, route)}: "
                         f"{route.driver} ({route.driver.description}"
                         f"{', each token a row' if route.with_prompt and route.driver.in_c else ''})")
        if self.one_call_copies:
            lines.append("  (the one call reads dense panels copied from the matrices torch runs)")
        if self.int16_rows is not None:
            lines.append(f"  (blockdot rounds x to int16 from {self.int16_rows} row{'s' if self.int16_rows > 1 else ''})")
        if self.amx_rows is not None:
            lines.append(f"  (file-bit panels multiply on AMX tiles from {self.amx_rows} rows: the same sums)")
        lines.append(f"batch invariance (a row's result independent of the rows beside it): "
                     f"{'yes' if self.is_batch_invariant else 'no'}")
        lines += [f"  {'yes' if ok else 'no '}  {choice}: {why}" for choice, ok, why in self.batch_invariant]
        lines.append("why:")
        lines += [f"  {reason}" for reason in self.reasons]
        if self.probe is not None:
            lines.append(f"probe: {self.probe.describe()}")
        if self.draft is not None:
            lines.append("draft model (speculative decoding):")
            lines += ["  " + line for line in dataclasses.replace(self.draft, probe=None).render().splitlines()]
        return "\n".join(lines)

    def to_message(self) -> dict[str, Any]:
        """The plan as JSON-ready data (tensor-parallel workers lay their shards out by it); the
        probe's figures stay with rank 0, and so does a draft model's plan (rank 0 runs the draft)."""
        return dataclasses.asdict(dataclasses.replace(self, probe=None, draft=None))

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ExecutionPlan:
        fields = dict(message)
        fields["matrices"] = tuple(MatrixPlan(m["layer"], m["name"], m["stored"], Form(**m["form"]))
                                   for m in fields["matrices"])
        fields["routes"] = tuple(Route(**route) for route in fields["routes"])
        fields["batch_invariant"] = tuple(tuple(entry) for entry in fields["batch_invariant"])
        fields["reasons"] = tuple(fields["reasons"])
        return cls(**fields)


def _widths(kind: list[Route], route: Route) -> str:
    """", 1-8 rows" for a route among several of its kind; "" for the only one."""
    if len(kind) == 1:
        return ""
    start = 1 + max([r.max_rows for r in kind if r.max_rows < route.max_rows], default=0)
    return f", {start}+ rows" if route.max_rows >= EVERY_WIDTH else f", {start}-{route.max_rows} rows"


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


def refuse(config: Any, world_size: int) -> None:
    """Stage 0: what no plan runs. EngineConfig asks this at construction, and resolve_plan again.

    Raises:
        ValueError: a choice tensor parallelism or speculative decoding cannot make, named.
    """
    if world_size > 1 and config.overrides.kernels == "blockdot":
        raise ValueError(f"kernels='blockdot' with tensor_parallel_size={world_size}: the ranks run blockdot only on "
                         "the batch-invariant plan, which batch_invariant='auto' or True takes; use kernels='auto' or "
                         "'torch'")
    if world_size > 1 and config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} with tensor_parallel_size={world_size}: each "
                         "rank's cache is in its model's dtype; use 'auto'")
    if world_size > 1 and config.compile:
        raise ValueError(f"compile=True with tensor_parallel_size={world_size}: the compiled layer would have to "
                         "trace the all-reduces inside it; use compile=False")
    if config.speculative_config is not None and config.batch_invariant is False:
        raise ValueError("speculative_config with batch_invariant=False: verifying k drafts as k + 1 rows gives "
                         "greedy's tokens only where a row's logits do not depend on the step's width; use "
                         "batch_invariant='auto' or True")


def resolve_plan(config: Any, model: LlamaModel, world_size: int = 1, probe: Any = None,
                 draft: LlamaModel | None = None) -> ExecutionPlan:
    """The plan for running `model` (as loaded, or laid out by another engine) under `config` (an
    EngineConfig) on `world_size` tensor-parallel ranks, with `draft` (a speculative config's draft
    model, as loaded) planned beside it. probe: in place of precision.probe_cpu.

    config.batch_invariant True or "auto" asks for the invariant plan: every step, prompts included,
    in one C call at every width, every matmul on blockdot's panels or dense panels (see
    _batch_invariance); "auto" takes the other plan where the config's own choices rule it out
    (the exact path among them), True refuses them.

    Raises:
        ValueError: a choice the config names that cannot run here (refuse's, precision.resolve's),
            batch_invariant=True with a choice no invariant plan can make, or a speculative config
            whose plan is not batch-invariant, named.
    """
    refuse(config, world_size)
    if world_size > 1 and model.config.is_moe:
        raise ValueError(f"tensor_parallel_size={world_size} with a mixture-of-experts model "
                         f"({model.config.architecture}): nanoserve does not cut experts across ranks; use 1")
    plan = _plan(config, model, world_size, probe)
    spec = config.speculative_config
    if spec is not None and not plan.is_batch_invariant:
        raise ValueError("speculative_config needs the batch-invariant plan (a row's logits the same at any step "
                         f"width, so verified drafts give greedy's tokens), and this config rules it out: "
                         f"{'; '.join(c for c, ok, _ in plan.batch_invariant if not ok)}"
                         + ("; batch_invariant=True runs dtype float32 on dense panels"
                            if config.dtype == "float32" and config.quantization is None else ""))
    return plan if draft is None else with_draft(plan, config, draft, probe)


def with_draft(plan: ExecutionPlan, config: Any, draft: LlamaModel, probe: Any = None) -> ExecutionPlan:
    """`plan` with a plan for the speculative config's draft model (as loaded) beside it: resolved
    from the engine's config as the target's is, but for the speculative config's quantization, in
    one process."""
    own = dataclasses.replace(config, quantization=config.speculative_config.quantization, speculative_config=None,
                              tensor_parallel_size=1)
    return dataclasses.replace(plan, draft=_plan(own, draft, 1, probe))


def _plan(config: Any, model: LlamaModel, world_size: int, probe: Any) -> ExecutionPlan:
    """Stage 1: the invariant plan where it is asked for and nothing rules it out, else the other."""
    if config.kv_cache_dtype in BLOCK_BYTES:  # before anything is laid out or allocated
        kv_quant.check(config.kv_cache_dtype, model.config.head_dim)
    wanted = config.batch_invariant
    c_reason = why_not(model.config, torch.device(config.device))  # why fused_decode.c cannot run it (None: it can)
    blockers = [] if wanted is False else invariance_blockers(config, c_reason)
    if wanted is True and blockers:
        raise ValueError(f"batch_invariant=True, but {'; '.join(blockers)}; use batch_invariant='auto' or False")
    if wanted is not False and not blockers:
        plan = _resolve(config, model, world_size, probe, True, (), c_reason)
        off_c = [m for m in plan.matrices if not m.form.name.in_c]
        if not off_c:
            return plan
        blockers = [f"{_where(off_c[0])} stored {off_c[0].stored} runs on {off_c[0].form.name}, outside C"]
        if wanted is True:
            raise ValueError(f"batch_invariant=True, but {blockers[0]}; use batch_invariant='auto' or False")
    return _resolve(config, model, world_size, probe, False, tuple(blockers), c_reason)


def invariance_blockers(config: Any, c_reason: str | None) -> list[str]:
    """The config's choices that rule the batch-invariant plan out, each said as the reason (empty:
    none does); c_reason: why fused_decode.c cannot run the model (fused_decode.why_not), or None.
    The exact path is one only where batch_invariant is "auto": asked for by True, its float32 runs
    on dense panels instead of torch's ops."""
    overrides = config.overrides
    found = []
    if c_reason is not None:
        found.append(f"no C decode: {c_reason}")
    if config.compile:
        found.append("torch.compile runs torch's kernels")
    if config.batch_invariant == "auto" and _is_exact(config):
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


def _is_exact(config: Any) -> bool:
    return config.dtype == "float32" and config.quantization is None


def _where(m: MatrixPlan) -> str:
    return "the head" if m.layer is None else f"layer {m.layer} {m.name}"


def _resolve(config: Any, model: LlamaModel, world_size: int, probe: Any, invariant: bool,
             blockers: tuple[str, ...], c_reason: str | None) -> ExecutionPlan:
    """The plan, the invariant one where `invariant` (blockers: why not, where it was asked for):
    stages 2-4 (the precision, each matrix's form, the routes)."""
    device = torch.device(config.device)
    parallel, compiled = world_size > 1, config.compile
    c_parallel = parallel and invariant  # every rank's layers in C calls between its all-reduces
    exact = _is_exact(config) and not invariant
    overrides = config.overrides
    c_decode = overrides.fused_decode if overrides.fused_decode != "auto" else not exact
    reasons = []
    if c_parallel:
        reasons.append("batch invariant: every step in three C calls a layer between the matmuls at every width, "
                       "every matmul on blockdot's or dense panels, o and down summed over the ranks in rank order")
    elif invariant and model.config.is_moe:
        reasons.append("batch invariant: every step in one C call at every width, every matmul on blockdot's or "
                       "dense panels, each row's experts summed in rank order")
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
    if c_decode and c_reason is not None:
        reasons.append(f"no C decode: {c_reason}")
        c_decode = False

    # Stage 2: the precision.
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
                        chosen_by="the invariant plan's" if invariant else "as configured",
                        amx=overrides.blockdot_amx_rows)
    reasons += precision.reasons
    dtype = precision.torch_dtype
    if c_decode and dtype not in C_DTYPES:
        reasons.append(f"no C decode: the model computes in {dtype_name(dtype)}")
        c_decode = False
    pack_weights = overrides.pack_weights and not compiled

    # Stage 3: each matrix's form.
    if precision.dense_kernel == "blockdot" and dtype in C_DTYPES:
        dense = Form(FormKind.DENSE_PANELS, precision.dtype)
    else:
        dense = Form(FormKind.ONEDNN if pack_weights and can_pack(dtype, device) else FormKind.TORCH, precision.dtype)
    unrun: set[str] = set()  # stored kinds no kernel here runs: dequantized at load
    int16_rows = overrides.blockdot_int16_rows
    named = {}  # (layer, name) -> its first weight: a sparse layer's experts share a name and a form
    for layer, name, w in model.matrices():
        named.setdefault((layer, name), w)
    matrices = tuple(MatrixPlan(layer, name, _stored(w.form),
                                dataclasses.replace(dense, all_reduced=w.form.all_reduced) if name in DENSE_ONLY else
                                _form_of(layer, w.form, precision, dense, invariant, int16_rows,
                                         overrides.blockdot_int8 and blockdot.takes_int8(w), unrun))
                     for (layer, name), w in named.items())
    if unrun:
        kinds = ", ".join(sorted(unrun))
        reasons.append(f"{kinds} dequantized at load to {dense.dtype}: no {precision.kernels} kernel here runs "
                       f"{'them' if len(unrun) > 1 else 'it'}")
    on_blockdot = any(m.form.name == FormKind.BLOCKDOT for m in matrices)
    amx_rows = precision.amx_rows if any(m.form.name == FormKind.BLOCKDOT_INT8 for m in matrices) else None

    # Stage 4: the routes.
    routes, copies = _routes(matrices, precision, parallel, compiled, invariant, c_decode)
    if model.config.is_moe:
        reasons += _moe_reasons(matrices, routes)
    exact_run = routes == _one_driver(Driver.TORCH) and all(
        m.form.name in (FormKind.TORCH, FormKind.ONEDNN) and m.form.dtype == "float32" for m in matrices)
    return ExecutionPlan(str(device), precision.dtype, precision.kv_cache_dtype, precision.quantization, matrices,
                         routes, int16_rows if on_blockdot else None, copies, pack_weights, torch.get_num_threads(),
                         exact_run, _batch_invariance(matrices, routes, blockers), tuple(reasons), precision.probe,
                         amx_rows=amx_rows)


def _form_of(layer: int | None, form: Form, precision: Precision, dense: Form, invariant: bool,
             int16_rows: int | None, int8: bool, unrun: set[str]) -> Form:
    """Stage 3 for one matrix as loaded (`form`): the form it runs in (`unrun` gets a stored kind no
    kernel here runs, dequantized to `dense`). int8: the matrix has a file-bit form and may take it."""
    if form.name not in (STORED, FormKind.TORCH) and form.dtype == precision.dtype:
        return form  # laid out by another engine already: kept as it is
    dtype = precision.torch_dtype
    tensor_parallel = {"all_reduced": form.all_reduced, "in_rank_order": form.all_reduced and invariant}
    kind = None
    if precision.quantization == "keep" and form.name == STORED:
        kind = form.stored
    elif precision.quantization == "int8" or (precision.quantization == "int4" and layer is None and not invariant):
        kind = "int8"  # int4's head in int8 (dense where invariant: int8 per channel runs on torch's kernels only)
    elif precision.quantization == "int4":
        kind = "Q4_1"  # nanoserve's int4 is Q4_1's form
    if kind is None:
        return dataclasses.replace(dense, **tensor_parallel)
    on_blockdot = precision.kernels == "blockdot" and blockdot.runs(kind) and dtype in blockdot.DTYPES
    # A kind blockdot does not run stays off torch's kernels where blockdot is this machine's
    # choice: they are its slower path (precision's probe), slower than the dense matrix on AVX2.
    on_torch = torch_runs(kind) and (precision.kernels == "torch" or kind == "int8" or blockdot.runs(kind))
    if not on_blockdot and not on_torch:
        unrun.add(kind)
        return dataclasses.replace(dense, **tensor_parallel)
    if kind == "int8":
        name = FormKind.TORCH_INT8
    elif on_blockdot:  # a K-quant kept at its file's bits on int8 activations where asked, else blockdot's panels
        name = FormKind.BLOCKDOT_INT8 if int8 and precision.quantization == "keep" else FormKind.BLOCKDOT
    else:
        name = FormKind.TORCH_INT4
    rows = precision.max_kernel_rows
    wide = None if rows is None else ("dequantized" if name.in_c and not precision.dense_copies else "dense copy")
    return Form(name, precision.dtype, rows, wide, int16_rows if name == FormKind.BLOCKDOT else None,
                # the 32-weight kinds' file-bit panels stay on the vector tiles (blockdot.c's tasks8_of)
                precision.amx_rows if name == FormKind.BLOCKDOT_INT8
                and not set(kind.split("+")) & set(blockdot.BLOCK_KINDS) else None,
                **tensor_parallel)


def _moe_reasons(matrices: tuple[MatrixPlan, ...], routes: tuple[Route, ...]) -> list[str]:
    """What runs a mixture of experts on the C routes (fused_decode.py's `moe_table`, `_experts_in_c`)."""
    drivers = {route.driver for route in routes}
    experts = [m.form for m in matrices if m.name.startswith(("experts.", "shared."))]
    found = []
    if Driver.C_ONE_CALL in drivers:
        found.append("the sparse layers' MLP in the one call: routed in float32 in C, each expert's matmuls over the "
                     "step's rows that chose it, each row's k results summed in rank order")
    if Driver.C_PER_LAYER in drivers:
        in_c = all(f.name.in_c and f.kernel_rows is None for f in experts)
        found.append("c-per-layer steps: the sparse layers' MLP " + (
            "in one C call a layer (fused_moe), the one call's arithmetic" if in_c else
            "in torch between the C calls (moe.py), the experts' matmuls grouped by expert in their forms"))
    return found


def _one_driver(driver: Driver) -> tuple[Route, ...]:
    return Route(False, EVERY_WIDTH, driver), Route(True, EVERY_WIDTH, driver)


def _routes(matrices: tuple[MatrixPlan, ...], precision: Precision, parallel: bool, compiled: bool, invariant: bool,
            c_decode: bool) -> tuple[tuple[Route, ...], bool]:
    """Stage 4: the step table, and whether the one call reads dense copies of matrices torch runs."""
    if parallel and invariant:  # fused_decode.c's one call has no place for an all-reduce
        return _one_driver(Driver.C_TENSOR_PARALLEL), False
    if invariant:
        return _one_driver(Driver.C_ONE_CALL), False
    torch_driver = (Driver.TORCH_TENSOR_PARALLEL if parallel else Driver.TORCH_COMPILED if compiled else Driver.TORCH)
    with_prompt = Route(True, EVERY_WIDTH, torch_driver)
    if not c_decode:
        return (Route(False, EVERY_WIDTH, torch_driver), with_prompt), False
    layer_matrices = [m for m in matrices if m.layer is not None]
    on_torch = [m for m in layer_matrices if m.form.name in (FormKind.TORCH, FormKind.ONEDNN)]
    if not all(m.form.name.in_c for m in layer_matrices if m not in on_torch):
        return (Route(False, EVERY_WIDTH, Driver.C_PER_LAYER), with_prompt), False
    dense_rows = DENSE_ONE_CALL_ROWS | {torch.bfloat16: precision.bf16_one_call_rows}
    # a router's or a shared gate's copy (X E or E weights) does not cap the one call's width as a layer's matrices do
    wide = any(m.name not in DENSE_ONLY for m in on_torch)
    one_call_rows = min([dense_rows[precision.torch_dtype]] * wide + [EVERY_WIDTH]
                        + [m.form.kernel_rows for m in layer_matrices if m.form.kernel_rows is not None])
    if one_call_rows >= EVERY_WIDTH:
        return (Route(False, EVERY_WIDTH, Driver.C_ONE_CALL), with_prompt), bool(on_torch)
    return (Route(False, one_call_rows, Driver.C_ONE_CALL), Route(False, EVERY_WIDTH, Driver.C_PER_LAYER),
            with_prompt), bool(on_torch)


def _batch_invariance(matrices: tuple[MatrixPlan, ...], routes: tuple[Route, ...],
                      blockers: tuple[str, ...] = ()) -> tuple[tuple[str, bool, str], ...]:
    """Which of the plan's choices leave a row's result independent of the rows beside it (the other
    rows of its step, its place among them, the step's width, where its prompt was cut into chunks).
    Only what holds by construction is a yes; tests/test_batch_invariance.py holds the plan to it."""
    forms = {m.form for m in matrices}
    entries = []
    one_call = routes == _one_driver(Driver.C_ONE_CALL)
    per_layer = routes in (_one_driver(Driver.C_TENSOR_PARALLEL), _one_driver(Driver.C_PER_LAYER))
    if one_call:
        entries.append(("every step in one C call at every width, prompts too", True,
                        "a prompt's token is a row like a decode's: its K/V written to the cache, then its query "
                        "over its context read back from there, whatever the chunk or step it came in"))
    if per_layer:
        entries.append(("every step in three C calls a layer at every width, prompts too", True,
                        "the one call's glue, row by row, and its attention: a prompt's token is a row like a "
                        "decode's, whatever the chunk or step it came in"))
    if routes == _one_driver(Driver.C_TENSOR_PARALLEL):
        entries.append(("o and down summed over the ranks in rank order", True,
                        "every rank's partials gathered and added rank 0 first, on every rank, whatever the step's "
                        "width"))
    if one_call or per_layer:
        entries.append(("attention over parts of a row's context cut by its length alone", True,
                        "a row's context cut where its own length says, the parts merged in order, whatever the "
                        "step's width or the threads"))
    if any(m.name.startswith("experts.") for m in matrices):
        entries.append(("the experts' matmuls grouped by expert over the step's rows", True,
                        "each row's k results written at its own slots and summed in rank order by its own routing "
                        "weights: a row's sums do not depend on which rows chose the same expert"))
    for rows, wide in sorted({(f.kernel_rows, f.wide) for f in forms if f.kernel_rows is not None}):
        entries.append((f"quantized kernels up to {rows} rows, {wide} past", False,
                        f"a row's sums change when its step passes {rows} rows"))
    for rows in sorted({f.int16_rows for f in forms if f.int16_rows is not None}):
        entries.append((f"x rounded to int16 from {rows} row{'s' if rows > 1 else ''}", rows == 1,
                        "each row is rounded on its own at every width" if rows == 1
                        else f"a row is rounded only in steps of {rows} rows or more"))
    if any(f.name == FormKind.BLOCKDOT_INT8 for f in forms):
        entries.append(("matrices on file-bit panels, x rounded to int8", True,
                        "each row rounded on its own, its sums exact in int32 and scaled in one order at every width"))
    for rows in sorted({f.amx_rows for f in forms if f.amx_rows is not None}):
        entries.append((f"file-bit panels on AMX tiles from {rows} rows", True,
                        "the tiles' int32 sums are the vector tiles', scaled by the same float steps in the same "
                        "order: a row's bits the same on either (tests/test_blockdot_int8.py)"))
    if any(f.name.on_torch for f in forms):
        entries.append(("torch's matmuls", False, "oneDNN and MKL block a matmul by its row count: in float32 a row "
                        "sums in another order at 1, 2-3 and 4 or more rows"))
    if any(f.name.in_c and f.kernel_rows is None for f in forms):
        entries.append(("blockdot's panels and dense panels", True,
                        "a row's sums run in one order whatever tile or call it is in (tests/test_blockdot.py)"))
    decode = [r for r in routes if not r.with_prompt]
    mixed = next(r.driver for r in routes if r.with_prompt)
    if len(decode) > 1:
        entries.append((f"decode steps: {decode[0].driver} up to {decode[0].max_rows} rows, {decode[-1].driver} past",
                        False, "the two compute the glue in a different order"))
    if decode[0].driver != mixed:
        entries.append((f"decode-only steps on {decode[0].driver}, steps with a prompt on {mixed}", False,
                        "a decoding row's arithmetic depends on whether a prompt shares its step"))
    if not mixed.in_c:
        entries.append(("prompts on torch's attention", False,
                        "a prompt's token attends the new keys as computed and the cached ones read back, so "
                        "where its prompt was cut into chunks changes its sums"))
    entries += [(blocker, False, "why the invariant plan was not taken") for blocker in blockers]
    return tuple(entries)


def check_laid_out(model: LlamaModel, plan: ExecutionPlan, draft: LlamaModel | None = None) -> list[str]:
    """How a laid-out model (and the draft model beside it, where the plan has one) differs from its
    plan (empty: it runs what the plan says): each matmul's form (its kernel, rows, int16 rounding,
    rank-order sum), the dtype, the plan the model dispatches by, its table of drivers, and what
    fused_decode.c reads."""
    problems = [f"{'head' if layer is None else f'layer {layer} {name}'}: runs {w.form}, the plan says "
                f"{plan.form_of(layer, name)}"
                for layer, name, w in model.matrices() if w.form != plan.form_of(layer, name)]
    if model.dtype != plan.torch_dtype:
        problems.append(f"the model computes in {model.dtype}, the plan says {plan.dtype}")
    if model.plan is None or model.plan.routes != plan.routes:
        problems.append("the model routes its steps by another table than the plan's")
    if set(model.drivers) != plan.drivers:
        problems.append(f"the model's drivers are {_names(model.drivers)}, the plan routes to {_names(plan.drivers)}")
    problems += [f"the model's table calls {step.__name__} for {driver}, not {STEPS[driver].__name__}"
                 for driver, step in model.drivers.items() if driver in STEPS and step is not STEPS[driver]]
    fused = model.fused_layers
    in_c = any(driver.in_c for driver in plan.drivers)
    if in_c != (fused is not None):
        problems.append(f"the plan's drivers are {_names(plan.drivers)}, the model's fused decode is {fused}")
    elif fused is not None:
        if bool(fused.forms) != (Driver.C_ONE_CALL in plan.drivers):
            problems.append(f"the fused decode {'reads' if fused.forms else 'has no'} C forms for the one call, the "
                            f"plan's drivers are {_names(plan.drivers)}")
        if fused.shape.int16_rows != (plan.int16_rows or 0):
            problems.append(f"fused_decode.c rounds x to int16 from {fused.shape.int16_rows} rows (0: never), the "
                            f"plan says {plan.int16_rows}")
        if fused.shape.amx_rows != (plan.amx_rows or 0):
            problems.append(f"fused_decode.c takes AMX tiles from {fused.shape.amx_rows} rows (0: never), the "
                            f"plan says {plan.amx_rows}")
    if (plan.draft is None) != (draft is None):
        problems.append("the plan has a draft model's plan and no draft model is given" if draft is None
                        else "a draft model is given and the plan has no plan for it")
    elif draft is not None:
        problems += [f"draft model: {problem}" for problem in check_laid_out(draft, plan.draft)]
    return problems


def _names(drivers: Any) -> list[str]:
    return sorted(str(driver) for driver in drivers)
