"""The mixture-of-experts MLP: a router, then each token's top k of X gated MLPs, summed by their
routing weights (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE; nanoserve.model.config says which family
sets what).

Routing, in float32 as transformers routes: the router's logits [T, X] through a softmax over all
X experts, the top k of each row (ties and order as torch.topk gives them), renormalised to sum
to 1 where the family says (norm_topk_prob; Mixtral always, which is the same as a softmax over
the top k logits).

The experts' matmuls are grouped by expert over the step's rows: for each expert some row chose,
its rows are gathered and run through its own gate_up and down `Weight`s, in whatever form the
execution plan laid them out (dense, dense panels, blockdot's panels over a GGUF's blocks), and
each row's result is written at that row's slot [T, k, E]; then each row sums its k results in
rank order, weighted by its routing weights. A row's output thus depends on its own x alone,
whatever other rows share the step, wherever the matmuls' kernels are row-invariant (the
batch-invariant plan's are). Grouping reads each sparse layer's per-expert row counts back once a
step (as transformers' own loop over the experts hit does). fused_decode.c's moe_mlp is the same
arithmetic in C (the C decode's sparse layers: nanoserve.model.fused_decode), in float32.

Dimension names: T tokens this step, E hidden, X experts, k experts a token runs (top_k),
Ie an expert's gated MLP width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.model.forms import Weight

# Matrices the plan keeps dense whatever the quantization: the router and the shared expert's gate
# are small and decide which experts run (llama.cpp keeps them in F32 in every file type).
DENSE_ONLY = ("router", "shared_gate")


@dataclass(frozen=True)
class MoeWeights:
    """One sparse layer's MLP."""

    router: Weight  # [X, E]
    gate_up: tuple[Weight, ...]  # X of [2 Ie, E]: each expert's gate and up fused into one matmul
    down: tuple[Weight, ...]  # X of [E, Ie]
    top_k: int  # k
    norm_topk_prob: bool  # the k routing weights renormalised to sum to 1
    shared_gate_up: Weight | None = None  # [2 Is, E]: the shared expert every token runs (Qwen2-MoE)
    shared_down: Weight | None = None  # [E, Is]
    shared_gate: Weight | None = None  # [1, E]: the shared expert's output scales by sigmoid(this . x)

    def matrices(self) -> list[tuple[str, Weight]]:
        """Every matmul weight, named as the execution plan names it (all experts of a layer share
        one name, so one form: a file stores them in one tensor of one type)."""
        found = [("router", self.router)] + [("experts.gate_up", w) for w in self.gate_up]
        found += [("experts.down", w) for w in self.down]
        found += [(name, w) for name, w in (("shared.gate_up", self.shared_gate_up), ("shared.down", self.shared_down),
                                            ("shared_gate", self.shared_gate)) if w is not None]
        return found

    def map(self, lay_out: Callable[[str, Weight], Weight]) -> MoeWeights:
        """The same MLP with each weight passed through lay_out(name, weight); self where none changes."""
        changes = {"router": lay_out("router", self.router),
                   "gate_up": tuple(lay_out("experts.gate_up", w) for w in self.gate_up),
                   "down": tuple(lay_out("experts.down", w) for w in self.down)}
        for field, name in (("shared_gate_up", "shared.gate_up"), ("shared_down", "shared.down"),
                            ("shared_gate", "shared_gate")):
            if getattr(self, field) is not None:
                changes[field] = lay_out(name, getattr(self, field))
        same = all(a is b for field, new in changes.items()
                   for a, b in zip(new if isinstance(new, tuple) else (new,),
                                   getattr(self, field) if isinstance(new, tuple) else (getattr(self, field),),
                                   strict=True))
        return self if same else dataclasses.replace(self, **changes)


def route(x: torch.Tensor, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, E] -> (each row's k experts [T, k] int64, best first; their weights [T, k] float32)."""
    probs = torch.softmax(moe.router(x).float(), dim=-1)  # [T, X]
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)  # [T, k] each
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


