"""The package's rooms and walls, read from the source with `ast`: no import cycle (function-local and
TYPE_CHECKING imports included), the engine core never imports the instruments or serving, the model
knows nothing of requests, only the engine knows the whole core, and the seeds' module names stay
importable."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every nanoserve module `path` imports anywhere in its body. `from pkg import name` counts as
    an import of pkg.name when that is a module, else of pkg. A package's own parents are not
    counted: importing nanoserve.model.llama runs nanoserve/__init__ first, but that is Python's
    doing, not an edge of the design."""
    this = module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = this.split(".")[: len(this.split(".")) - node.level + (1 if is_package else 0)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for alias in node.names:
                candidate = f"{base_name}.{alias.name}"
                found.add(candidate if candidate in modules else base_name)
    return {m for m in found if m in modules and m != this}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reached_from(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` pulls in, transitively."""
    reached, todo = set(), [module]
    while todo:
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    return reached


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_find_cycle_finds_a_hand_made_cycle_and_none_in_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_of_sees_function_local_and_type_checking_imports(tmp_path):
    root = tmp_path / "nanoserve"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nanoserve import y\n"
                               "def f():\n    import nanoserve.z\n")
    modules = {"nanoserve": root / "__init__.py", "nanoserve.x": root / "x.py", "nanoserve.y": root / "y.py",
               "nanoserve.z": root / "z.py"}
    global PACKAGE
    saved, PACKAGE = PACKAGE, root
    try:
        assert imports_of(root / "x.py", modules) == {"nanoserve.y", "nanoserve.z"}
    finally:
        PACKAGE = saved


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


CORE = ["nanoserve.engine", "nanoserve.scheduler", "nanoserve.blocks", "nanoserve.inputs", "nanoserve.sampling",
        "nanoserve.output_processor", "nanoserve.recorder", "nanoserve.request", "nanoserve.params",
        "nanoserve.config", "nanoserve.detokenize", "nanoserve.chat"]


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_neither_instruments_nor_serving(module):
    reached = reached_from(import_graph(), module)
    outside = sorted(m for m in reached if m.startswith(("nanoserve.instruments", "nanoserve.serving")))
    assert outside == []


@pytest.mark.parametrize("seed_module", ["nanoserve.profiler", "nanoserve.output", "nanoserve.baseline"])
def test_the_seeds_module_names_still_import(seed_module):
    module = importlib.import_module(seed_module)
    assert module.__all__ and all(hasattr(module, name) for name in module.__all__)


# What the model must not know: the requests and everything that tracks, schedules, outputs, runs,
# serves or measures them. The root package counts too: `import nanoserve` runs engine.py.
NOT_FOR_THE_MODEL = ["nanoserve.request", "nanoserve.scheduler", "nanoserve.blocks", "nanoserve.output",
                     "nanoserve.output_processor", "nanoserve.engine", "nanoserve.serving", "nanoserve.instruments"]


@pytest.mark.parametrize("module", sorted(m for m in all_modules() if in_room(m, "nanoserve.model")))
def test_the_model_knows_nothing_of_requests(module):
    graph = import_graph()
    reached = reached_from(graph, module)
    assert sorted(m for m in reached if m == "nanoserve" or any(in_room(m, room) for room in NOT_FOR_THE_MODEL)) == []


# The rooms only the engine joins; "nanoserve.model" stands for any module of the model package.
WHOLE_CORE = ["nanoserve.scheduler", "nanoserve.sampling", "nanoserve.output_processor", "nanoserve.model"]


def knows_the_whole_core(imports: set[str]) -> bool:
    return all(any(in_room(m, room) for m in imports) for room in WHOLE_CORE)


def test_knows_the_whole_core_needs_every_room():
    every = {"nanoserve.scheduler", "nanoserve.sampling", "nanoserve.output_processor", "nanoserve.model.llama"}
    assert knows_the_whole_core(every)
    assert not any(knows_the_whole_core(every - {m}) for m in every)


def test_only_the_engine_knows_the_whole_core():
    graph = import_graph()
    assert knows_the_whole_core(graph["nanoserve.engine"])  # else this wall guards nothing
    core = [m for m in graph if not in_room(m, "nanoserve.instruments") and not in_room(m, "nanoserve.serving")]
    assert sorted(m for m in core if m != "nanoserve.engine" and knows_the_whole_core(graph[m])) == []
