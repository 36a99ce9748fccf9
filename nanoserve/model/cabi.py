"""The C boundary: nanoserve's C kernels (blockdot.c, fused_decode.c, blockdot.h) built, loaded,
declared and checked.

The sources are compiled into one shared library at first use by the compiler $CC names (`cc`
where unset; a launcher with its arguments, "ccache gcc" or "gcc -m64", is split as a shell would)
and cached in `cache_dir()` as blockdot-<build>-<configuration>-<sources>.so: the configuration is
a hash of the flags, the compiler's version and the CPU, the sources one of the C files. A new
build removes the builds of older sources with the same configuration (unlinking a library another
process has loaded leaves its mapping intact on Linux). `load` opens a build with ctypes, declares
every entry Python calls (SIGNATURES), and refuses it (OSError) unless the compiler laid out the
structs the fused decode passes as their ctypes mirrors here do (`check_layout`).

OpenMP, as found on Linux x86-64 with torch 2.13.0+cpu and gcc 12: torch's wheel carries its own
libgomp (torch/lib/libgomp.so.1, SONAME libgomp.so.1), which libtorch_cpu.so finds through its
RUNPATH ($ORIGIN); a build here links the system's (`ldd`: /lib/x86_64-linux-gnu/libgomp.so.1). In
one process the dynamic loader resolves a needed library by SONAME to one already loaded, so
whichever comes first serves both: /proc/self/maps holds torch's copy alone after torch and then a
build are loaded, and the system's alone when the build is loaded before torch. One thread pool
either way, provided a build asks for no symbol version newer than torch's copy defines (it uses
GOMP_1.0 and GOMP_4.0; torch's goes up to GOMP_5.0). A second runtime (an Intel libiomp5 or an LLVM
libomp that some other package loads) would be two pools spinning on the same cores: `load` logs a
WARNING naming them (`openmp_runtimes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blockdot.c")
# Built into one library with blockdot.c: the decode step that runs its layers in C (fused_decode.py).
SOURCES = [SOURCE, SOURCE.with_name("fused_decode.c")]
HEADERS = [SOURCE.with_name("blockdot.h")]
BUILD_TIMEOUT_S = 900  # a compile of SOURCES, at most
# -fno-trapping-math: comparisons may not trap, so gcc vectorizes clamps (fused_decode.c's exp_fast); no value changes
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC"]
# The builds a test or a benchmark can ask for besides this machine's: what an AVX-512 CPU without
# VNNI (its int16 path on vpmaddwd), an AVX2-only CPU, and a compiler with no vector flags
# would run.
BASE_FLAGS = ["-O2", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC"]
BUILDS = {"native": FLAGS, "avx512": [*BASE_FLAGS, "-mavx512f", "-mavx512bw", "-mfma", "-mf16c"],
          "avx2": [*BASE_FLAGS, "-mavx2", "-mfma", "-mf16c"], "plain": BASE_FLAGS}


@dataclass(frozen=True)
class Library:
    lib: ctypes.CDLL
    simd: int  # vector width the build has: 512, 256, or 0 (plain C: correct and slow)
    path: Path


_i32, _i64, _f32, _p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class FusedShape(ctypes.Structure):
    """struct fused_shape (fused_decode.c): the model's dimensions and the cache's form."""

    _fields_ = [(name, _i64) for name in ("E", "H", "Hkv", "D", "I", "block_size", "kv_kind", "int16_rows",
                                          "amx_rows", "activation", "rot")] + [
        ("eps", _f32), ("scale", _f32)]


class FusedLayer(ctypes.Structure):
    """struct fused_layer (fused_decode.c): one layer's weights and K/V cache, as addresses."""

    _fields_ = [(name, _p) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")] + [
        (f"{name}_planes", _i64) for name in ("qkv", "o", "gate_up", "down")] + [
        (name, _p) for name in ("k_cache", "v_cache", "qkv_bias", "q_norm", "k_norm")] + [("window", _i64), ("moe", _p)] + [
        (name, _p) for name in ("attn_out_norm", "mlp_out_norm", "cos", "sin")]


class FusedMoe(ctypes.Structure):
    """struct fused_moe (fused_decode.c): a sparse layer's router and experts, as addresses."""

    _fields_ = [(name, _p) for name in ("router", "gate_up", "down", "gate_up_planes", "down_planes", "shared_gate_up",
                                        "shared_down", "shared_gate")] + [
        (name, _i64) for name in ("router_planes", "shared_gate_up_planes", "shared_down_planes",
                                  "shared_gate_planes", "X", "k", "Ie", "Is", "norm_topk_prob")]


class LayoutEntry(ctypes.Structure):
    """struct layout_entry (fused_decode.c): a row of fused_layout()'s table; field None: the struct's size."""

    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


# The C structs and their mirrors, by the C name.
MIRRORS: dict[str, type[ctypes.Structure]] = {"fused_shape": FusedShape, "fused_layer": FusedLayer,
                                               "fused_moe": FusedMoe, "layout_entry": LayoutEntry}