def _gated(x: torch.Tensor, gate_up: Weight, down: Weight, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = gate_up(x).chunk(2, dim=-1)  # [M, Ie] each
    return down(act(gate) * up)  # [M, E]


def moe_mlp(x: torch.Tensor, moe: MoeWeights, activation: str = "silu") -> torch.Tensor:
    """The sparse MLP: x [T, E] in the matmuls' dtype -> [T, E] in the same dtype."""
    act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    T, E = x.shape
    experts, weights = route(x, moe)  # [T, k] each
    slots = torch.zeros(T, moe.top_k, E, dtype=x.dtype, device=x.device)  # [T, k, E]: each row's k results
    flat = experts.flatten()  # [T k]: row t's rank r at t k + r
    order = torch.argsort(flat, stable=True)  # the (row, rank) slots grouped by expert, rows ascending
    counts = torch.bincount(flat, minlength=len(moe.gate_up)).tolist()  # [X]
    start = 0
    for j, count in enumerate(counts):
        if count:
            chosen = order[start:start + count]  # [M] slots t k + r of the rows that chose expert j
            start += count
            out = _gated(x.index_select(0, chosen // moe.top_k), moe.gate_up[j], moe.down[j], act)  # [M, E]
            slots.view(T * moe.top_k, E).index_copy_(0, chosen, out)
    summed = slots[:, 0].float() * weights[:, :1]  # [T, E] float32, then ranks 1 .. k - 1 in order
    for r in range(1, moe.top_k):
        summed = summed + slots[:, r].float() * weights[:, r:r + 1]
    if moe.shared_gate_up is not None:
        shared = _gated(x, moe.shared_gate_up, moe.shared_down, act).float()  # [T, E]
        summed = summed + torch.sigmoid(moe.shared_gate(x).float()) * shared
    return summed.to(x.dtype)


def from_tensors(config: Any, layer: int, get: Callable[[str], Any], as_weight: Callable[[Any], Weight],
                 cat_rows: Callable[[list[Any]], Any]) -> MoeWeights:
    """Layer `layer`'s sparse MLP from Hugging Face-named tensors (config.expert_shapes' names);
    get(name) returns a tensor in the model's dtype or a quantized matrix as stored."""
    p = f"model.layers.{layer}."
    if config.architecture == "MixtralForCausalLM":
        router = p + "block_sparse_moe.gate.weight"
        names = [tuple(p + f"block_sparse_moe.experts.{j}.{w}.weight" for w in ("w1", "w3", "w2"))
                 for j in range(config.num_experts)]
    else:
        router = p + "mlp.gate.weight"
        names = [tuple(p + f"mlp.experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down"))
                 for j in range(config.num_experts)]
    shared: dict[str, Weight] = {}
    if config.shared_expert_intermediate_size is not None:
        q = p + "mlp.shared_expert."
        shared = {"shared_gate_up": as_weight(cat_rows([get(q + "gate_proj.weight"), get(q + "up_proj.weight")])),
                  "shared_down": as_weight(get(q + "down_proj.weight")),
                  "shared_gate": as_weight(get(p + "mlp.shared_expert_gate.weight"))}
    return MoeWeights(router=as_weight(get(router)),
                      gate_up=tuple(as_weight(cat_rows([get(gate), get(up)])) for gate, up, _ in names),
                      down=tuple(as_weight(get(down)) for _, _, down in names),
                      top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob, **shared)


def unfuse_experts(tensors: Mapping[str, Any], config: Any) -> Mapping[str, Any]:
    """Tensors with transformers' in-memory fused experts (a model's state_dict():
    mlp.experts.gate_up_proj [X, 2 Ie, E], gate rows first, and mlp.experts.down_proj [X, E, Ie],
    under mlp. for Mixtral too, and mlp.gate.weight) renamed to the per-expert tensors a checkpoint
    stores (config.expert_shapes), each a view; `tensors` itself where it holds none."""
    fused = [i for i in range(config.num_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in tensors]
    if not fused:
        return tensors
    out = dict(tensors)
    for i in fused:
        p = f"model.layers.{i}."
        gate_up, down = out.pop(p + "mlp.experts.gate_up_proj"), out.pop(p + "mlp.experts.down_proj")
        if config.architecture == "MixtralForCausalLM":
            out[p + "block_sparse_moe.gate.weight"] = out.pop(p + "mlp.gate.weight")
            q, (gate, up, dn) = p + "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")
        else:
            q, (gate, up, dn) = p + "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj")
        for j, (gu, d) in enumerate(zip(gate_up.unbind(0), down.unbind(0), strict=True)):
            g, u = gu.chunk(2, dim=0)  # [Ie, E] each
            out[q.format(j=j) + f"{gate}.weight"] = g
            out[q.format(j=j) + f"{up}.weight"] = u
            out[q.format(j=j) + f"{dn}.weight"] = d
    return out
