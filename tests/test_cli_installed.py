"""The `nanoserve` command as pip installed it: pyproject's entry point names a real function, and
the console script next to this interpreter runs and lists every command."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.model import default
from nanoserve.serving.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def test_the_entry_point_names_an_importable_function():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, function = scripts["nanoserve"].partition(":")
    assert callable(getattr(importlib.import_module(module_name), function))


def test_the_installed_command_lists_every_command(tmp_path):
    script = Path(sys.executable).with_name("nanoserve")
    if not script.exists():
        pytest.skip(f"no installed console script at {script}: `pip install -e .` puts it there")
    # From an empty directory, so the package comes from the installation, not the working directory.
    proc = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: nanoserve <command>")
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)


@pytest.mark.weights
def test_the_installed_plan_command_prints_what_the_default_model_runs(tmp_path, default_model_dir):
    script = Path(sys.executable).with_name("nanoserve")
    if not script.exists():
        pytest.skip(f"no installed console script at {script}: `pip install -e .` puts it there")
    proc = subprocess.run([str(script), "plan"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("nanoserve plan: the embedded default model (LlamaForCausalLM, 30 layers")
    # the GGUF's Q4_1 layers and Q8_0 head, each named with the form it runs in; the steps and the why
    assert "layers 0-29 qkv            Q4_1 -> " in out and "head                       Q8_0 -> " in out
    for section in ("matrices:", "steps:", "batch invariance", "why:", "weights: "):
        assert section in out
    # the engine started, so the laid-out model matched this plan (Engine refuses to start otherwise)
    # the default plan is the batch-invariant one; --batch-invariant false asks for the fastest
    assert "batch invariance (a row's result independent of the rows beside it): yes" in out
    assert "with a prompt: c-one-call" in out
    proc = subprocess.run([str(script), "plan", "--batch-invariant", "false"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batch invariance (a row's result independent of the rows beside it): no" in proc.stdout
    assert "with a prompt: torch" in proc.stdout
    # a draft model's own plan is printed after the target's: the default model drafting for itself
    # (min_acceptance fixed: no start-up timing)
    spec = json.dumps({"method": "draft_model", "model": str(default.gguf_path()), "num_speculative_tokens": 2,
                       "min_acceptance": 0.0})
    proc = subprocess.run([str(script), "plan", "--speculative-config", spec], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    target, draft = proc.stdout.split("draft model (speculative decoding):\n")
    assert "  steps:\n    decode-only: " in draft and "    layers 0-29 qkv            Q4_1 -> " in draft
    assert "draft_quantized" in draft and "probe:" not in draft  # the probe is printed once, with the target's
    # two ranks: each rank's o and down summed in rank order, every step on the ranks' C calls
    proc = subprocess.run([str(script), "plan", "--tensor-parallel-size", "2"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layers 0-29 o              Q4_1 -> " in proc.stdout and "all-reduced in rank order" in proc.stdout
    assert "decode-only: c-tensor-parallel" in proc.stdout and "with a prompt: c-tensor-parallel" in proc.stdout
