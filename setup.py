"""Builds roseinfer's compiled simulator core, when it can (pyproject.toml holds
the rest of the package's metadata).

The per-step modules listed in ``roseinfer/_core.py`` (``CORE_SOURCES``) are
compiled with Cython from their own ``.py`` files, typed by the ``.pxd`` files
beside them, and the build records each source's SHA-256 in
``roseinfer/_core_build.json``. Without Cython or a C compiler, or when a module
fails to compile, the install goes on without a compiled core, saying so in one
line, and roseinfer runs the pure-Python core (``roseinfer._core.core_info()``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_roseinfer_core", ROOT / "roseinfer" / "_core.py")
_core = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_core)  # type: ignore[union-attr]

CYTHON_DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,  # types come from the .pxd files; annotations are for mypy
    "embedsignature": True,
}


def _say(message: str) -> None:
    print(f"roseinfer: {message}", file=sys.stderr)


STAGE = ROOT / "build" / "core-src"


def _staged() -> list[Extension]:
    """The core modules' ``.py`` and ``.pxd`` files copied to their installed
    places under :data:`STAGE` (``simulator/engine.py`` to
    ``roseinfer/simulator/engine.py``): Cython finds a module's ``.pxd`` and
    its cimports by the module's package path, which ``package-dir`` maps
    elsewhere in the checkout."""
    extensions = []
    for name, source in _core.CORE_SOURCES.items():
        target = STAGE.joinpath(*name.split(".")).with_suffix(".py")
        target.parent.mkdir(parents=True, exist_ok=True)
        for folder in target.relative_to(STAGE).parents:
            (STAGE / folder / "__init__.py").touch()  # a package to Cython
        for suffix in (".py", ".pxd"):
            origin = (ROOT / source).with_suffix(suffix)
            if origin.exists():
                shutil.copy2(origin, target.with_suffix(suffix))
        extensions.append(Extension(name, [str(target)]))
    return extensions


def _cythonized(extensions: list[Extension]) -> list[Extension]:
    """``extensions`` turned into C extensions by Cython, or [] (one line says why)."""
    if os.environ.get(_core.PURE_ENV, "") not in ("", "0"):
        _say(f"{_core.PURE_ENV} is set: no compiled core built (pure-Python core)")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _say("Cython is not installed: no compiled core (pure-Python core)")
        return []
    try:
        return cythonize(
            extensions,
            compiler_directives=CYTHON_DIRECTIVES,
            build_dir=str(ROOT / "build" / "cython"),
            include_path=[str(STAGE)],
            quiet=True,
        )
    except Exception as err:  # a Cython error: the .py and .pxd files disagree
        _say(f"could not cythonize the compiled core ({type(err).__name__}: {err}); "
             "using the pure-Python core")  # fmt: skip
        return []


class OptionalBuildExt(build_ext):
    """``build_ext`` that cythonizes first and leaves the package pure Python,
    with one line, when anything about the compiled core fails."""

    def finalize_options(self) -> None:
        # NOTE: before setuptools' own pass over the extensions (it marks each one)
        self.distribution.ext_modules = _cythonized(_staged())
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        if not self.extensions:
            return
        info = Path(self.get_ext_fullpath("roseinfer.sequence")).parent / _core.BUILD_INFO
        info.unlink(missing_ok=True)
        try:
            super().run()
        except Exception as err:  # a missing compiler, a failed compile or link
            _say(f"could not build the compiled core ({type(err).__name__}: {err}); "
                 "using the pure-Python core")  # fmt: skip
            self.extensions = self.distribution.ext_modules = []
            return
        self._write_build_info()

    def build_extension(self, ext: Extension) -> None:
        # NOTE: no fused multiply-add contraction: C must round as Python does, so
        # both cores give bit-identical step times (and no debug info: 5x smaller)
        if self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, "-ffp-contract=off", "-g0"]
        super().build_extension(ext)

    def _write_build_info(self) -> None:
        """``_core_build.json`` beside the compiled ``roseinfer`` modules: each
        module's source (relative to that folder) and its hashes."""
        folder = Path(self.get_ext_fullpath("roseinfer.sequence")).resolve().parent
        modules = {}
        for name in _core.CORE_SOURCES:
            source = Path(self.get_ext_fullpath(name)).resolve().parent
            source = source / (name.rpartition(".")[2] + ".py")
            modules[name] = {
                "source": os.path.relpath(source, folder),
                "py": _core.file_digest(source),
                "pxd": _core.file_digest(source.with_suffix(".pxd")),
            }
        from Cython import __version__ as cython_version

        info = {"cython": cython_version, "modules": modules}
        (folder / _core.BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")


setup(
    ext_modules=[Extension(name, [path]) for name, path in _core.CORE_SOURCES.items()],
    cmdclass={"build_ext": OptionalBuildExt},
)
