"""Every code block of README.md runs (issue 18, item 6), at tiny size.

Each ``bash``, ``python`` and ``toml`` block is one test. A bash block runs its
commands in order (``&&`` chains split, ``\\`` continuations joined, trailing
``# comments`` dropped), each made tiny by :func:`tiny`: ``--num-requests 16``
for the simulator, ``tiny-gpt2`` and 4 requests for the executor, a small grid
for ``rose-run profile``, serial sweeps; output files go to a temporary folder.
Python blocks run as written in a subprocess; TOML blocks must parse.

What does not run here is said in one of two places, each with its reason:

- a marker comment on the line before a block in README.md,
  ``<!-- readme-test: skip (why) -->``, skips the whole block;
- :data:`SKIPPED_COMMANDS` skips single commands (installs, a server that runs
  until stopped, CUDA, Ray, long benchmarks, placeholders ``...``), and a command
  whose input file (a profile) is not on this machine is skipped saying which file.

A public trace named in a command (``--trace azure-conv-2023``) is fetched from
``../shared/traces`` (the same published files, checksums checked, into a cache
of the test session), never from the network; without that folder the command
is skipped, saying so.

A block with nothing left to run is reported as skipped, never as passed.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_cli

from roseinfer.workloads import catalog

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHARED_TRACES = ROOT.parent / "shared" / "traces"
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]*)\)\s*-->")

SKIPPED_COMMANDS: tuple[tuple[str, str], ...] = (
    ("python3 -m venv", "makes a venv (CI does, then installs the project)"),
    (". .venv/bin/activate", "activates a venv"),
    ("pip install", "installs packages (CI installs the project)"),
    ("python -m pytest", "the test suite itself"),
    ("rose-serve", "a server that runs until stopped (tests/test_serve.py drives it)"),
    ("curl", "needs a running rose-serve"),
    ("bash ../shared", "a check script of the course's shared folder"),
    (
        "python benchmarks/fidelity.py",
        "a 20-minute benchmark (tests/test_fidelity.py runs it tiny)",
    ),
    ("--ray-address", "needs a running Ray cluster"),
    ("/path/to/", "a placeholder for your model directory"),
)
"""Command prefixes (or substrings) that are not run, and why."""

INPUT_FLAGS = ("--trace", "--cost-model", "--replica-config", "--grid", "--profile")
OUTPUT_FLAGS = ("--save-result", "--save-records", "--save-steps", "--output")
SIM_TINY = ["--num-requests", "16", "--no-summary"]
CAPACITY_TINY = ["--num-requests", "16", "--min-duration-s", "5", "--min-measured-requests",
                 "8", "--tolerance", "0.5", "--backend", "serial", "--quiet", "--no-summary"]  # fmt: skip
RUN_TINY = ["--num-requests", "4", "--quiet", "--no-summary", "--no-warmup", "--num-threads", "1",
            "--max-model-len", "128"]  # fmt: skip
PROFILE_TINY = ["--max-num-batched-tokens", "32", "--max-num-seqs", "2", "--max-model-len", "64",
                "--repetitions", "1", "--quiet", "--num-threads", "1"]  # fmt: skip


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    skip: str | None  # the README marker's reason


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md, with the marker on the line before each."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        blocks.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                            marker.group("why") if marker else None))  # fmt: skip
        i = end + 1
    return blocks


def commands(code: str) -> list[str]:
    """A bash block's commands: continuations joined, ``&&`` split, comments dropped."""
    out: list[str] = []
    joined = ""
    for line in code.splitlines():
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        text = re.sub(r"\s+#\s.*$", "", joined).strip()
        joined = ""
        out += [part.strip() for part in text.split(" && ") if part.strip()]
    return out


