"""The house's layout: imports run one way, with no circles, and each module imports alone.

The import graph is read with ``ast`` from the source folders, mapped to the
installed names through ``pyproject.toml``'s ``package-dir`` (``policies/`` is
``roseinfer.policies``): every import counts, a function's lazy one too, except
those under ``if TYPE_CHECKING:`` (they never run). The layers, bottom up:

    metrics  <-  core (roseinfer/*)  <-  workloads, calibration  <-  policies,
    simulator, executor  <-  serve, experiments  <-  integrations  <-  cli

A module imports its own layer's modules and those below, never above; nothing
but the CLI wing imports a CLI module; torch is the executor's (and its
server's and the integrations'), never the core's or the simulator's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

LAYERS: dict[str, set[str]] = {
    "metrics": set(),
    "core": {"metrics"},
    "workloads": {"core", "metrics"},
    "calibration": {"core", "metrics"},
    "policies": {"core", "metrics"},
    "simulator": {"calibration", "workloads", "core", "metrics"},
    "executor": {"calibration", "workloads", "core", "metrics"},
    "serve": {"executor", "calibration", "workloads", "core", "metrics"},
    "experiments": {"simulator", "calibration", "workloads", "core", "metrics"},
    "integrations": {"experiments", "simulator", "calibration", "workloads", "core", "metrics"},
    "cli": {
        "serve",
        "experiments",
        "simulator",
        "executor",
        "calibration",
        "workloads",
        "core",
        "metrics",
    },  # fmt: skip
}
"""Each room and the rooms below it that it may import (its own always)."""
TORCH_ROOMS = {"executor", "serve", "integrations", "cli"}
"""The rooms that may import torch (the CLI only inside a function: see below)."""
HEAVY = ("torch", "transformers")


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Installed module name -> source file, through ``package-dir``."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package, folder in setup["package-dir"].items():
        for file in sorted((root / folder).glob("*.py")):
            modules[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
    return modules


def room(module: str) -> str:
    """``roseinfer.simulator.engine`` -> ``simulator``; ``roseinfer.scheduler`` -> ``core``."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "core"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        name = getattr(test, "id", None) or getattr(test, "attr", None)
        if isinstance(node, ast.If) and name == "TYPE_CHECKING":
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    return skip


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(roseinfer modules, other top-level packages) that ``module`` imports at run time."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    ours: set[str] = set()
    theirs: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]  # fmt: skip
        else:
            continue
        for name in names:
            if name.split(".")[0] == "roseinfer":
                target = _resolve(name, modules)
                if target and target != module:
                    ours.add(target)
            else:
                theirs.add(name.split(".")[0])
    return ours, theirs


