"""Hostile files and values the library must refuse in one line (step logs, profiles,
made-up token ids): each test names the defect it pins and what happened before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import req, run_cli

from roseinfer.calibration.profile import ProfileError, load_calibration
from roseinfer.calibration.steplog import (
    StepLogError,
    StepLogWriter,
    StepRecord,
    load_step_log,
    make_header,
)
from roseinfer.cli.sim import main as sim_main

EXECUTOR = {"num_kv_blocks": 64, "block_size": 16, "max_model_len": 512, "max_num_seqs": 8}


def steps(n: int = 12) -> list[dict]:
    return [
        StepRecord(k, 0.01 * k, 0.01 * k + 0.008 + 0.001 * (k % 3), None, "decode", ("a", "b"),
                   (1, 1), (10 + k, 20 + k), (True, True)).to_json()
        for k in range(n)
    ]  # fmt: skip


def write_log(path: Path, header: dict | None = None, rows: list[dict] | None = None) -> Path:
    head = header if header is not None else make_header("rose-run", model={"name": "gpt2", "spec": None},
                                                         executor=EXECUTOR)  # fmt: skip
    lines = [json.dumps(head)] + [json.dumps(r) for r in (rows if rows is not None else steps())]
    path.write_text("\n".join(lines) + "\n")
    return path


def sim_error(monkeypatch, capsys, *args: str) -> str:
    code, _, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, *args)
    lines = [ln for ln in err.strip().splitlines() if ": warning: " not in ln]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: r.update(end_s=r["start_s"] + 1e-15), "under 1e-06 s"),
        (
            lambda r: r.update(num_new_tokens=[10**18, 1], num_context_tokens=[10**18, 20]),
            "num_context_tokens <= 2147483647",
        ),
        (lambda r: r.update(phase="warp"), "phase must be one of"),
        (lambda r: r.update(start_s="0.1"), "start_s must be a number of seconds, got '0.1'"),
        (lambda r: r.update(is_decode=[1, 1]), "is_decode must be a list of true or false"),
        (lambda r: r.pop("num_new_tokens"), "missing field 'num_new_tokens'"),
        (lambda r: r.update(request_ids=[{"a": 1}, "b"]), "request_ids must be a list of strings"),
    ],
)
def test_absurd_step_fields_name_the_line_and_field(tmp_path: Path, edit, needle) -> None:
    """Before: 1e-15 s steps (TTFT 0.00 ms), 10^18 tokens and phase "warp" passed."""
    rows = steps()
    edit(rows[4])
    with pytest.raises(StepLogError) as err:
        load_step_log(write_log(tmp_path / "s.jsonl", rows=rows))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 's.jsonl'}:6: bad step: ") and needle in message
    assert "\n" not in message


def test_a_deeply_nested_step_line_is_one_line(tmp_path: Path) -> None:
    """Before: a 100,000-deep JSON line raised RecursionError."""
    path = write_log(tmp_path / "s.jsonl")
    path.write_text(path.read_text() + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(StepLogError, match=r":14: bad step: JSON nested too deep"):
        load_step_log(path)


@pytest.mark.parametrize(
    ("header_edit", "needle"),
    [
        (
            lambda h: h["executor"].update(block_size="16"),
            "executor.block_size must be a positive integer, got '16'",
        ),
        (lambda h: h["model"].update(spec="gpt2"), "model.spec must be an object"),
        (lambda h: h["model"].update(spec={"name": "x"}), "model.spec is not a model shape"),
        (lambda h: h.update(executor=[1]), "executor must be an object"),
    ],
)
def test_bad_headers_are_one_line(tmp_path: Path, header_edit, needle) -> None:
    """Before: "spec": "gpt2" gave a TypeError, "block_size": "16" passed."""
    header = make_header("rose-run", model={"name": "gpt2", "spec": None}, executor=dict(EXECUTOR))
    header_edit(header)
    with pytest.raises(StepLogError) as err:
        load_step_log(write_log(tmp_path / "s.jsonl", header))
    assert f"{tmp_path / 's.jsonl'}:1: bad header: " in str(err.value) and needle in str(err.value)


def test_a_header_without_executor_is_one_line_at_rose_sim(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Before: KeyError: 'block_size'."""
    path = write_log(tmp_path / "s.jsonl", make_header("vllm", model={"name": "m", "spec": None}))
    assert load_calibration([path]).cost_model().step_time_s  # calibrating alone still works
    line = sim_error(monkeypatch, capsys, "--cost-model", str(path), "--model", "gpt2",
                     "--num-requests", "4")  # fmt: skip
    assert "records no executor block_size, num_kv_blocks, max_model_len" in line


