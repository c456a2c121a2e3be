"""Fuzz the input boundary (issue 10, item 5): random bytes and random rows to
every trace loader, random values to every flag of both CLIs' parsers and
checks. Every input either works or ends in one ``prog: error:`` line with exit
code 2; any other exception (a traceback) fails the test.

Parsing and checking only: no run, no model (so the whole file takes seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import string
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer import workloads
from roseinfer.cli import sim as sim_cli
from roseinfer.cli.config import check_args
from roseinfer.cli.flags import friendly_errors, warn_to
from roseinfer.registry import Registry, load_registry, warning_sink

FUZZ = settings(
    # NOTE: ROSE_FUZZ_EXAMPLES=2000 for a longer hunt; 120 keeps the file near 15 s.
    max_examples=int(os.environ.get("ROSE_FUZZ_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
FOLDER = Path(tempfile.mkdtemp(prefix="rose-fuzz-"))


@cache
def registry() -> Registry:
    return load_registry()


def outcome(prog: str, work: Callable[[], object]) -> tuple[int, list[str]]:
    """Run ``work`` as a CLI would; (exit code, stderr lines). Exceptions other than
    the CLI's exit propagate and fail the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            with friendly_errors(prog), warning_sink(warn_to(prog)):  # as run_main does
                work()
            code = 0
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, err.getvalue().strip().splitlines()


def assert_clean(prog: str, code: int, lines: list[str]) -> None:
    """Success, or exactly one ``prog: error:`` line with exit code 2 (after any
    ``prog: warning:`` lines, e.g. a deprecated flag's)."""
    if code == 0:
        return
    assert code == 2, (code, lines)
    lines = [line for line in lines if not line.startswith(f"{prog}: warning: ")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    assert len(lines[0]) < 2000, lines[0][:300]


def load(path: Path, fmt: str) -> None:
    reqs = workloads.load_trace(path, fmt)
    assert reqs and reqs[0].arrival_time_s == 0.0
    assert len({r.request_id for r in reqs}) == len(reqs)


# ------------------------------------------------------------------ loaders
@FUZZ
@given(data=st.binary(max_size=400), fmt=st.sampled_from(workloads.KNOWN_FORMATS))
def test_random_bytes_to_every_loader(data: bytes, fmt: str) -> None:
    path = FOLDER / "bytes.trace"
    path.write_bytes(data)
    assert_clean("rose-sim", *outcome("rose-sim", lambda: load(path, fmt)))


CELL = st.one_of(
    st.sampled_from(
        ["", " ", "0", "1", "-1", "2.5", "1e30", "1e308", "-1e308", "1e309", "nan", "inf",
         "-inf", "99999999999999999999", "0x10", "abc", "=1+1", "2023-11-16 18:15:46.6800000",
         "2023-13-45 99:99:99", '"', "a,b"]
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(string.printable, max_size=12),
)  # fmt: skip
HEADERS = [
    "arrival_s,prompt_tokens,output_tokens",
    "arrival_s,prompt_tokens,output_tokens,request_id,tenant",
    "TIMESTAMP,ContextTokens,GeneratedTokens",
]


@FUZZ
@given(
    header=st.sampled_from(HEADERS),
    rows=st.lists(st.lists(CELL, min_size=2, max_size=6), min_size=0, max_size=6),
    fmt=st.sampled_from(workloads.KNOWN_FORMATS),
)
def test_random_csv_rows(header: str, rows: list[list[str]], fmt: str) -> None:
    path = FOLDER / "rows.csv"
    path.write_text("\n".join([header, *(",".join(r) for r in rows)]) + "\n")
    assert_clean("rose-sim", *outcome("rose-sim", lambda: load(path, fmt)))


JSON_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.sampled_from([0, 1, -1, 10**400, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = [
    "arrival_s", "prompt_tokens", "output_tokens", "request_id", "tenant",
    "timestamp", "input_length", "output_length", "hash_ids",
]  # fmt: skip


@FUZZ
@given(
    rows=st.lists(
        st.dictionaries(st.sampled_from(KEYS), JSON_VALUE, min_size=2, max_size=len(KEYS)),
        min_size=1,
        max_size=5,
    ),
    fmt=st.sampled_from(workloads.KNOWN_FORMATS),
)
def test_random_jsonl_rows(rows: list[dict], fmt: str) -> None:
    path = FOLDER / "rows.jsonl"
    # NOTE: allow_nan writes NaN/Infinity as Python's json would accept them on load.
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    assert_clean("rose-sim", *outcome("rose-sim", lambda: load(path, fmt)))


# -------------------------------------------------------------------- flags
VALUE = st.one_of(
    st.sampled_from(
        ["0", "1", "-1", "2", "16", "1e9", "1000000000", "nan", "inf", "-inf", "0.5", "5",
         "1e-9", "99999999999999999999999", "", "abc", "cpu", "meta", "fifo", "pack",
         "decode-first", "k=v", "ttft:200", "x.txt", "r.json", "/", "seed-031", "synthetic"]
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)  # fmt: skip
SWITCHES = ["--enable-chunked-prefill", "--chunk-head", "--no-enable-prefix-caching", "--quiet"]


def valued_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option of ``parser`` that takes a value (paths excluded: see below)."""
    skip = {"--trace", "--save-result", "--save-records", "--cost-model", "--model"}
    return sorted(
        a.option_strings[-1]
        for a in parser._actions
        if a.option_strings and a.nargs != 0 and a.option_strings[-1] not in skip
    )


def flag_argv(parser: argparse.ArgumentParser):  # type: ignore[no-untyped-def]
    pairs = st.lists(st.tuples(st.sampled_from(valued_flags(parser)), VALUE), max_size=5)
    outputs = st.lists(
        st.tuples(
            st.sampled_from(["--save-result", "--save-records"]),
            st.sampled_from([str(FOLDER), str(FOLDER / "r.json"), str(FOLDER / "r.csv"),
                             str(FOLDER / "r.txt"), "/proc/x/r.csv", ""]),
        ),
        max_size=2,
    )  # fmt: skip
    return st.tuples(pairs, outputs, st.lists(st.sampled_from(SWITCHES), max_size=2)).map(
        lambda t: [x for pair in (*t[0], *t[1]) for x in pair] + t[2]
    )


def check_sim(argv: list[str]) -> None:
    args = sim_cli.build_parser().parse_args(argv)
    options = check_args(args, registry())
    if args.cost_model is None:  # the setup reads no file unless --model is a path
        sim_cli.run_config(args, registry(), options, sim_cli.setup_of(args))


@FUZZ
@given(data=st.data())
def test_random_rose_sim_flags(data: st.DataObject) -> None:
    argv = data.draw(flag_argv(sim_cli.build_parser()))
    assert_clean("rose-sim", *outcome("rose-sim", lambda: check_sim(argv)))


@FUZZ
@given(data=st.data())
def test_random_rose_run_flags(data: st.DataObject) -> None:
    pytest.importorskip("torch")
    from roseinfer.cli import run as run_cli

    def check() -> None:
        args = run_cli.build_parser().parse_args(argv)
        run_cli.check_run_args(args, registry())

    argv = data.draw(flag_argv(run_cli.build_parser()))
    assert_clean("rose-run", *outcome("rose-run", check))