@cache
def graph(root: Path = ROOT) -> dict[str, tuple[set[str], set[str]]]:
    """module -> (roseinfer imports, third-party imports) of the tree at ``root``."""
    modules = source_modules(root)
    return {m: imports(m, p, modules) for m, p in modules.items()}


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The import circles of the tree at ``root``: strongly connected components
    of more than one module (Tarjan's algorithm, iterative)."""
    edges = {m: sorted(ours) for m, (ours, _) in graph(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


# ------------------------------------------------------------------- tests
def test_no_import_circles() -> None:
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_circle(tmp_path: Path) -> None:
    """A two-module circle through a lazy import, and none through TYPE_CHECKING."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "roseinfer" = "pkg" }\n'
    )
    (tmp_path / "pkg" / "a.py").write_text("from roseinfer import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from roseinfer.a import x\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from roseinfer import a\n"
    )
    assert import_cycles(tmp_path) == [["roseinfer.a", "roseinfer.b"]]


def test_imports_run_one_way() -> None:
    wrong = [
        f"{module} ({room(module)}) imports {target} ({room(target)})"
        for module, (ours, _) in graph().items()
        for target in ours
        if room(target) != room(module) and room(target) not in LAYERS[room(module)]
    ]
    assert wrong == []


def test_only_the_cli_imports_a_cli_module() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, (ours, _) in graph().items()
        for target in ours
        if room(target) == "cli" and room(module) != "cli"
    ]
    assert wrong == []


def test_torch_stays_in_the_executor_rooms() -> None:
    wrong = [
        f"{module} imports {', '.join(sorted(theirs & set(HEAVY)))}"
        for module, (_, theirs) in graph().items()
        if theirs & set(HEAVY) and room(module) not in TORCH_ROOMS
    ]
    assert wrong == []


def test_commands_parse_and_check_without_torch() -> None:
    """Every CLI module imports without torch or transformers, so ``--help`` and a bad
    flag answer before either loads (they load only to build a model)."""
    cli = [m for m in source_modules() if room(m) == "cli"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {cli!r}: importlib.import_module(m)\n"
        f"print(json.dumps([h for h in {HEAVY!r} if h in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def _importable(module: str) -> bool:
    """Whether every third-party package ``module`` imports is installed."""
    _, theirs = graph()[module]
    return all(importlib.util.find_spec(name) is not None for name in theirs - {"__future__"})


def _import_each_alone(modules: list[str]) -> dict[str, str]:
    """Import each module in one fresh interpreter with every ``roseinfer`` module
    forgotten before it (third-party ones stay loaded: their import order is not
    ours to test); module -> error."""
    code = (
        "import importlib, json, sys\n"
        "errors = {}\n"
        f"for m in {modules!r}:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] == 'roseinfer']:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as err:\n"
        "        errors[m] = f'{type(err).__name__}: {err}'\n"
        "print(json.dumps(errors))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_torch_free_module_imports_alone() -> None:
    modules = [m for m in source_modules() if room(m) not in TORCH_ROOMS - {"cli"}]
    assert _import_each_alone([m for m in modules if _importable(m)]) == {}


@pytest.mark.slow
def test_every_module_imports_alone() -> None:
    pytest.importorskip("torch")
    modules = [m for m in source_modules() if room(m) in TORCH_ROOMS - {"cli"}]
    assert _import_each_alone([m for m in modules if _importable(m)]) == {}


@pytest.mark.parametrize("argv", [["--help"], ["--num-requests", "50", "--quiet"]])
def test_rose_sim_imports_no_heavy_module_it_does_not_use(argv: list[str]) -> None:
    """Modules that name pandas at their top bind it lazily (``metrics/lazy.py``),
    a simulation is summarised from its columns and the Azure trace is read with
    the csv module: ``rose-sim --help`` and a quiet run never import pandas. The
    calibration package loads its profile readers and fitters on first use, and
    the trace catalogue its HTTP client only to download: a roofline run needs
    neither."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['rose-sim', *{argv!r}]\n"
        "try:\n"
        "    runpy.run_module('roseinfer.cli.sim', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('pandas', 'tqdm', 'pyarrow', 'urllib.request',\n"
        "         'roseinfer.calibration.profile', 'roseinfer.calibration.roofline_fit')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_lazy_module_imports_on_first_use() -> None:
    code = (
        "import sys\n"
        "from roseinfer.metrics.lazy import pandas as pd\n"
        "before = 'pandas' in sys.modules\n"
        "frame = pd.DataFrame({'a': [1]})\n"
        "print(before, 'pandas' in sys.modules, type(frame).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "DataFrame"]


def test_lazy_exports_load_a_name_on_first_use_and_refuse_unknown_ones() -> None:
    code = (
        "import sys\n"
        "import roseinfer.calibration as c\n"
        "before = 'roseinfer.calibration.roofline_fit' in sys.modules\n"
        "fit = c.calibrate_roofline\n"
        "after = 'roseinfer.calibration.roofline_fit' in sys.modules\n"
        "try:\n"
        "    c.no_such_name\n"
        "    refused = False\n"
        "except AttributeError as err:\n"
        "    refused = 'no_such_name' in str(err)\n"
        "print(before, after, 'calibrate_roofline' in vars(c), 'fit_step_model' in dir(c), refused)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "True", "True"]
