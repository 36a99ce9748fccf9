"""Tensor parallelism over torch.distributed: every layer split across N processes (gloo on a CPU,
NCCL on CUDA), started by the engine on one machine or by torchrun on several.

- nanoserve.model.shard / shard_load: which slice each rank holds, and reading only that slice;
- group: rendezvous, the two process groups, start-up messages, failure and shutdown;
- plan: a step's ModelInputs as bytes for a broadcast;
- rank: what every rank does to start (load its slices, lay them out, allocate its KV cache);
- model: rank 0's model, whose forward sends the plan and gathers the logits;
- worker: ranks 1 .. N-1;
- cpus: each rank's threads and NUMA node.
"""

from nanoserve.parallel.group import WorkerFailure
from nanoserve.parallel.model import TensorParallelModel, load_tensor_parallel, start

__all__ = ["TensorParallelModel", "WorkerFailure", "load_tensor_parallel", "start"]
