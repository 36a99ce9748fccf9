"""The C boundary (nanoserve.model.cabi): struct layouts checked at load, preconditions checked before
each call into C, the scratch reused across calls, the build's cache directory, compiler launcher
and stale builds, the WARNING without a compiler, and one OpenMP runtime in the process.

Only one test builds (the 'plain' flags, the quickest, into a temporary cache); the rest use this
machine's cached build, or none at all: the precondition tests run on a library that fails the test
if anything calls into it, so they also show that nothing reached C.
"""

from __future__ import annotations

import ctypes
import logging
import shlex
import shutil
import threading
from pathlib import Path

import pytest
import torch
from test_quant import random_stored

from nanoserve.model import blockdot, cabi
from nanoserve.model.fused_decode import _check_rows

needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")


class NoC:
    """A library any call into which fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} was called in C")


NO_C = blockdot.Library(NoC(), 0, Path("no-c.so"))


def stored(N: int, K: int):
    """A Q4_1 matrix [N, K] with fp16-exact scales, as a GGUF file holds it."""
    w = random_stored("Q4_1", N, K)
    w.scales, w.mins = w.scales.half().float(), w.mins.half().float()
    return w


# ---- struct layouts ---------------------------------------------------------------------------------


def layout_of(mirrors: dict) -> dict:
    """The layout table c_layout would read from a compiler that agrees with `mirrors`."""
    layout = {}
    for name, mirror in mirrors.items():
        layout[name] = {None: (0, ctypes.sizeof(mirror))}
        layout[name] |= {f: (getattr(mirror, f).offset, getattr(mirror, f).size) for f, *_ in mirror._fields_}
    return layout


def swapped_shape(name: str = "SwappedShape") -> type[ctypes.Structure]:
    """struct fused_shape's mirror with eps and scale swapped: the same size, two offsets wrong."""
    fields = list(cabi.FusedShape._fields_)
    fields[-2], fields[-1] = fields[-1], fields[-2]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def test_a_mirror_with_two_fields_swapped_is_refused_naming_both_offsets():
    layout = layout_of(cabi.MIRRORS)
    cabi.check_layout(layout)  # the mirrors agree with themselves
    with pytest.raises(OSError) as caught:
        cabi.check_layout(layout, {"fused_shape": swapped_shape()})
    assert str(caught.value) == (
        "the library's structs are not laid out as their ctypes mirrors: struct fused_shape field eps at offset 88 "
        "in C, 92 in SwappedShape; struct fused_shape field scale at offset 92 in C, 88 in SwappedShape")


def test_a_mirror_with_a_narrower_or_missing_field_is_refused():
    layout = layout_of(cabi.MIRRORS)
    narrow = [("window", ctypes.c_int32) if name == "window" else (name, t) for name, t in cabi.FusedLayer._fields_]
    Narrow = type("Narrow", (ctypes.Structure,), {"_fields_": narrow})
    with pytest.raises(OSError) as caught:
        cabi.check_layout(layout, {"fused_layer": Narrow})
    assert str(caught.value) == ("the library's structs are not laid out as their ctypes mirrors: struct fused_layer "
                                 "field window is 8 bytes in C, 4 in Narrow")  # moe aligned to the same offset 128
    Short = type("Short", (ctypes.Structure,), {"_fields_": cabi.FusedLayer._fields_[:-1]})
    with pytest.raises(OSError, match=r"struct fused_layer is 168 bytes in C, 160 in Short; "
                                      r"struct fused_layer field sin is in C only$"):
        cabi.check_layout(layout, {"fused_layer": Short})
    with pytest.raises(OSError, match="struct fused_shape is not in the library's layout table"):
        cabi.check_layout({}, {"fused_shape": cabi.FusedShape})