def skip_reason(command: str, argv: list[str], tmp: Path) -> str | None:
    """Why ``command`` is not run here, or None."""
    if "..." in argv:
        return "a placeholder (...) for the flags of the command before"
    for pattern, why in SKIPPED_COMMANDS:
        if command.startswith(pattern) or (pattern.startswith(("-", "/")) and pattern in command):
            return why
    if "--device" in argv and argv[argv.index("--device") + 1].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device"
    for i, arg in enumerate(argv[:-1]):
        name = argv[i + 1]
        if arg not in INPUT_FLAGS:
            continue
        if name in catalog.CATALOGUE:
            if not (SHARED_TRACES / catalog.CATALOGUE[name].file_name).exists():
                return f"the public trace {name} needs a download (no ../shared/traces copy)"
        elif not _input(name, tmp).exists():
            return f"its input {name} is not on this machine"
    return None


def _input(name: str, tmp: Path) -> Path:
    """An input path as the README means it: a public trace's name, a file from the
    repository root, or a file an earlier command of the block wrote."""
    if name in catalog.CATALOGUE:
        return Path(name)
    path = ROOT / name
    return path if path.exists() else tmp / Path(name).name


@pytest.fixture(autouse=True)
def _public_traces_offline(monkeypatch, tmp_path_factory) -> None:
    """Named traces come from ../shared/traces into a session cache, never the network."""
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "trace-cache"))
    monkeypatch.setenv(catalog.MIRROR_ENV, str(SHARED_TRACES))


def tiny(argv: list[str], tmp: Path) -> list[str]:
    """``argv`` at tiny size, its inputs resolved and its outputs in ``tmp``."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg in OUTPUT_FLAGS:
            argv[i + 1] = str(tmp / Path(argv[i + 1]).name)
        elif arg in INPUT_FLAGS:
            argv[i + 1] = str(_input(argv[i + 1], tmp))
        elif arg == "--model" and argv[i + 1] == "gpt2":
            argv[i + 1] = "tiny-gpt2"
    if argv[0] == "rose-sim" and "--list-policies" not in argv:
        if argv[1:2] == ["sweep"]:
            argv = [a for a in argv if a != "ray"]
            argv = [a for a in argv if a != "--backend"] + ["--backend", "serial", "--quiet",
                                                            "--no-summary"]  # fmt: skip
            argv[2] = str(_input(argv[2], tmp))
            if "--output" not in argv:
                argv += ["--output", str(tmp / "sweep.parquet")]
        elif argv[1:2] == ["capacity"]:
            argv += CAPACITY_TINY
        else:
            argv += SIM_TINY
    elif argv[:2] == ["rose-run", "profile"]:
        argv += PROFILE_TINY
    elif argv[:2] == ["rose-run", "save-model"]:
        pass  # tiny already (the README names tiny-gpt2); --output lands in tmp
    elif argv[0] == "rose-run":
        argv += RUN_TINY
    return argv


def run_command(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """rose-sim in this process (fast); everything else in a subprocess."""
    if argv[0] == "rose-sim":
        from roseinfer.cli.sim import main

        code, out, err = run_cli(main, "rose-sim", monkeypatch, capsys, *argv[1:])
        return code, out + err
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    else:
        module = {"rose-run": "roseinfer.cli.run"}[argv[0]]
        argv = [sys.executable, "-m", module, *argv[1:]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


BLOCKS = readme_blocks()


def test_readme_has_its_blocks() -> None:
    langs = [b.lang for b in BLOCKS]
    assert langs.count("bash") >= 10 and langs.count("python") >= 3


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.lang in ("bash", "python", "toml")],
    ids=lambda b: f"README.md:{b.line}-{b.lang}",
)
def test_readme_block_runs(block: Block, tmp_path: Path, monkeypatch, capsys) -> None:
    if block.skip:
        pytest.skip(f"README marker: {block.skip}")
    if block.lang == "toml":
        tomllib.loads(block.code)
        return
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env=_env())  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    ran, skipped = [], []
    for command in commands(block.code):
        argv = shlex.split(command)
        why = skip_reason(command, argv, tmp_path)
        if why is not None:
            skipped.append(f"{command[:60]}: {why}")
            continue
        small = tiny(argv, tmp_path)
        code, output = run_command(small, monkeypatch, capsys)
        assert code == 0, f"{' '.join(small)}\n{output[-3000:]}"
        assert "Traceback" not in output, output[-3000:]
        ran.append(command)
    if not ran:
        pytest.skip("; ".join(skipped))


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
