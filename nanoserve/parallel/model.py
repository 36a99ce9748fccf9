"""Rank 0 of a tensor-parallel engine: its shard of the model, whose forward is the whole model's.

Rank 0 keeps everything but its share of the matmuls: the scheduler, the block allocator, the
sampler and the output stage run here, once. Each step its forward broadcasts the step's plan
(ModelInputs: token ids, positions, slot mapping, block tables, as nanoserve.parallel.plan packs
them), runs its own heads and MLP columns, meeting the workers in every all-reduce, and gathers
their vocabulary rows into logits [R, V]. The engine sees a LlamaModel like any other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.kv_cache import KVCache
from nanoserve.model.llama import LlamaModel, ModelInputs
from nanoserve.model.plan import ExecutionPlan
from nanoserve.model.shard import CollectiveError, Range, vocab_ranges
from nanoserve.model.shard_load import check_split
from nanoserve.model.weights import checkpoint_source, load_tokenizer
from nanoserve.parallel.cpus import take_share
from nanoserve.parallel.group import TensorParallelGroup, WorkerFailure, is_torchrun, join_torchrun, launch
from nanoserve.parallel.plan import encode
from nanoserve.parallel.rank import layout_message, load_rank


class TensorParallelModel(LlamaModel):
    """Rank 0's shard (see the module docstring). `group` and `vocab_ranges` are set by
    load_tensor_parallel; a prepared copy shares them."""

    group: TensorParallelGroup
    vocab_ranges: list[Range]  # each rank's rows of the vocabulary

    def forward(self, inputs: ModelInputs, kv: KVCache) -> torch.Tensor:
        """Logits [R, V] in float32, as LlamaModel.forward returns them.

        Raises:
            WorkerFailure: a worker died or hung (within the group's timeout), or rank 0's own
                forward raised after the plan went out; every later step raises it too, and
                Engine.close() still ends the processes.
        """
        if inputs.pooled_indices is not None:  # Engine.add_request refuses these first
            raise ValueError("embedding requests (ModelInputs.pooled_indices) are not served by a tensor-parallel model")
        group = self.group
        if group.failure is not None:
            raise WorkerFailure(group.failure)
        try:
            group.send_plan(encode(inputs))
        except CollectiveError as e:
            raise group.broke(e) from e
        # From here the workers are inside this step's collectives: any fault of rank 0's own (not
        # only a collective's) leaves them waiting for an all-reduce that will never come, so the
        # group is broken and the step's fault is not one the engine can recover from.
        try:
            logits = super().forward(inputs, kv)  # [R, V_0]
            return group.gather_logits(logits, self.vocab_ranges)  # [R, V]
        except Exception as e:
            raise group.broke(e) from e

    __call__ = forward


def load_tensor_parallel(path: str | Path | None, config: Any) -> tuple[TensorParallelModel, Any]:
    """Starts the group (workers of its own, or torchrun's ranks), has every rank read its slices
    of the checkpoint at `path` (as Engine.from_pretrained reads it), and returns rank 0's model,
    as stored, with the tokenizer. Engine's constructor lays the model out, then calls `start`.

    Raises:
        ValueError: the model does not split into config.tensor_parallel_size shards (raised before
            any process starts), naming why; under torchrun, a WORLD_SIZE other than
            config.tensor_parallel_size, or this process not rank 0.
        WorkerFailure: a worker failed to start or to load, naming its rank and error.
    """
    device = torch.device(config.device)
    size = config.tensor_parallel_size
    source, is_gguf = checkpoint_source(path)
    check_split(source, is_gguf, size)
    if is_torchrun():
        group = join_torchrun(config.tensor_parallel_timeout_s, device)
        if (group.rank, group.world_size) != (0, size):
            raise ValueError(f"this torchrun process is rank {group.rank} of {group.world_size}; an Engine runs on "
                             f"rank 0 of tensor_parallel_size={size} (the others run nanoserve.parallel.worker)")
    else:
        group = launch(size, config.tensor_parallel_timeout_s, device)
    try:
        spec = {"path": str(source), "is_gguf": is_gguf, "device": config.device,
                "max_positions": config.max_model_len, "threads": config.tensor_parallel_threads}
        group.publish("spec", spec)
        group.restore = (torch.get_num_threads(), os.sched_getaffinity(0))
        take_share(0, size, config.tensor_parallel_threads)
        group.await_reports("joined")
        group.connect()
        model = load_rank(group, spec, TensorParallelModel)
        group.await_reports("loaded")
        tokenizer = load_tokenizer(source, is_gguf)
    except BaseException:
        group.close()
        raise
    model.group = group
    model.vocab_ranges = vocab_ranges(model.config.vocab_size, size)
    return model, tokenizer


def start(model: TensorParallelModel, plan: ExecutionPlan, num_blocks: int, block_size: int) -> None:
    """Has every worker lay its shard out as rank 0's was and allocate `num_blocks` KV blocks, then
    enter its step loop.

    Raises:
        WorkerFailure: naming the worker that failed, and its error.
    """
    group = model.group
    group.publish("layout", layout_message(plan, num_blocks, block_size))
    group.await_reports("ready")
    group.is_running = True
