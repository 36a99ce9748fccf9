"""The README and docs/ against the code: every link and repository path they name exists, every
command in their code blocks names a real make target, script, module, `nanoserve` command and
flag, every Python example compiles and imports what exists, and the README stays short. (The
README's architectures table is checked in test_families.py.)"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from nanoserve.serving.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 200  # what a newcomer reads; the rest belongs in docs/
# Where a `nanoserve <command>`'s flags are defined; another command's are looked for in all of nanoserve/.
COMMAND_SOURCES = {"serve": "nanoserve/serving/cli.py", "bench-serve": "nanoserve/serving/bench_serve.py",
                   "demo": "nanoserve/serving/demo.py", "plan": "nanoserve/serving/cli.py"}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_and_paths_resolve(page):
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M) if file.is_file() else []
        if not file.exists() or (anchor and anchor not in {slug(h) for h in headings}):
            missing.append(target)
    for path in re.findall(r"`((?:notes|docs|tests|nanoserve|benchmarks|data)/[^`\s<>{}*]*)`", text):
        if not (ROOT / path.rstrip(".,:;")).exists():
            missing.append(path)
    assert missing == []


def commands(text: str) -> list[list[str]]:
    """The command lines of the page's code blocks, as argv lists, comments cut: not Python's, and not
    a printout's (a block marked `text`)."""
    found = []
    for language, body in code_blocks(text):
        if language in ("python", "text"):
            continue
        for line in body.splitlines():
            line = re.split(r"\s#\s|\s#$", line, maxsplit=1)[0].strip()
            first = line.split(" ", 1)[0]
            if first in ("make", "torchrun", "nanoserve") or first.endswith(("bin/python", "bin/nanoserve", "python")):
                found.append(shlex.split(line))
    return found


def flags(argv: list[str]) -> list[str]:
    return [token.strip("[]").split("=")[0] for token in argv if token.strip("[]").startswith("--")]


def check_command(argv: list[str]) -> list[str]:
    """What in one command line names nothing real (empty: all of it exists)."""
    if argv[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        return [] if re.search(rf"^{re.escape(argv[1])}:", makefile, re.M) else [f"make target {argv[1]}"]
    if argv[0] == "torchrun":  # torchrun's own flags come before -m
        argv = ["python", *argv[argv.index("-m"):]]
    if argv[0].endswith("nanoserve"):
        argv = ["python", "-m", "nanoserve", *argv[1:]]
    if argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        if module == "nanoserve":
            if not rest or rest[0] not in COMMANDS:
                return [f"nanoserve command {rest[:1]}"]
            sources = ([ROOT / COMMAND_SOURCES[rest[0]]] if rest[0] in COMMAND_SOURCES
                       else sorted((ROOT / "nanoserve").rglob("*.py")))
        elif module.startswith(("nanoserve.", "benchmarks.")):
            path = ROOT / module.replace(".", "/")
            sources = sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        else:
            return []  # another tool's module (pytest): not this project's to check
    else:
        sources, rest = [ROOT / argv[1]], argv[2:]
    missing = [str(s.relative_to(ROOT)) for s in sources if not s.is_file()]
    if missing:
        return missing
    source = "".join(s.read_text() for s in sources)
    return [flag for flag in flags(rest) if f'"{flag}"' not in source]


def test_check_command_finds_what_is_not_there():
    assert check_command(shlex.split("nanoserve serve --port 8000")) == []
    assert check_command(shlex.split("nanoserve serve --no-such-flag 1")) == ["--no-such-flag"]
    assert check_command(shlex.split("nanoserve no-such-command")) != []
    assert check_command(shlex.split("python no_such_script.py")) == ["no_such_script.py"]
    assert check_command(shlex.split("make no-such-target")) != []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_name_real_scripts_and_flags(page):
    found = commands(page.read_text())
    wrong = {" ".join(argv): problems for argv in found if (problems := check_command(argv))}
    assert wrong == {}


def test_the_readme_shows_the_two_set_up_commands():
    assert commands((ROOT / "README.md").read_text())[:2] == [["make", "demo"], ["make", "test"]]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_examples_compile_and_import_what_exists(page):
    for language, body in code_blocks(page.read_text()):
        if language != "python":
            continue
        compile(body, str(page), "exec")
        for module, names in re.findall(r"^from (nanoserve[\w.]*) import (.+)$", body, re.M):
            imported = importlib.import_module(module)
            assert [n for n in re.split(r",\s*", names.strip()) if not hasattr(imported, n)] == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES
