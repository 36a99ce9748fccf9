"""The seeds' `nanoserve.baseline`, re-exported from where each name lives: the per-request record
(`nanoserve.instruments.record`), runs, their gates and the paired comparison
(`nanoserve.instruments.baseline`), the slot sweep's tables (`nanoserve.instruments.sweep`) and
the runners that produce runs (`nanoserve.instruments.runners`).
"""

from __future__ import annotations

from nanoserve.instruments.baseline import (  # noqa: F401
    Comparison,
    RunUnsound,
    SystemRun,
    UnfairComparison,
    check_concurrent,
    check_serial,
    compare,
    first_divergence,
)
from nanoserve.instruments.record import RunRecord  # noqa: F401
from nanoserve.instruments.runners import (  # noqa: F401
    GenerateOne,
    hf_generate_one,
    run_concurrent,
    run_serial,
)
from nanoserve.instruments.sweep import (  # noqa: F401
    Doubling,
    marginal_doublings,
    render,
    render_doublings,
)

__all__ = ['Comparison', 'Doubling', 'GenerateOne', 'RunRecord', 'RunUnsound', 'SystemRun', 'UnfairComparison', 'check_concurrent', 'check_serial', 'compare', 'first_divergence', 'hf_generate_one', 'marginal_doublings', 'render', 'render_doublings', 'run_concurrent', 'run_serial']
