"""docs/ against the code: what the pages say about the GGUF kinds kept as stored, blockdot's tiles
and the bytes of its panels, the plan's driver and form names and the probe's constants. Each check
reads the statement from a page's text and the value from the code (its constants, blockdot.c's
source, a matrix packed by blockdot.pack), so a change to either alone fails here. (Links, paths and
commands are test_readme.py's.)"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoserve.config import PlanOverrides
from nanoserve.model import blockdot, forms, plan, precision
from nanoserve.model.ggml_blocks import BLOCK_TYPES
from nanoserve.model.gguf import BLOCK, decode_blocks
from nanoserve.model.quant import cat_rows, quantize_int4, torch_runs

ROOT = Path(__file__).resolve().parent.parent
DOCS = {page.name: page.read_text() for page in sorted((ROOT / "docs").glob("*.md"))}
BLOCKDOT_C = (ROOT / "nanoserve/model/blockdot.c").read_text()
FUSED_DECODE_C = (ROOT / "nanoserve/model/fused_decode.c").read_text()
# A GGUF block type's name as a word ("Q4_K", not the "Q4_K" of a file type "Q4_K_M").
KIND = re.compile(r"\b(?:" + "|".join(sorted(BLOCK_TYPES, key=len, reverse=True)) + r")\b")


def _c_header(source: str) -> str:
    """A C file's opening comment as text, its ' * ' margins taken off."""
    comment = source[source.index("/*") + 2:source.index("*/")]
    return "\n".join(re.sub(r"^ ?\* ?", "", line) for line in comment.splitlines())


# Where the kinds kept as stored are stated: the docs, the README and blockdot.c's header.
STATED = {**DOCS, "README.md": (ROOT / "README.md").read_text(), "blockdot.c": _c_header(BLOCKDOT_C)}


def statements(text: str) -> list[str]:
    """A page's sentences, each on one line: a paragraph, list item, table row or (in a fenced block)
    an entry with its more-indented continuation lines, cut after each '.' or ';'."""
    entries: list[list[str]] = [[]]
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            entries.append([])
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith(("- ", "|", "#")) or (in_code and indent < 8):
            entries.append([])
        if stripped:
            entries[-1].append(stripped)
    return [sentence for entry in entries if entry for sentence in re.split(r"(?<=[.;])\s+", " ".join(entry))]


def names(values: object) -> set[str]:
    """The string values of a tuple or dict of names, or of an Enum's members."""
    return {str(getattr(v, "value", v)) for v in values}


def drivers() -> dict[str, str | None]:
    """plan.DRIVERS as {name: description} (None where the code gives none)."""
    table = plan.DRIVERS
    if isinstance(table, Mapping):
        return {str(getattr(k, "value", k)): str(v) for k, v in table.items()}
    return {str(getattr(d, "value", d)): getattr(d, "description", None) for d in table}


def form_names() -> set[str]:
    """Every name a Form takes: forms.FORMS, or the FormKind enum that replaced it."""
    return names(getattr(forms, "FORMS", None) or forms.FormKind)


def section(text: str, heading: str) -> str:
    """A page's text from a heading to the next heading of any level."""
    start = text.index(heading)
    following = re.search(r"^#", text[start + len(heading):], re.M)
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def bullet(text: str, opening: str) -> str:
    """A list item of the page, from its opening words to the next item or blank line."""
    start = text.index(opening)
    end = re.search(r"\n(?:- |\n)", text[start:])
    return text[start:start + end.start()] if end else text[start:]


def flat(text: str) -> str:
    """Prose with its line breaks as spaces, for a regular expression over a wrapped sentence."""
    return re.sub(r"\s+", " ", text)


def numbers(text: str) -> list[int]:
    """"3, 5, 6 and 7" -> [3, 5, 6, 7]."""
    return [int(n) for n in re.findall(r"\d+", text)]


# --- kinds ---------------------------------------------------------------------------------------

def test_the_kinds_kept_as_stored_are_the_kinds_blockdot_runs():
    """A sentence that says kinds are kept or run as stored and lists three or more names every kind
    blockdot runs (blockdot.runs), and no other."""
    runs = {kind for kind in BLOCK_TYPES if blockdot.runs(kind)}
    stated = {(page, frozenset(KIND.findall(s))) for page, text in STATED.items() for s in statements(text)
              if "as stored" in s and len(set(KIND.findall(s))) >= 3}
    assert {page for page, _ in stated} >= {"cpu-kernels.md", "execution-plan.md", "architecture.md", "blockdot.c"}
    assert [(page, sorted(kinds ^ runs)) for page, kinds in stated if kinds != runs] == []


