"""nanoserve.instruments.readback_guard: every route by which a tensor's value reaches Python is
caught (forbidden) or counted, through the conftest fixtures built on it."""

from __future__ import annotations

import pytest
import torch
from conftest import ReadbackHappened

from nanoserve.instruments.readback_guard import readbacks_counted


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t[0].item(),
        lambda t: int(t[0]),
        lambda t: float(t[0]),
        lambda t: bool(t[0]),
        lambda t: [10, 20, 30][t[0]],
        repr,
    ],
    ids=["tolist", "item", "int", "float", "bool", "index", "repr"],
)
def test_no_readback_fixture_catches_every_route(no_readback, read):
    tokens = torch.tensor([2, 1, 0], dtype=torch.int64)
    with pytest.raises(ReadbackHappened):
        read(tokens)


def test_counted_tolist_fixture_counts_and_forbids_the_rest(counted_tolist):
    tokens = torch.tensor([4, 5], dtype=torch.int64)
    assert tokens.tolist() == [4, 5]
    assert tokens.tolist() == [4, 5]
    assert counted_tolist["tolist"] == 2
    with pytest.raises(ReadbackHappened):
        int(tokens[0])


def test_counting_without_forbidding_counts_every_route():
    t = torch.tensor([1, 2])
    with readbacks_counted(forbid=()) as counts:
        t.tolist()
        int(t[0])
        t[1].item()
    assert (counts["tolist"], counts["__int__"], counts["item"]) == (1, 1, 1)
    assert t.tolist() == [1, 2]  # the methods are restored afterwards
