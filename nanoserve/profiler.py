"""The seeds' `nanoserve.profiler`: every name of the step profiler, re-exported from where it lives.

The records and the null recorder the engine carries are in `nanoserve.recorder`; the recorder
that measures in `nanoserve.instruments.recording`; the profile in `nanoserve.instruments.profile`;
the arithmetic that prices a change in `nanoserve.instruments.profile_pricing`; the gates and the
tables in `nanoserve.instruments.profile_gates`.
"""

from __future__ import annotations

from nanoserve.instruments.profile import (  # noqa: F401
    DEVICE_BOUND,
    FORWARD,
    HOST_BOUND,
    ProfileUnsound,
    StepProfile,
)
from nanoserve.instruments.profile_gates import (  # noqa: F401
    NotDeviceTimed,
    NotWarmedUp,
    Unaccounted,
    Unattributable,
    bar,
    check_accounted,
    check_attributable,
    check_device_timed,
    check_warmed_up,
    render,
    render_sweep,
)
from nanoserve.instruments.profile_pricing import (  # noqa: F401
    MODELS,
    OVERLAPPED,
    SERIAL,
    ModelMismatch,
    amdahl,
    check_model_applies,
    loop_overhead_s,
    project_point,
    recommended_model,
    speedup_if,
    step_time_under,
    step_with_compute,
)
from nanoserve.instruments.recording import (  # noqa: F401
    CudaDeviceTimer,
    CudaEventTimer,
    DeviceTimer,
    StepRecorder,
    null_recorder_cost_s,
    step_recorder_cost_s,
)
from nanoserve.recorder import (  # noqa: F401
    NULL_RECORDER,
    PHASES,
    NullRecorder,
    Phase,
    StepSample,
)

__all__ = ['CudaDeviceTimer', 'CudaEventTimer', 'DEVICE_BOUND', 'DeviceTimer', 'FORWARD', 'HOST_BOUND', 'MODELS', 'ModelMismatch', 'NULL_RECORDER', 'NotDeviceTimed', 'NotWarmedUp', 'NullRecorder', 'OVERLAPPED', 'PHASES', 'Phase', 'ProfileUnsound', 'SERIAL', 'StepProfile', 'StepRecorder', 'StepSample', 'Unaccounted', 'Unattributable', 'amdahl', 'bar', 'check_accounted', 'check_attributable', 'check_device_timed', 'check_model_applies', 'check_warmed_up', 'loop_overhead_s', 'null_recorder_cost_s', 'project_point', 'recommended_model', 'render', 'render_sweep', 'speedup_if', 'step_recorder_cost_s', 'step_time_under', 'step_with_compute']
