"""Type-check the whole ``roseinfer`` package as it is installed.

The top-level folders (``policies/``, ``simulator/``, ...) are mapped to
subpackages ``roseinfer.policies``, ``roseinfer.simulator``, ... by
setuptools' ``package-dir``; mypy cannot follow that mapping, so imports
across subpackages would resolve to ``Any``. This script lays out the package
as it is installed, as symlinks under ``.typecheck/`` (git-ignored), and runs
mypy there with the settings of ``pyproject.toml``.

    python tools/typecheck.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tomllib
from mypy import api

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".typecheck"


def package_dirs() -> dict[str, Path]:
    """``roseinfer.X`` -> its folder, from pyproject's ``package-dir``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def build_tree() -> Path:
    """Symlink every package folder at its installed place; returns the package root."""
    shutil.rmtree(TREE, ignore_errors=True)
    dirs = package_dirs()
    for name in sorted(dirs, key=lambda n: n.count(".")):
        target = TREE.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in dirs[name].glob("*.py"):
            (target / source.name).symlink_to(source)
    return TREE / "roseinfer"


def main() -> int:
    """Run mypy on the laid-out package; exit with mypy's status."""
    package = build_tree()
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(package)])
    sys.stdout.write(stdout.replace(str(TREE) + "/", ""))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