def test_the_kinds_that_scale_16_weights():
    """The kinds a page names right after "scale(s) 16 weights" are those whose groups are 16, the
    ones torch's int4 kernel does not take."""
    sixteens = {kind for kind, t in BLOCK_TYPES.items() if t.group == 16}
    assert sixteens == {kind for kind in BLOCK_TYPES if not torch_runs(kind)}
    found = [(page, set(KIND.findall(m.group(1)))) for page, text in DOCS.items() for s in statements(text)
             for m in re.finditer(r"scales? 16 weights([^;|]*)", s) if KIND.search(m.group(1))]
    assert len(found) >= 2
    assert [(page, sorted(kinds)) for page, kinds in found if kinds != sixteens] == []


# --- blockdot's tiles ----------------------------------------------------------------------------

def _task_source() -> str:
    start = BLOCKDOT_C.index("static void task(")
    return BLOCKDOT_C[start:BLOCKDOT_C.index("\n}\n", start)]


def c_tiles() -> dict[str, object]:
    """blockdot.c's tile sizes, read from its source."""
    task = _task_source()
    dense = re.search(r"#define DP_MR \(SIMD == 512 \? (\d+) : (\d+)\)", BLOCKDOT_C)
    np_rule = re.search(r"const int NP = SIMD == 256 \? \(M <= (\d+) \? 4 : M <= (\d+) \? 2 : 1\) : "
                        r"M <= (\d+) \? 4 : M <= (\d+) \? 2 : 1;", BLOCKDOT_C)
    avx2 = re.search(r"#if SIMD == 256\n(.*?)#endif", task, re.S).group(1)
    avx512 = re.search(r"#if SIMD == 512\n(.*?)#endif", task, re.S).group(1)
    one_panel = sorted({int(a) for a, b in re.findall(r"else if \(left >= (\d+)\) \{ MR = (\d+);", task) if a == b},
                       reverse=True)
    assert dense and np_rule and one_panel, "blockdot.c's tile code no longer reads as this test expects"
    a2_1, a2_2, o_1, o_2 = (int(g) for g in np_rule.groups())
    avx2_rows = int(re.search(r"NP == 1 && left >= (\d+)", avx2).group(1))
    return {
        "dense": {"AVX-512": int(dense.group(1)), "AVX2": int(dense.group(2)), "plain C": int(dense.group(2))},
        # (panels, the widest step they take) for the 4- and 2-panel tiles
        "panels": {"AVX-512": [(4, o_1), (2, o_2)], "AVX2": [(4, a2_1), (2, a2_2)], "plain C": [(4, o_1), (2, o_2)]},
        "one_panel": {"AVX-512": one_panel[0], "AVX2": avx2_rows, "plain C": one_panel[0]},
        "one_panel_chain": one_panel,  # plain C's rows a one-panel tile, widest first
        "speculation": sorted({int(n) for n in re.findall(r"left == (\d+)", avx512)}),
        "max_sums": {"AVX-512": max(4 * o_1, 2 * o_2, one_panel[0]), "AVX2": max(4 * a2_1, 2 * a2_2, avx2_rows)},
    }


def doc_tiles() -> dict[str, tuple[str, str]]:
    """cpu-kernels.md's tile table: build -> (blockdot's panels, dense panels)."""
    rows = re.findall(r"^\| (AVX-512|AVX2|plain C) \| (.*?) \| (.*?) \|$", section(DOCS["cpu-kernels.md"], "### Tiles"),
                      re.M)
    return {build: (quantized, dense) for build, quantized, dense in rows}


@pytest.mark.parametrize("build", ["AVX-512", "AVX2", "plain C"])
def test_tile_sizes_per_build(build):
    code, (quantized, dense) = c_tiles(), doc_tiles()[build]
    assert int(re.search(r"up to (\d+)", dense).group(1)) == code["dense"][build]
    assert [tuple(int(n) for n in pair) for pair in re.findall(r"(\d+) × [^(]*\((?:steps of )?up to (\d+) rows?",
                                                                 quantized)] == code["panels"][build]
    assert int(re.search(r"1 × (\d+) while \1 or more rows remain", quantized).group(1)) == code["one_panel"][build]
    if build == "plain C":
        assert numbers(re.search(r"then ([\d, and]+)$", quantized).group(1)) == code["one_panel_chain"][1:] + [1]


