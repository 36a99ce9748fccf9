"""What every rank does to start: read its slices into a model, then lay that model out by the
execution plan rank 0 resolved and allocate its KV cache (its own heads, rank 0's number of blocks).

Rank 0 (nanoserve.parallel.model) and the workers (nanoserve.parallel.worker) run these same
functions on the messages rank 0 publishes, so every rank's model is laid out alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import LlamaModel
from nanoserve.model.plan import ExecutionPlan, check_laid_out
from nanoserve.model.precision import KV_DTYPES
from nanoserve.model.prepare import prepare_model
from nanoserve.model.shard import shard_model
from nanoserve.model.shard_load import read_shard
from nanoserve.parallel.group import TensorParallelGroup


def load_rank(group: TensorParallelGroup, spec: dict[str, Any],
              model_class: type[LlamaModel] = LlamaModel) -> LlamaModel:
    """This rank's model as stored (dense weights in float32, a GGUF's quantized matrices as stored),
    from spec = {"path", "is_gguf", "max_positions"}."""
    config, shard, tensors = read_shard(Path(spec["path"]), spec["is_gguf"], group.rank, group.world_size)
    return shard_model(config, tensors, shard, group.data, group.stats, torch.float32, group.device,
                       spec["max_positions"], model_class)


def layout_message(plan: ExecutionPlan, num_blocks: int, block_size: int) -> dict[str, Any]:
    """What rank 0 tells every worker once it has laid its own shard out and sized its KV pool."""
    return {"plan": plan.to_message(), "num_blocks": num_blocks, "block_size": block_size}


def lay_out_rank(model: LlamaModel, layout: dict[str, Any], device: torch.device) -> tuple[LlamaModel, KVCache]:
    """The model laid out by rank 0's plan (as Engine lays rank 0's out) and its KV cache.

    Raises:
        RuntimeError: the laid-out shard differs from the plan.
    """
    plan = ExecutionPlan.from_message(layout["plan"])
    model = prepare_model(model, plan)
    mismatches = check_laid_out(model, plan)
    if mismatches:
        raise RuntimeError(f"this rank's laid-out shard differs from rank 0's plan: {mismatches[:4]}")
    return model, KVCache(model.config, layout["num_blocks"], layout["block_size"], KV_DTYPES[plan.kv_cache_dtype], device)