_shape, _layer, _i64s = ctypes.POINTER(FusedShape), ctypes.POINTER(FusedLayer), ctypes.POINTER(_i64)
_moe = ctypes.POINTER(FusedMoe)
# Every entry Python calls: name -> (argument types, return type), the arguments in the comment.
SIGNATURES: dict[str, tuple[list, type | None]] = {
    "blockdot_simd": ([], _i32),
    # x, x_bf16, M, K, N, w, planes, y, y_bf16, nthreads, int16_rows, amx_rows -> 0, or -1 out of memory
    "blockdot": ([_p, _i32, _i64, _i64, _i64, _p, _i32, _p, _i32, _i32, _i64, _i64], _i32),
    # xs, Ms, K, N, ws, planes, ys, count, nthreads -> 1, 0 not taken, -1 out of memory: for the tests
    "blockdot_grouped": ([_p, _i64s, _i64, _i64, _p, _p, _p, _i32, _i32], _i32),
    "blockdot_amx": ([], _i32),  # whether file-bit panels can multiply on AMX tiles here (asks Linux once)
    "blockdot_dequantize": ([_p, _i32, _i64, _i64, _p, _i32, _i32], None),  # w, planes, N, K, out, out_bf16, nthreads
    # dense panels (DensePanels): x, M, K, N, w, w_bf16, y; called from C, bound for the tests
    "dense_tasks": ([_p, _i64, _i64, _i64, _p, _i32, _p], None),
    "blockdot_dense": ([_p, _i64, _i64, _i64, _p, _i32, _p, _i32], None),  # the same over nthreads threads
    "blockdot_dense_pairs": ([], _i32),
    "blockdot_i8_bytes": ([_i32], _i64),  # a file-bit panel's super-block bytes for planes, 0 for none
    "blockdot_i8_weights": ([_i32], _i64),  # a file-bit super-block's weights for planes (256 or 32), 0 for none
    "blockdot_i8_mixed_bytes": ([_p, _i64, _i64], _i64),  # head, N, K: a mixed matrix's bytes, -1 where wrong
    "blockdot_dequantize_rows": ([_p, _i32, _i64, _i64, _p, _i64, _p, _i32], _i32),  # file-bit rows by index
    "blockdot_scratch_stats": ([_i64s], None),  # the calling thread's scratch: [bytes, allocations]
    # fused_decode.c's entry (nanoserve.model.fused_decode): shape, layers, num_layers, h, T, positions,
    # slot_mapping, tables, nb, cos, sin, nthreads -> 0, or -1 out of memory
    "fused_decode": ([_shape, _layer, _i64, _p, _i64, _p, _p, _p, _i64, _p, _p, _i32], _i32),
    # ... and its pieces for steps whose matmuls torch runs: shape, layer, qkv, att, io_bf16, T, positions,
    # slot_mapping, tables, nb, cos, sin, nthreads; h, add, add_norm, w, x, io_bf16, T, E, eps, nthreads; gu,
    # out, io_bf16, T, I, activation, nthreads
    "fused_attention": ([_shape, _layer, _p, _p, _i32, _i64, _p, _p, _p, _i64, _p, _p, _i32], _i32),
    "fused_add_norm": ([_p, _p, _p, _p, _p, _i32, _i64, _i64, _f32, _i32], None),
    "fused_gate_mul": ([_p, _p, _i32, _i64, _i64, _i64, _i32], None),
    # a sparse layer's MLP between them: shape, moe, x, out, io_bf16, T, nthreads -> 0, or -1 out of memory
    "fused_moe": ([_shape, _moe, _p, _p, _i32, _i64, _i32], _i32),
    # the cache's rounding and widening (x, cache, n, kind) and (cache, out, n, kind): for the tests
    "fused_kv_store": ([_p, _p, _i64, _i32], None),
    "fused_kv_widen": ([_p, _p, _i64, _i32], None),
    "fused_layout": ([_i64s], ctypes.POINTER(LayoutEntry)),  # count -> the structs' layout table
}


def load(flags: list[str] = FLAGS) -> Library:
    """The sources built with `flags` (the default: for this machine), loaded, declared and checked.

    Raises:
        OSError: no compiler, the build failed (its error output in the message), an entry missing,
            or a struct laid out otherwise than its mirror.
        subprocess.SubprocessError: the compiler hung or failed to say its version.
    """
    path = _build(flags)
    try:
        return _load(path)
    except OSError:
        if path.exists():
            raise
        return _load(_build(flags))  # removed between the two by another process's build of other sources


