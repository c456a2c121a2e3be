"""Types for plugin authors (issue 18, item 8): ``roseinfer`` ships ``py.typed``,
and an editable install in setuptools' strict mode lays the package out as
installed (the top-level folders mapped by ``package-dir`` become links under
``build/``), so plain mypy sees real types for every ``roseinfer.*`` import.

The default (lenient) editable install maps the folders with an import hook that
no type checker runs: mypy, pyright and IDEs then find no ``roseinfer.policies``
and so on. Install for type checking with::

    pip install -e . --config-settings editable_mode=strict
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = """
from __future__ import annotations

from collections.abc import Sequence

from roseinfer import hookimpl
from roseinfer.interface import AdmissionPolicy, Budget, Choice, PolicyContext
from roseinfer.sequence import Sequence as Seq


class ShortestFirst(AdmissionPolicy):
    name = "shortest-first"
    description = "shortest prompt first"

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        chosen: list[Choice] = list(sorted(waiting, key=ctx.cost)[: budget.max_seqs])
        return chosen


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    return [ShortestFirst]
"""

MISTAKES = """
from roseinfer.interface import Budget
from roseinfer.policies.length import ShortestJobFirst
from roseinfer.simulator.engine import simulate


def wrong(budget: Budget) -> str:
    return budget.max_seqs  # an int


policy_name: int = ShortestJobFirst.name  # a str
result: int = simulate  # a function
"""


def test_package_ships_py_typed() -> None:
    assert (ROOT / "roseinfer" / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    assert '"roseinfer" = ["py.typed"]' in text


@pytest.fixture(scope="module")
def strict_tree(tmp_path_factory) -> Path:
    """The package as a strict editable install lays it out (pip, no network)."""
    pytest.importorskip("mypy.api")
    pytest.importorskip("setuptools")
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--config-settings", "editable_mode=strict", "-e", str(ROOT),
         "--target", str(target)],
        capture_output=True, text=True, timeout=300,
        # the types need no compiled core (building one would rewrite the checkout's)
        env={**os.environ, "ROSEINFER_PURE_PYTHON": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"pip could not make a strict editable install here: {proc.stderr[-300:]}")
    (pth,) = target.glob("__editable__.roseinfer-*.pth")
    tree = Path(pth.read_text().strip())
    assert (tree / "roseinfer" / "py.typed").is_file()
    assert (tree / "roseinfer" / "policies" / "length.py").exists()  # mapped folder
    return tree


def _mypy(tree: Path, tmp_path: Path, source: str) -> tuple[str, int]:
    from mypy import api

    # What a plugin author's own mypy config holds: strict checking of their code,
    # the installed roseinfer (its own modules not re-checked), no stubs for
    # roseinfer's untyped dependencies.
    config = tmp_path / "mypy.ini"
    config.write_text(
        f"[mypy]\nmypy_path = {tree}\nstrict = True\n"
        "[mypy-roseinfer.*]\nfollow_imports = silent\n"
        "[mypy-pandas.*,matplotlib.*,scipy.*,tqdm.*,pluggy.*,torch.*,transformers.*]\n"
        "ignore_missing_imports = True\n"
    )
    module = tmp_path / "third_party.py"
    module.write_text(source)
    out, err, status = api.run(
        ["--config-file", str(config), "--no-incremental", "--cache-dir", str(tmp_path / "c"),
         str(module)]
    )  # fmt: skip
    return out + err, status


def test_third_party_policy_type_checks_against_the_installed_package(
    strict_tree: Path, tmp_path: Path
) -> None:
    out, status = _mypy(strict_tree, tmp_path, PLUGIN)
    assert status == 0, out


def test_mypy_sees_real_types_not_any(strict_tree: Path, tmp_path: Path) -> None:
    """Each mistake is caught only if the imported names have their real types
    (with ``Any`` every line passes), across the mapped folders too."""
    out, status = _mypy(strict_tree, tmp_path, MISTAKES)
    assert status == 1, out
    assert 'Incompatible return value type (got "int", expected "str")' in out
    assert 'Incompatible types in assignment (expression has type "str"' in out
    assert 'expression has type "def simulate(requests: Sequence[Request]' in out, out
