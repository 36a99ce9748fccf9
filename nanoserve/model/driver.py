"""Who runs a step's layers: the drivers the execution plan routes each kind and width of step to
(nanoserve.model.plan), and the one table a laid-out model calls them from (LlamaModel.drivers)."""

from __future__ import annotations

from enum import StrEnum


class Driver(StrEnum):
    """A way to run a step's decoder layers. A StrEnum: each equals its name as a string."""

    C_ONE_CALL = "c-one-call"
    C_PER_LAYER = "c-per-layer"
    C_TENSOR_PARALLEL = "c-tensor-parallel"
    TORCH = "torch"
    TORCH_COMPILED = "torch-compiled"
    TORCH_TENSOR_PARALLEL = "torch-tensor-parallel"

    @property
    def in_c(self) -> bool:
        """Whether fused_decode.c runs its glue (the model then carries a FusedDecode)."""
        return self in (Driver.C_ONE_CALL, Driver.C_PER_LAYER, Driver.C_TENSOR_PARALLEL)

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Driver.C_ONE_CALL: "every layer in one C call (fused_decode.c), its matmuls on blockdot's or dense panels",
    Driver.C_PER_LAYER: "each layer's matmuls as their forms run them, the glue between them in three C calls",
    Driver.C_TENSOR_PARALLEL: "each rank's slices on blockdot's or dense panels, the glue between them in three C "
                              "calls a layer, o and down summed over the ranks in rank order",
    Driver.TORCH: "llama.decoder_layer in torch's ops (the reference)",
    Driver.TORCH_COMPILED: "llama.decoder_layer through torch.compile",
    Driver.TORCH_TENSOR_PARALLEL: "llama.decoder_layer over this rank's slices, o and down all-reduced",
}
EVERY_WIDTH = 2**31  # a route's max_rows where it takes steps of every width