def test_cost_model_from_a_device_file_is_refused_unread(monkeypatch, capsys) -> None:
    """Before: --cost-model /dev/zero read until MemoryError."""
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    with pytest.raises(ProfileError, match="/dev/zero: not a file"):
        load_calibration(["/dev/zero"])
    assert "/dev/zero: not a file" in sim_error(monkeypatch, capsys, "--cost-model", "/dev/zero")


def test_a_step_log_of_another_schema_says_so(tmp_path: Path) -> None:
    """Before: reported as "profile ... is not JSON"."""
    header = make_header("rose-run", executor=EXECUTOR)
    header["schema"] = "roseinfer-steplog/9"
    with pytest.raises(
        ProfileError, match="is JSON lines of schema 'roseinfer-steplog/9', neither"
    ):
        load_calibration([write_log(tmp_path / "s.jsonl", header)])


def test_a_deep_profile_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ProfileError, match="nests JSON too deep"):
        load_calibration([path])


def test_writer_output_still_loads(tmp_path: Path) -> None:
    header = make_header("rose-run", model={"name": "gpt2", "spec": None}, executor=EXECUTOR)
    with StepLogWriter(tmp_path / "s.jsonl", header) as writer:
        for row in steps():
            writer.write(StepRecord.from_json(row))
    assert len(load_step_log(tmp_path / "s.jsonl").records) == 12


# ------------------------------------------------------------ made-up token ids
def test_no_ids_are_made_up_for_a_request_beyond_any_context() -> None:
    """Before: a trace row ``0,2147483647,5`` with --fit-lengths off made rose-run
    build 2^31 token ids (16 GB) before the scheduler rejected the request."""
    from roseinfer import workloads

    huge = req(0, 2_147_483_647, 5)
    small, kept = workloads.with_token_ids([req(1, 4), huge], vocab_size=100, max_model_len=1024)
    assert len(small.prompt_token_ids) == 4 and kept is huge  # the scheduler rejects it
    with pytest.raises(workloads.WorkloadError, match="beyond any model's context"):
        workloads.with_token_ids([huge], vocab_size=100)
    fine = workloads.with_token_ids([req(1, 4)], vocab_size=100, max_model_len=1024)
    assert len(fine[0].prompt_token_ids) == 4


# ------------------------------------------------------------------ policy knobs
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--vtc-input-weight", "1e308", "--vtc-output-weight", "1e308"],
         "--vtc-input-weight must be <= 1e+06, got 1e+308"),
        (["--vtc-input-weight", "0", "--vtc-output-weight", "0"], "are both 0"),
    ],
)  # fmt: skip
def test_vtc_weights_cannot_overflow_into_fifo(monkeypatch, capsys, flags, needle) -> None:
    """Before: weights of 1e308 overflowed every counter to inf, so every tenant tied
    and vtc admitted as fifo (light tenant p99 TTFT 102,361 ms against 4,508)."""
    from roseinfer.interface import PolicyOptions
    from roseinfer.policies.fairness import MAX_VTC_WEIGHT, VirtualTokenCounter

    assert needle in sim_error(
        monkeypatch, capsys, "--policy", "vtc", *flags, "--num-requests", "4"
    )
    top = VirtualTokenCounter(PolicyOptions(vtc_input_weight=MAX_VTC_WEIGHT,
                                            vtc_output_weight=MAX_VTC_WEIGHT))  # fmt: skip
    assert top._weights == (MAX_VTC_WEIGHT, MAX_VTC_WEIGHT)
    assert MAX_VTC_WEIGHT * 2**63 < 1e300  # a counter stays finite for any run