def test_the_speculation_tiles_and_the_sums_a_tile_holds():
    code, text = c_tiles(), flat(section(DOCS["cpu-kernels.md"], "### Tiles"))
    spec = code["speculation"]
    assert numbers(re.search(r"tiles of ([\d, ]+and \d+) rows", text).group(1)) == spec
    # after the tiles of the widest one-panel size, every remainder has its own tile
    widest = int(re.search(r"the rest in one tile of 1-(\d+) rows", doc_tiles()["AVX-512"][0]).group(1))
    assert widest == code["one_panel"]["AVX-512"] - 1
    assert set(range(1, widest + 1)) <= {1, *spec, *code["one_panel_chain"]}
    held = re.search(r"at most (\d+) vectors of sums \((\d+) on AVX2", text)
    assert (int(held.group(1)), int(held.group(2))) == (code["max_sums"]["AVX-512"], code["max_sums"]["AVX2"])


def test_panels_of_16_rows_and_blocks_of_32():
    rows = int(re.search(r"#define P (\d+)", BLOCKDOT_C).group(1))
    group = int(re.search(r"#define G (\d+)", BLOCKDOT_C).group(1))
    assert rows == blockdot.PANEL and group == BLOCK
    text = flat("\n".join(DOCS.values()))
    stated_rows = [int(n) for n in re.findall(r"panels? of (\d+) output rows|(\d+) output rows a panel", text)
                   for n in n if n]
    stated_groups = [int(n) for n in re.findall(r"blocks? of (\d+) (?:weights|activations)", text)]
    assert stated_rows and set(stated_rows) == {rows}
    assert stated_groups and set(stated_groups) == {group}


def test_the_builds_named():
    listed = re.search(r"besides this machine's \(([^)]*)\)", flat(DOCS["cpu-kernels.md"])).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(blockdot.BUILDS) - {"native"}


# --- the panels' bytes ---------------------------------------------------------------------------

class _NoBuild:
    """A stand-in for blockdot's library: pack lays the panels out without calling it."""