def cache_dir() -> Path:
    """Where builds are kept: $NANOSERVE_CACHE, else $XDG_CACHE_HOME/nanoserve (an absolute path,
    as the XDG spec asks), else ~/.cache/nanoserve."""
    if os.environ.get("NANOSERVE_CACHE"):
        return Path(os.environ["NANOSERVE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "nanoserve"


def compiler() -> list[str]:
    """$CC as a command prefix ("ccache gcc" -> ["ccache", "gcc"]); `cc` where unset."""
    return shlex.split(os.environ.get("CC") or "cc")


def target(flags: list[str]) -> Path:
    """Where the build for `flags`, this compiler and CPU, and the sources as they are now is cached.

    Raises:
        OSError: no compiler.
        subprocess.SubprocessError: it hung or failed to say its version.
    """
    version = subprocess.run([*compiler(), "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    config = hashlib.sha256(b"\0".join([version.encode(), " ".join(flags).encode(), _cpu_flags().encode(),
                                        platform.machine().encode()])).hexdigest()[:12]
    sources = hashlib.sha256(b"\0".join(path.read_bytes() for path in [*SOURCES, *HEADERS])).hexdigest()[:16]
    build = next((name for name, build_flags in BUILDS.items() if build_flags == flags), "custom")
    return cache_dir() / f"blockdot-{build}-{config}-{sources}.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(flags: list[str]) -> Path:
    """Compiles SOURCES into one shared library unless target(flags) is cached; returns its path."""
    path = target(flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: concurrent starts are safe
        built = Path(tmp) / path.name
        command = [*compiler(), *flags, *map(str, SOURCES), "-o", str(built)]
        # about 50 s of one core here; minutes on a busy machine, where a build cut short would leave
        # the process on torch's several times slower kernels
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode:
            raise OSError(f"{shlex.join(compiler())} failed on {', '.join(p.name for p in SOURCES)}: "
                          f"{result.stderr.strip()[-500:]}")
        os.replace(built, path)
    # the same configuration's builds of other sources: <build>-<configuration>- then another hash
    for stale in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.so"):
        if stale != path:
            with contextlib.suppress(OSError):  # already gone: another process removed it
                stale.unlink()
    return path


def _load(path: Path) -> Library:
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        try:
            entry = getattr(lib, name)
        except AttributeError as exc:
            raise OSError(f"{path.name} has no entry {name}") from exc
        entry.argtypes, entry.restype = argtypes, restype
    check_layout(c_layout(lib), MIRRORS)
    runtimes = openmp_runtimes()
    if len(runtimes) > 1:
        logger.warning("nanoserve: %d OpenMP runtimes are loaded (%s): each keeps its own pool of threads, and the "
                       "pools spin against each other on the same cores", len(runtimes), ", ".join(runtimes))
    return Library(lib, lib.blockdot_simd(), path)


def c_layout(lib: ctypes.CDLL) -> dict[str, dict[str | None, tuple[int, int]]]:
    """The structs as the compiler laid them out (fused_layout's table): struct -> field -> (offset,
    size), the field None holding (0, the struct's size)."""
    count = _i64()
    table = lib.fused_layout(ctypes.byref(count))
    layout: dict[str, dict[str | None, tuple[int, int]]] = {}
    for entry in table[:count.value]:
        field = None if entry.field is None else entry.field.decode()
        layout.setdefault(entry.type.decode(), {})[field] = (entry.offset, entry.size)
    return layout


def check_layout(layout: dict[str, dict[str | None, tuple[int, int]]],
                 mirrors: dict[str, type[ctypes.Structure]] = MIRRORS) -> None:
    """Each mirror's size and fields' offsets and sizes against the C layout (c_layout's).

    Raises:
        OSError: every disagreement, each naming the struct, the field and both values.
    """
    wrong = []
    for name, mirror in mirrors.items():
        fields = layout.get(name)
        if fields is None:
            wrong.append(f"struct {name} is not in the library's layout table")
            continue
        ours = {field: (getattr(mirror, field).offset, getattr(mirror, field).size) for field, *_ in mirror._fields_}
        ours[None] = (0, ctypes.sizeof(mirror))
        for field in [*fields, *(f for f in ours if f not in fields)]:  # C's order (its size first), then the mirror's
            what = f"struct {name}" if field is None else f"struct {name} field {field}"
            if field not in ours or field not in fields:
                wrong.append(f"{what} is {'in C only' if field not in ours else f'in {mirror.__name__} only'}")
            elif ours[field][0] != fields[field][0]:
                wrong.append(f"{what} at offset {fields[field][0]} in C, {ours[field][0]} in {mirror.__name__}")
            elif ours[field][1] != fields[field][1]:
                wrong.append(f"{what} is {fields[field][1]} bytes in C, {ours[field][1]} in {mirror.__name__}")
    if wrong:
        raise OSError(f"the library's structs are not laid out as their ctypes mirrors: {'; '.join(wrong)}")


# An OpenMP runtime's file name: GNU's libgomp, Intel's libiomp5, LLVM's libomp (and their renamed
# copies in wheels, libgomp-<hash>.so.1)
OPENMP = re.compile(r"lib(gomp|iomp5|omp)\b[^/]*\.so")


def openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The OpenMP runtime libraries mapped into this process, one path per distinct file (device and
    inode); [] where there is no /proc (not Linux)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    files = {}
    for line in lines:
        parts = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(parts) == 6 and OPENMP.match(os.path.basename(parts[5])):
            files.setdefault((parts[3], parts[4]), parts[5])
    return sorted(files.values())
