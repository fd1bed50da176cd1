"""The import contract (`lint-imports`, pyproject.toml) holds, and it would catch a break: a copy
of the package with an upward import, or with a cycle between two modules of one package, fails."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "spanserve", tmp_path / "spanserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_package_keeps_its_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("model/config.py", "from spanserve.engine import engine", "spanserve.model is not allowed to import spanserve.engine"),
    ("cache/block_pool.py", "import spanserve.server.launch", "spanserve.cache is not allowed to import spanserve.server"),
    ("engine/params.py", "from spanserve.engine import sampling", "No cycles are allowed in spanserve.engine"),
])
def test_a_planted_import_breaks_it(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy(tmp_path)
    with open(root / "spanserve" / module, "a") as f:
        f.write(f"\n{line}  # planted\n")
    result = _lint(root)
    assert result.returncode != 0
    assert broken in result.stdout