@needs_build
def test_the_compilers_layout_is_the_mirrors_and_a_wrong_mirror_fails_the_load(monkeypatch):
    layout = cabi.c_layout(blockdot.library().lib)
    assert layout == layout_of(cabi.MIRRORS)
    # eleven int64 fields (E .. rot) before eps: 11 * 8 = 88; fused_layer: 21 fields of 8 bytes
    assert layout["fused_shape"]["eps"] == (88, 4) and layout["fused_layer"][None] == (0, 168)
    # the whole way: load refuses the build, and library() reports it as its failure
    monkeypatch.setattr(cabi, "MIRRORS", {**cabi.MIRRORS, "fused_shape": swapped_shape()})
    with pytest.raises(OSError, match="struct fused_shape field eps at offset 88 in C, 92 in SwappedShape"):
        cabi.load()
    monkeypatch.setattr(blockdot, "_library", None)
    monkeypatch.setattr(blockdot, "_failure", None)
    assert blockdot.library() is None
    assert blockdot.failure().startswith("OSError: the library's structs are not laid out as their ctypes mirrors")


@needs_build
def test_a_library_without_an_entry_python_declares_is_refused(monkeypatch):
    monkeypatch.setitem(cabi.SIGNATURES, "no_such_entry", ([], None))
    with pytest.raises(OSError, match=r"blockdot-native-\w+-\w+\.so has no entry no_such_entry"):
        cabi.load()


# ---- preconditions, checked before C ----------------------------------------------------------------


