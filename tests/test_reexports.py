"""nanoserve.profiler, nanoserve.output and nanoserve.baseline: the seeds' module names re-export every
name they always had, each the very object its home module defines (the table below is the layout)."""

from __future__ import annotations

import importlib
import inspect

import pytest

INSTRUMENTS = "nanoserve.instruments"
HOMES = {
    "nanoserve.profiler": {
        f"{INSTRUMENTS}.profile": ["DEVICE_BOUND", "FORWARD", "HOST_BOUND", "ProfileUnsound", "StepProfile"],
        f"{INSTRUMENTS}.profile_pricing": [
            "MODELS", "OVERLAPPED", "SERIAL", "ModelMismatch", "amdahl", "check_model_applies", "loop_overhead_s",
            "project_point", "recommended_model", "speedup_if", "step_time_under", "step_with_compute",
        ],
        f"{INSTRUMENTS}.profile_gates": [
            "NotDeviceTimed", "NotWarmedUp", "Unaccounted", "Unattributable", "bar", "check_accounted",
            "check_attributable", "check_device_timed", "check_warmed_up", "render", "render_sweep",
        ],
        f"{INSTRUMENTS}.recording": [
            "CudaDeviceTimer", "CudaEventTimer", "DeviceTimer", "StepRecorder", "null_recorder_cost_s",
            "step_recorder_cost_s",
        ],
        "nanoserve.recorder": ["NULL_RECORDER", "PHASES", "NullRecorder", "Phase", "StepSample"],
    },
    "nanoserve.output": {
        f"{INSTRUMENTS}.sync": [
            "STRATEGIES", "SyncMeasurement", "overshoot_tokens", "readback_s", "render", "sample_ceiling",
            "saving_per_step", "strategy_speedup", "syncs_per_step",
        ],
        f"{INSTRUMENTS}.sync_gates": [
            "MIN_MEASURABLE_S", "NotDeviceResident", "NotMeasurable", "NotSingleTransfer", "check_device_resident",
            "check_measurable", "check_single_transfer", "measure_transfer_s",
        ],
        "nanoserve.output_processor": ["OutputProcessor"],
        "nanoserve.readback": ["Readback", "RowOrderMismatch", "TokenBatch", "check_in_row_order"],
    },
    "nanoserve.baseline": {
        f"{INSTRUMENTS}.record": ["RunRecord"],
        f"{INSTRUMENTS}.baseline": [
            "Comparison", "RunUnsound", "SystemRun", "UnfairComparison", "check_concurrent", "check_serial", "compare",
            "first_divergence",
        ],
        f"{INSTRUMENTS}.sweep": ["Doubling", "marginal_doublings", "render", "render_doublings"],
        f"{INSTRUMENTS}.runners": ["GenerateOne", "hf_generate_one", "run_concurrent", "run_serial"],
    },
}


@pytest.mark.parametrize("seed_module", sorted(HOMES))
def test_every_seed_name_is_its_home_modules_object(seed_module):
    module = importlib.import_module(seed_module)
    homes = HOMES[seed_module]
    assert sorted(module.__all__) == sorted(name for names in homes.values() for name in names)
    for home, names in homes.items():
        home_module = importlib.import_module(home)
        for name in names:
            obj = getattr(module, name)
            assert obj is getattr(home_module, name), f"{seed_module}.{name} is not {home}.{name}"
            if inspect.isclass(obj) or inspect.isfunction(obj):  # constants and aliases carry no home of their own
                assert obj.__module__ == home, f"{seed_module}.{name} is defined in {obj.__module__}, not {home}"
