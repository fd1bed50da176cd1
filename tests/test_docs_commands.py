"""The README and docs name scripts that exist, with flags those scripts take.

Every `python benchmarks/...py` or `python tools/...py` command in README.md, docs/*.md and
benchmarks/experiments/README.md (inline code, tables and code blocks, `\\` continuations
joined) must name an existing script, and every `--flag` of the command must be one of the
script's argparse options, read from its source (its add_argument calls); nothing is run. Every
path of a script or test file the prose names (benchmarks/, tools/, tests/) must exist too, but
for `COMMIT:path`, a file in the repository's history."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "experiments" / "README.md"]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
COMMAND = re.compile(r"(?<![\w/])(?:[\w./$<>-]*/)?python3?\s+((?:benchmarks|tools)/[\w/]+\.py)((?:[ \t]+[^\s`|#][^\s`|]*)*)")
PATH = re.compile(r"(?<![\w/.:])((?:benchmarks|tools|tests)/[\w/]+\.py)\b")  # not COMMIT:path


def code_text(text: str) -> str:
    """Fenced blocks with their continuation lines joined; inline code spans on one line each."""
    blocks = [m.group(0).replace("\\\n", " ") for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    spans = [m.group(0).replace("\n", " ") for m in re.finditer(r"`[^`]+`", prose)]
    indented = re.findall(r"^(?: {4}|\t).*$", prose.replace("\\\n", " "), re.M)
    return "\n".join(blocks + spans + indented)


def commands() -> list[tuple[str, str, list[str]]]:
    """(document, script, flags) for every python command of a benchmark or tool script."""
    out = []
    for doc in DOCS:
        for m in COMMAND.finditer(code_text(doc.read_text())):
            flags = [a.split("=")[0] for a in m.group(2).split() if a.startswith("--")]
            out.append((doc.relative_to(ROOT).as_posix(), m.group(1), flags))
    return out


@cache
def options(script: str) -> frozenset[str]:
    """Every option string passed to an add_argument call in the script's source."""
    tree = ast.parse((ROOT / script).read_text())
    return frozenset(
        a.value for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
        for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"))


def test_the_docs_have_commands_to_check():
    found = commands()
    assert len(found) > 30 and {s for _, s, _ in found} >= {"benchmarks/rag_ttft.py", "benchmarks/tp_gpu.py"}


@pytest.mark.parametrize("doc,script,flags", commands(), ids=lambda x: x if isinstance(x, str) else None)
def test_a_command_names_a_script_and_its_flags(doc, script, flags):
    assert (ROOT / script).is_file(), f"{doc}: {script} does not exist"
    unknown = [f for f in flags if f not in options(script) and f not in ("--help", "-h")]
    assert not unknown, f"{doc}: {script} takes no {unknown}"


def test_every_named_script_or_test_file_exists():
    missing = sorted({f"{doc.relative_to(ROOT).as_posix()}: {p}" for doc in DOCS
                      for p in PATH.findall(doc.read_text()) if not (ROOT / p).is_file()})
    assert not missing, "\n".join(missing)
