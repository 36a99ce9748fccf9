"""The seeds' `nanoserve.baseline`: run records, the paired comparison and its gates
(`nanoserve.instruments.baseline`) and the runners that produce them (`nanoserve.instruments.runners`).
"""

from __future__ import annotations

from nanoserve.instruments.baseline import (  # noqa: F401
    Comparison,
    Doubling,
    GenerateOne,
    RunRecord,
    RunUnsound,
    SystemRun,
    UnfairComparison,
    check_concurrent,
    check_serial,
    compare,
    first_divergence,
    marginal_doublings,
    render,
    render_doublings,
)
from nanoserve.instruments.runners import (  # noqa: F401
    hf_generate_one,
    run_concurrent,
    run_serial,
)

__all__ = ['Comparison', 'Doubling', 'GenerateOne', 'RunRecord', 'RunUnsound', 'SystemRun', 'UnfairComparison', 'check_concurrent', 'check_serial', 'compare', 'first_divergence', 'hf_generate_one', 'marginal_doublings', 'render', 'render_doublings', 'run_concurrent', 'run_serial']
