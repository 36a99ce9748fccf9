"""benchmarks/evalbench.py: its tasks' documents checked against the text by hand, and lm-evaluation-harness
run against `nanoserve serve` on the exact path, scoring the multiple-choice task as its own `hf` model
does on the same checkpoint (where lm-eval and the default model are installed)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import free_port, requires_default_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import evalbench  # noqa: E402


def test_each_document_holds_the_texts_own_continuation_among_three_others():
    prose = " ".join(" ".join(words) for words in evalbench.sentences(evalbench.TEXT.read_text()))
    docs = evalbench.mc_docs(1000)
    assert len(docs) > 200
    for doc in docs:
        choices = doc["choices"]
        assert len(choices) == len(set(choices)) == 4 and 0 <= doc["label"] < 4
        assert all(len(c.split()) == evalbench.WORDS and c.startswith(" ") for c in choices)
        assert doc["context"] + choices[doc["label"]] in prose  # the true one continues the context
    assert {doc["label"] for doc in docs} == {0, 1, 2, 3}


@pytest.mark.slow
@requires_default_model
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (the test extras)")
def test_lm_eval_scores_nanoserve_as_its_hf_model_on_the_exact_path(tmp_path):
    out = tmp_path / "evalbench.csv"
    evalbench.main(["--limit", "12", "--server-args", "--dtype float32 --quantization none --kernels torch",
                    "--port", str(free_port()), "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    hf = next(r for r in rows if r["system"] == "hf")
    ours = next(r for r in rows if r["system"] == "nanoserve" and r["task"] == "nanoserve_mc")
    assert float(ours["acc"]) == float(hf["acc"]) and float(ours["acc_norm"]) == float(hf["acc_norm"])
    gen = next(r for r in rows if r["task"] == "nanoserve_gen")
    assert 0.0 <= float(gen["exact_match"]) <= 1.0  # the generation task ran to the end
