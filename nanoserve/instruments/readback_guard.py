"""Counting (or forbidding) every route by which a tensor's value reaches Python, by patching
torch.Tensor's methods while a context is active: how a test proves "this phase read nothing
back" and how syncbench counts the readbacks each sampler makes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

# Every route by which a tensor's value becomes a Python value (repr goes through .item()).
READBACK_ROUTES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


class ReadbackHappened(AssertionError):
    """Raised by a patched tensor method: the code under test read a value home."""


@contextmanager
def readbacks_counted(forbid: Iterable[str] = READBACK_ROUTES) -> Iterator[dict[str, int]]:
    """While active, each torch.Tensor method named in `forbid` raises ReadbackHappened and every
    other READBACK_ROUTES method is counted. `forbid` may name further methods ("numpy", "cpu").

    Yields:
        method name -> calls so far (forbidden ones stay 0).
    """
    forbid = tuple(forbid)
    names = tuple(dict.fromkeys(READBACK_ROUTES + forbid))
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def patched(name: str):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            if name in forbid:
                raise ReadbackHappened(f"torch.Tensor.{name} was called")
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name in names:
            setattr(torch.Tensor, name, patched(name))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