# ------------------------------------------------------------------ sweep variants
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"policy": "pack", "lookahead": -5}, "lookahead = -5: --lookahead must be >= 1"),
        ({"policy": "pack", "lookahead": 0}, "--lookahead must be >= 1"),
        ({"policy": "pack", "lookahead": "many"}, "--lookahead takes an integer, got 'many'"),
        ({"policy": "pack", "lookahead": 1.5}, "--lookahead takes an integer"),
        ({"policy": "pack", "lookahead": True}, "--lookahead takes an integer"),
        ({"policy": "pack", "lookahead": [1]}, "--lookahead takes an integer"),
        ({"policy": "budget", "prefill_max_tokens": "many"},
         "prefill_max_tokens must be an integer or null, got 'many'"),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill must be true or false"),
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"options": {}}, "options cannot be set by a sweep variant"),
        ({"policy": "hrrn", "hrrn_decode_ms": 0.0}, "--hrrn-decode-ms"),
    ],
)  # fmt: skip
def test_grid_variants_are_checked_as_flags_before_anything_runs(monkeypatch, overrides, needle):
    """Before: lookahead = -5 (or "many", 0, 1.5, true, [1]) exited 0 at light load and
    failed under load as "a bug in that plugin"; prefill_max_tokens = "many" gave TypeError."""
    from roseinfer.calibration.cost_model import make_cost_model
    from roseinfer.config import SchedulerConfig
    from roseinfer.experiments import sweep

    monkeypatch.setattr(sweep, "map_points", lambda *a, **k: pytest.fail("a point ran"))
    with pytest.raises(ValueError) as err:
        sweep.run_grid([req(0, 8)], base=SchedulerConfig(num_kv_blocks=64),
                       cost_model=make_cost_model("llama-3.1-8b", "h100-sxm"),
                       variants={"ok": {"policy": "fifo"}, "bad": overrides}, backend="serial")  # fmt: skip
    message = str(err.value)
    assert message.startswith("variant 'bad': ") and needle in message and "\n" not in message


# ---------------------------------------------------------------------- tenants
def test_a_tenant_object_is_refused_naming_the_line(tmp_path: Path) -> None:
    """Before: {"a": 1} became the tenant "{'a': 1}"."""
    from roseinfer import workloads

    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2, "tenant": 7}\n'
                    '{"arrival_s": 1, "prompt_tokens": 4, "output_tokens": 2, "tenant": {"a": 1}}\n')  # fmt: skip
    with pytest.raises(
        workloads.WorkloadError, match=r"t.jsonl:2: tenant must be a string or an integer"
    ):
        workloads.load_trace(path)


def test_control_characters_in_a_tenant_never_reach_the_terminal(tmp_path: Path) -> None:
    """Before: an ANSI escape in a tenant was printed raw in the per-tenant table."""
    from roseinfer import workloads

    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival_s,prompt_tokens,output_tokens,tenant\n0,4,2,\x1b[31mred\x07\n")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2,
                                 "tenant": "a\x1b]0;title\x07b\u00e9\u4e2d"}) + "\n")  # fmt: skip
    assert workloads.load_trace(csv_path)[0].tenant == "\\x1b[31mred\\x07"
    assert workloads.load_trace(jsonl)[0].tenant == "a\\x1b]0;title\\x07b\u00e9\u4e2d"


def test_a_huge_tenant_is_shortened_in_tables(tmp_path: Path, monkeypatch, capsys) -> None:
    """Before: a 100k-character tenant printed 100k-character table lines."""
    from roseinfer.metrics.fairness import MAX_LABEL_CHARS, short_label

    big, other = "t" * 100_000, "t" * 99_999 + "u"
    assert len(short_label(big)) == MAX_LABEL_CHARS and short_label(big) != short_label(other)
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,tenant\n"
                    f"0,4,2,{big}\n0.1,4,2,{other}\n0.2,4,2,small\n")  # fmt: skip
    code, out, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, "--trace", str(path))
    assert code == 0, err
    assert "per tenant" in out and max(len(line) for line in out.splitlines()) < 300


@pytest.mark.parametrize(
    ("name", "text", "argv", "needle"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, ["--replica-config"], "cannot read --replica-config"),
        ("deep.toml", "a = " + "[" * 5_000 + "]" * 5_000 + "\n", ["sweep"], "cannot read grid"),
    ],
)  # fmt: skip
def test_deeply_nested_config_files_are_one_line(
    tmp_path, monkeypatch, capsys, name, text, argv, needle
):
    """Before: a 100,000-deep JSON --replica-config and a 5,000-deep sweep grid raised
    RecursionError. Under CPython's default recursion limit (1,000), which a module
    imported earlier in the session may have raised (the TOML case then parsed)."""
    path = tmp_path / name
    path.write_text(text)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        code, _, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, *argv, str(path))
    finally:
        sys.setrecursionlimit(limit)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert needle in lines[0]


def test_mass_rejection_warns_in_the_rose_sim_summary(monkeypatch, capsys) -> None:
    """Before: --max-model-len 100 rejected 1,997 of 2,000 requests, exited 0 and
    printed percentiles of 3 requests without a word."""
    code, out, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, "--max-model-len", "100",
                             "--num-requests", "50", "--fit-lengths", "off")  # fmt: skip
    assert code == 0, err
    assert "Latencies below cover:" in out and "completed requests only" in out
    assert "Warning: " in out and "of 50 requests" in out and "were rejected" in out