def _file_matrix(kind: str, rows: int = 16, cols: int = 256) -> object:
    """A [rows, cols] matrix of `kind` as a file holds it: random blocks (every byte below 0x60, so
    every fp16 field is a finite value of at most a few hundred) decoded by ggml_blocks."""
    t = BLOCK_TYPES[kind]
    raw = np.random.default_rng(0).integers(0, 0x60, size=(rows, cols // t.weights * t.nbytes), dtype=np.uint8)
    return decode_blocks(raw, kind)


def _panel_bits(w: object) -> float:
    panels = blockdot.pack(w, kernel=_NoBuild())
    N, K = w.shape
    return panels.data.nbytes * 8 / (N * K)


def test_bits_a_weight_in_the_panels_and_the_file():
    """cpu-kernels.md's table against blockdot.pack's panels of a matrix as its file gives it, and
    the file's bytes (ggml_blocks.BLOCK_TYPES)."""
    text = section(DOCS["cpu-kernels.md"], "### The panels' bytes")
    table = {kind: (float(panel), float(file)) for kind, panel, file
             in re.findall(r"^\| (\w+) \| [^|]+ \| [^|]+ \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)}
    assert set(table) == set(blockdot.KINDS)
    code = {kind: (_panel_bits(_file_matrix(kind)), BLOCK_TYPES[kind].nbytes * 8 / BLOCK_TYPES[kind].weights)
            for kind in blockdot.KINDS}
    assert {kind: pytest.approx(bits, abs=0.005) for kind, bits in code.items()} == table


def test_bits_a_weight_of_the_int4_and_of_mixed_rows():
    text = flat(section(DOCS["cpu-kernels.md"], "### The panels' bytes"))
    int4 = quantize_int4(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))
    assert float(re.search(r"own int4 is Q4_1's (\d+)", text).group(1)) == _panel_bits(int4)
    mixes = re.search(r"Rows of several types are int8: (\d+) bits a weight with fp16 heads, (\d+) with float32 ones "
                      r"or `G16`, (\d+) with `G16M`", text)

    def mixed(*kinds: str) -> float:
        return _panel_bits(cat_rows([_file_matrix(kind) for kind in kinds]))

    fp16, f32, g16m = (float(n) for n in mixes.groups())
    assert mixed("Q5_0", "Q8_0") == fp16
    assert mixed("Q5_K", "Q8_0") == mixed("Q6_K", "Q8_0") == f32
    assert mixed("Q4_K", "Q6_K") == g16m


# --- drivers and forms ---------------------------------------------------------------------------

def test_every_driver_or_form_name_in_backticks_is_the_code_s():
    known = set(drivers()) | form_names()
    written = {(page, name) for page, text in DOCS.items()
               for name in re.findall(r"`((?:c|torch|dense)-[a-z0-9-]+)`", text)}
    assert written
    assert sorted((page, name) for page, name in written if name not in known) == []


def test_the_plan_page_names_every_driver_and_every_planned_form():
    text = DOCS["execution-plan.md"]
    listed = bullet(text, "- **which driver runs decode-only steps")
    assert set(re.findall(r"`([a-z0-9-]+)`", listed)) == set(drivers())
    listed = bullet(text, "- **each matrix's weight form**")
    assert set(re.findall(r"`([a-z0-9-]+)`", listed)) == form_names() - names([forms.STORED])


def test_the_printed_plan_names_real_drivers_and_forms():
    printout = next(body for language, body in re.findall(r"^```(\w*)\n(.*?)^```", DOCS["execution-plan.md"],
                                                            re.M | re.S) if "nanoserve plan:" in body)
    steps = re.findall(r"^  (?:decode-only[^:]*|with a prompt): (\S+) \((.*)\)$", printout, re.M)
    matrices = re.findall(r"-> (\S+) ", printout)
    assert steps and matrices
    table = drivers()
    for name, description in steps:
        assert name in table
        if table[name] is not None:
            assert description.removesuffix(", each token a row") == table[name]
    assert set(matrices) <= form_names()


# --- the probe's constants and defaults ----------------------------------------------------------

def test_the_probe_table_states_the_code_s_constants():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", DOCS["execution-plan.md"], re.M)}
    margin = re.search(r"times ([\d.]+)x faster at one row", rows["kernels"])
    assert float(margin.group(1)) == precision.BLOCKDOT_MARGIN
    wide = re.search(r"the widest of (\d+), (\d+) and (\d+) rows at which blockdot stays within ([\d.]+)x",
                     rows["max_kernel_rows"])
    assert tuple(int(n) for n in wide.groups()[:3]) == tuple(precision.WIDE_ROWS)
    assert float(wide.group(4)) == precision.WIDE_MARGIN
    assert int(re.search(r"; (\d+) otherwise", rows["max_kernel_rows"]).group(1)) == precision.DEFAULT_KERNEL_ROWS
    copies = re.search(r"within ([\d.]+)x of the dequantized matmul at (\d+) rows", rows["dense_copies"])
    assert (float(copies.group(1)), int(copies.group(2))) == (precision.WIDE_MARGIN, precision.WIDE_ROWS[0])
    assert int(re.search(r"at (\d+) rows", rows["dense_kernel"]).group(1)) == precision.DENSE_ROWS
    probed = inspect.signature(precision.probe_cpu).parameters
    shape = re.search(r"\[(\d+) x (\d+)\] @ \[(\d+) x (\d+)\]", flat(DOCS["execution-plan.md"]))
    rows_, k, k2, n = (int(g) for g in shape.groups())
    assert (rows_, k, n) == (probed["rows"].default, probed["K"].default, probed["N"].default) and k2 == k


def test_attention_parts_and_the_int16_default():
    parts = tuple(int(re.search(rf"#define {name} (\d+)", FUSED_DECODE_C).group(1)) for name in ("PART", "PART_MAX", "PARTS"))
    stated = [tuple(int(n) for n in found) for text in DOCS.values()
              for found in re.findall(r"parts of at least (\d+) keys and at most (\d+), (\d+) of them", flat(text))]
    assert len(stated) >= 2 and set(stated) == {parts}
    default = re.search(r"from `blockdot_int16_rows` rows \((\d+) by default\)", flat(DOCS["cpu-kernels.md"]))
    assert int(default.group(1)) == PlanOverrides().blockdot_int16_rows