def test_panels_refuse_activations_c_cannot_read():
    panels = blockdot.Panels(torch.zeros(2, 2, 64 + 256, dtype=torch.uint8), 1, (20, 64), NO_C)
    with pytest.raises(ValueError, match=r"blockdot takes activations in \['torch.float32', 'torch.bfloat16'\], "
                                         r"got torch.float16"):
        panels(torch.zeros(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"blockdot panels \[20, 64\] take x \[M, 64\], got \[3, 32\]"):
        panels(torch.zeros(3, 32))
    with pytest.raises(ValueError, match=r"blockdot panels \[20, 64\] take x \[M, 64\], got \[64\]"):
        panels(torch.zeros(64))
    with pytest.raises(ValueError, match="blockdot runs on the CPU; got x on meta"):
        panels(torch.zeros(3, 64, device="meta"))
    with pytest.raises(ValueError, match=r"blockdot dequantizes to \['torch.float32', 'torch.bfloat16'\], got torch.int8"):
        panels.dequantize(torch.int8)


def test_panels_refuse_a_shape_c_cannot_read():
    with pytest.raises(ValueError, match="blockdot panels hold matrices whose K is a multiple of 32; got K = 48"):
        blockdot.Panels(torch.zeros(1, 1, 320, dtype=torch.uint8), 1, (16, 48), NO_C)
    with pytest.raises(ValueError, match=r"1 plane \(4-bit codes\) or 2 \(int8 codes\), \| 4 for float32 heads, \| 8 for "
                                         r"two scales a block \(int8\), \| 16 for two mins too; got planes = 3"):
        blockdot.Panels(torch.zeros(1, 2, 832, dtype=torch.uint8), 3, (16, 64), NO_C)
    with pytest.raises(ValueError, match=r"blockdot panels of \[20, 64\] in 2 plane\(s\) are a contiguous uint8 tensor "
                                         r"\[2, 2, 576\] on the CPU; got torch.uint8 \[2, 2, 320\] on cpu"):
        blockdot.Panels(torch.zeros(2, 2, 320, dtype=torch.uint8), 2, (20, 64), NO_C)
    with pytest.raises(ValueError, match=r"got torch.uint8 \[2, 2, 320\] on cpu, not contiguous"):
        blockdot.Panels(torch.zeros(2, 320, 2, dtype=torch.uint8).transpose(1, 2), 1, (20, 64), NO_C)
    w = stored(16, 64)
    w.codes = w.codes[:, :48]  # past BlockQuantized's own check
    with pytest.raises(ValueError, match="blockdot packs matrices whose K is a multiple of 32; got K = 48"):
        blockdot.pack(w, NO_C)


def test_dense_panels_refuse_activations_and_data_c_cannot_read():
    panels = blockdot.DensePanels(torch.zeros(2, 24, 16), (20, 24), NO_C)
    with pytest.raises(ValueError, match=r"dense panels \[20, 24\] take x \[M, 24\], got \[3, 25\]"):
        panels(torch.zeros(3, 25))
    with pytest.raises(ValueError, match="dense panels take activations in .*, got torch.float64"):
        panels(torch.zeros(3, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match="dense panels run on the CPU; got x on meta"):
        panels(torch.zeros(3, 24, device="meta"))
    with pytest.raises(ValueError, match=r"dense panels of \[20, 24\] are a contiguous float32 or bf16 tensor "
                                         r"\[2, 24, 16\] on the CPU; got torch.float32 \[1, 24, 16\] on cpu"):
        blockdot.DensePanels(torch.zeros(1, 24, 16), (20, 24), NO_C)


def test_a_fused_step_refuses_rows_c_cannot_read():
    T, E = 3, 32
    h, index, tables = torch.zeros(T, E), torch.zeros(T, dtype=torch.int64), torch.zeros(T, 5, dtype=torch.int64)
    _check_rows(h, E, index, index, tables)  # what the C reads
    cases = [
        ((h.double(), E, index, index, tables), r"h \[T, 32\] float32, contiguous; got torch.float64 \[3, 32\]"),
        ((torch.zeros(T, 16), E, index, index, tables), r"h \[T, 32\] float32, contiguous; got torch.float32 \[3, 16\]"),
        ((torch.zeros(E, T).t(), E, index, index, tables), r"got torch.float32 \[3, 32\], not contiguous"),
        ((h, E, index[:2], index, tables), r"positions \[3\] int64, one per row of h; got torch.int64 \[2\]"),
        ((h, E, index, index.int(), tables), r"slot_mapping \[3\] int64, one per row of h; got torch.int32 \[3\]"),
        ((h, E, index, index, tables[:1]), r"block tables \[3, nb\] int64, one per row of h; got torch.int64 \[1, 5\]"),
        ((h, E, index, index, tables.flatten()), r"block tables \[3, nb\] int64, one per row of h; got torch.int64 \[15\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _check_rows(*args)


# ---- the scratch: no allocation once the widest call has run ---------------------------------------


@needs_build
def test_the_scratch_is_allocated_once_per_thread_and_grown_only_when_a_call_needs_more():
    kernel = blockdot.library()
    small, wide = blockdot.pack(stored(16, 64), kernel), blockdot.pack(stored(16, 1024), kernel)
    seen = []

    def stats() -> tuple[int, int]:
        out = (ctypes.c_int64 * 2)()
        kernel.lib.blockdot_scratch_stats(out)
        return out[0], out[1]

    def calls():  # in a thread of its own, so its scratch starts empty
        seen.append(stats())
        small(torch.randn(2, 64))  # 28 + 64 + 32 floats (496 bytes): half again, in 4096-byte pages
        seen.append(stats())
        for rows in (1, 2, 2, 1):
            small(torch.randn(rows, 64))
        seen.append(stats())
        # 8192 (x from bf16) + 7 * 8 * 32 (per-block sums and scales) + 4096 (int16 x) + 2048 (int8 x) floats:
        # 64,512 bytes, half again is 96,768, in 4096-byte pages 98,304
        wide(torch.randn(8, 1024).bfloat16())
        seen.append(stats())
        for rows in (8, 3, 8):
            wide(torch.randn(rows, 1024))
            small(torch.randn(rows, 64).bfloat16())
        seen.append(stats())

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert seen == [(0, 0), (4096, 1), (4096, 1), (98304, 2), (98304, 2)]


# ---- the build: cache directory, launcher, stale builds ----------------------------------------------


def test_the_cache_directory_is_nanoserve_cache_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cabi.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("NANOSERVE_CACHE", "")  # empty: unset
    assert cabi.cache_dir() == tmp_path / "xdg" / "nanoserve"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: a relative path is ignored
    assert cabi.cache_dir() == tmp_path / "home" / ".cache" / "nanoserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("NANOSERVE_CACHE")
    assert cabi.cache_dir() == tmp_path / "home" / ".cache" / "nanoserve"


def test_cc_is_split_as_a_shell_would(monkeypatch):
    monkeypatch.setenv("CC", "ccache gcc -m64")
    assert cabi.compiler() == ["ccache", "gcc", "-m64"]
    monkeypatch.setenv("CC", "'/opt/my cc/gcc'")
    assert cabi.compiler() == ["/opt/my cc/gcc"]
    monkeypatch.setenv("CC", "")
    assert cabi.compiler() == ["cc"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build with")
def test_a_build_through_a_launcher_lands_in_xdg_cache_home_and_removes_older_sources(monkeypatch, tmp_path):
    # a launcher that records each command it runs, then runs it: CC="<launcher> gcc"
    launcher, log = tmp_path / "launch", tmp_path / "launched"
    launcher.write_text(f'#!/bin/sh\necho "$1 $2" >> {shlex.quote(str(log))}\nexec "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setenv("CC", f"{shlex.quote(str(launcher))} gcc")
    monkeypatch.delenv("NANOSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    plain = cabi.BUILDS["plain"]
    path = cabi.target(plain)
    assert path.parent == tmp_path / "xdg" / "nanoserve" and path.name.startswith("blockdot-plain-")
    prefix = path.name.rsplit("-", 1)[0]
    path.parent.mkdir(parents=True)
    stale = path.parent / f"{prefix}-{'0' * 16}.so"  # older sources, the same flags, compiler and CPU
    kept = [path.parent / f"blockdot-plain-{'0' * 12}-{'0' * 16}.so",  # another compiler or CPU
            path.parent / f"blockdot-native-{prefix.split('-')[2]}-{'0' * 16}.so"]  # other flags
    for file in (stale, *kept):
        file.write_bytes(b"not a library")
    built = cabi.load(plain)
    assert built.path == path and built.simd == 0
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(p.name for p in (path, *kept))
    assert log.read_text().splitlines() == ["gcc --version", "gcc --version", f"gcc {plain[0]}"]
    w = stored(40, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(blockdot.pack(w, built)(x).double(), expected, atol=1e-5 * expected.abs().max().item(),
                               rtol=0)


def test_without_a_compiler_library_is_none_and_a_warning_names_the_slowdown(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(blockdot, "_library", None)
    monkeypatch.setattr(blockdot, "_failure", None)
    with caplog.at_level(logging.WARNING, logger=blockdot.__name__):
        assert blockdot.library() is None
    assert blockdot.failure().startswith("FileNotFoundError: ")
    [record] = [r for r in caplog.records if r.name == blockdot.__name__]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"nanoserve: the blockdot kernels could not be built ({blockdot.failure()}): quantized GGUF linears fall back "
        "to torch's kernels and decode steps to torch's ops, several times slower on a CPU; install a C compiler "
        "(gcc) with OpenMP")


# ---- one OpenMP runtime ----------------------------------------------------------------------------


def test_openmp_runtimes_are_counted_by_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 08:01 11 /venv/torch/lib/libgomp.so.1\n"
        "7f01-7f02 r-xp 00001000 08:01 11 /venv/torch/lib/libgomp.so.1\n"  # the same file's next segment
        "7f02-7f03 r--p 00000000 08:01 12 /opt/intel/lib/libiomp5.so\n"
        "7f03-7f04 r--p 00000000 08:01 13 /usr/lib/libomptarget.so\n"  # not a runtime
        "7f04-7f05 r--p 00000000 08:01 14 /usr/lib/x86_64-linux-gnu/libgomp-a34b3233.so.1\n"
        "7f05-7f06 rw-p 00000000 00:00 0 [heap]\n")
    assert cabi.openmp_runtimes(maps) == ["/opt/intel/lib/libiomp5.so", "/usr/lib/x86_64-linux-gnu/libgomp-a34b3233.so.1",
                                          "/venv/torch/lib/libgomp.so.1"]
    assert cabi.openmp_runtimes(tmp_path / "none") == []


@needs_build
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps (not Linux)")
def test_one_openmp_runtime_is_mapped_once_the_library_is_loaded():
    # torch's wheel carries its own libgomp.so.1; the build needs libgomp.so.1 by SONAME, which the
    # loader resolves to the copy torch already loaded (cabi's docstring)
    runtimes = cabi.openmp_runtimes()
    assert len(runtimes) == 1, runtimes


@needs_build
def test_two_openmp_runtimes_are_warned_of_by_name(monkeypatch, caplog):
    monkeypatch.setattr(cabi, "openmp_runtimes", lambda: ["/a/libgomp.so.1", "/b/libiomp5.so"])
    with caplog.at_level(logging.WARNING, logger=cabi.__name__):
        cabi.load()
    [record] = [r for r in caplog.records if r.name == cabi.__name__]
    assert record.levelno == logging.WARNING and record.getMessage().startswith(
        "nanoserve: 2 OpenMP runtimes are loaded (/a/libgomp.so.1, /b/libiomp5.so)")
