"""The seeds' `nanoserve.output`: the readback layer and its arithmetic, re-exported from where they live.

`Readback`, `TokenBatch` and `check_in_row_order` are how tokens come home (`nanoserve.readback`), `OutputProcessor`
the engine's output stage
(`nanoserve.output_processor`); the sync-cost arithmetic and syncbench's table are an instrument
(`nanoserve.instruments.sync`), and so are measuring a journey and the gates
(`nanoserve.instruments.sync_gates`).
"""

from __future__ import annotations

from nanoserve.instruments.sync import (  # noqa: F401
    STRATEGIES,
    SyncMeasurement,
    overshoot_tokens,
    readback_s,
    render,
    sample_ceiling,
    saving_per_step,
    strategy_speedup,
    syncs_per_step,
)
from nanoserve.instruments.sync_gates import (  # noqa: F401
    MIN_MEASURABLE_S,
    NotDeviceResident,
    NotMeasurable,
    NotSingleTransfer,
    check_device_resident,
    check_measurable,
    check_single_transfer,
    measure_transfer_s,
)
from nanoserve.output_processor import OutputProcessor  # noqa: F401
from nanoserve.readback import (  # noqa: F401
    Readback,
    RowOrderMismatch,
    TokenBatch,
    check_in_row_order,
)

__all__ = ['MIN_MEASURABLE_S', 'NotDeviceResident', 'NotMeasurable', 'NotSingleTransfer', 'OutputProcessor', 'Readback', 'RowOrderMismatch', 'STRATEGIES', 'SyncMeasurement', 'TokenBatch', 'check_device_resident', 'check_in_row_order', 'check_measurable', 'check_single_transfer', 'measure_transfer_s', 'overshoot_tokens', 'readback_s', 'render', 'sample_ceiling', 'saving_per_step', 'strategy_speedup', 'syncs_per_step']
