"""nanoserve.instruments.csv_writer: the one CSV writer, read back with the standard library's reader."""

from __future__ import annotations

import csv

import pytest

from nanoserve.instruments.csv_writer import write_csv


def read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_write_csv_rounds_floats_and_takes_the_union_of_columns(tmp_path):
    path = tmp_path / "runs" / "x.csv"  # the folder is created
    write_csv(path, [{"slots": 1, "step_ms": 1.23456789}, {"slots": 2, "note": "b"}])
    assert read(path) == [["slots", "step_ms", "note"], ["1", "1.234568", ""], ["2", "", "b"]]


def test_write_csv_replaces_by_default(tmp_path):
    path = tmp_path / "x.csv"
    write_csv(path, [{"a": 1}])
    write_csv(path, [{"a": 2}])
    assert read(path) == [["a"], ["2"]]


def test_append_writes_the_header_once(tmp_path):
    path = tmp_path / "x.csv"
    write_csv(path, [{"a": 1, "b": 0.5}], append=True)  # a new file: header first
    write_csv(path, [{"a": 2, "b": 0.25}], append=True)
    write_csv(path, [{"b": 0.125}], append=True)  # a column it lacks is left empty
    assert read(path) == [["a", "b"], ["1", "0.5"], ["2", "0.25"], ["", "0.125"]]


def test_append_keeps_the_existing_column_order(tmp_path):
    path = tmp_path / "x.csv"
    write_csv(path, [{"a": 1, "b": 2}])
    write_csv(path, [{"b": 4, "a": 3}], append=True)
    assert read(path) == [["a", "b"], ["1", "2"], ["3", "4"]]


def test_append_to_an_empty_file_writes_the_header(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("")
    write_csv(path, [{"a": 1}], append=True)
    assert read(path) == [["a"], ["1"]]


def test_append_refuses_a_column_the_file_lacks(tmp_path):
    path = tmp_path / "x.csv"
    write_csv(path, [{"a": 1}])
    with pytest.raises(ValueError, match=r"has columns \['a'\]; cannot append rows with columns \['c'\]"):
        write_csv(path, [{"a": 2, "c": 3}], append=True)
    assert read(path) == [["a"], ["1"]]
