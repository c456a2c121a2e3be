"""Step logs: the schema, writing them from both backends, calibrating from them
(``rose-sim --cost-model STEPLOG``, alone or pooled with a profile), and the one
rule both backends fit a workload by."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from roseinfer.calibration.profile import load_calibration, step_samples
from roseinfer.calibration.steplog import (
    STEP_LOG_SCHEMA,
    StepLogError,
    StepLogWriter,
    StepRecord,
    is_step_log,
    load_step_log,
    make_header,
    records_of,
)
from roseinfer.cli import sim as sim_cli


def record(k: int, start: float, dur: float, decodes: int, prefill: int = 0) -> StepRecord:
    ids = tuple(f"r{i}" for i in range(decodes + (1 if prefill else 0)))
    new = (1,) * decodes + ((prefill,) if prefill else ())
    ctx = tuple(50 + i for i in range(decodes)) + ((prefill,) if prefill else ())
    kind = (True,) * decodes + ((False,) if prefill else ())
    return StepRecord(k, start, start + dur, dur * 0.9, "mixed", ids, new, ctx, kind)


def write_log(path, records, **executor):  # type: ignore[no-untyped-def]
    header = make_header("test", model={"name": "x", "spec": None},
                         executor={"num_kv_blocks": 64, "block_size": 16, "max_model_len": 512,
                                   "max_num_seqs": 8, **executor})  # fmt: skip
    with StepLogWriter(path, header, flush_every=3) as w:
        for r in records:
            w.write(r)


def true_cost_s(num_seqs: int, num_tokens: int) -> float:
    """The synthetic device: 2 ms per step + 1 ms per sequence + 20 us per token."""
    return 2e-3 + 1e-3 * num_seqs + 2e-5 * num_tokens


def synthetic_steps(n: int = 60) -> list[StepRecord]:
    """Steps priced by :func:`true_cost_s`."""
    rng = np.random.default_rng(0)
    out, t = [], 0.0
    for k in range(n):
        decodes = int(rng.integers(1, 6))
        prefill = int(rng.integers(8, 600)) if rng.random() < 0.5 else 0
        dur = true_cost_s(decodes + (1 if prefill else 0), decodes + prefill)
        out.append(record(k, t, dur, decodes, prefill))
        t += dur
    return out


def test_records_round_trip_and_derive_host_time(tmp_path):
    steps = synthetic_steps(7)
    write_log(tmp_path / "s.jsonl", steps)
    log = load_step_log(tmp_path / "s.jsonl")
    assert log.header["schema"] == STEP_LOG_SCHEMA and is_step_log(tmp_path / "s.jsonl")
    assert log.records == steps
    row = json.loads((tmp_path / "s.jsonl").read_text().splitlines()[1])
    assert row["host_s"] == pytest.approx(row["end_s"] - row["start_s"] - row["forward_s"])
    assert steps[0].shape.num_seqs == steps[0].num_seqs
    assert log.durations_s() == pytest.approx([s.duration_s for s in steps])


def test_a_gzipped_log_reads_as_the_plain_one(tmp_path):
    """Step logs are large (6.6 MB for a 500-request GPU run); kept gzipped, they
    load and calibrate as they are."""
    import gzip

    steps = synthetic_steps(12)
    write_log(tmp_path / "s.jsonl", steps)
    (tmp_path / "s.jsonl.gz").write_bytes(gzip.compress((tmp_path / "s.jsonl").read_bytes()))
    assert is_step_log(tmp_path / "s.jsonl.gz")
    assert load_step_log(tmp_path / "s.jsonl.gz").records == steps
    assert len(load_calibration([tmp_path / "s.jsonl.gz"]).samples) == 12
    (tmp_path / "bad.jsonl.gz").write_bytes(b"\x1f\x8b not gzip")
    assert not is_step_log(tmp_path / "bad.jsonl.gz")
    with pytest.raises(StepLogError, match="cannot read step log"):
        load_step_log(tmp_path / "bad.jsonl.gz")


def test_multi_step_outputs_become_one_record_per_step():
    recs = records_of([("a", 9, 1, True), ("b", 3, 1, True)], first_step=5, start_s=1.0,
                      end_times_s=[1.1, 1.25, 1.3], forward_s=None, phase="decode")  # fmt: skip
    assert [r.step for r in recs] == [5, 6, 7]
    assert [r.num_context_tokens for r in recs] == [(10, 4), (11, 5), (12, 6)]
    assert [r.start_s for r in recs] == [1.0, 1.1, 1.25]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "not a roseinfer step log"),
        ('{"schema": "other"}\n', "not a roseinfer step log"),
        (json.dumps({"schema": STEP_LOG_SCHEMA}) + "\n", "holds no steps"),
        (json.dumps({"schema": STEP_LOG_SCHEMA}) + "\n[1, 2]\n", r"s.jsonl:2: bad step"),
        (json.dumps({"schema": STEP_LOG_SCHEMA}) + '\n{"step": 0}\n', r":2: bad step: missing"),
    ],
)
def test_bad_logs_name_the_line(tmp_path, text, match):
    (tmp_path / "s.jsonl").write_text(text)
    with pytest.raises(StepLogError, match=match):
        load_step_log(tmp_path / "s.jsonl")


def test_a_step_with_end_before_start_is_refused():
    with pytest.raises(ValueError, match="end_s"):
        StepRecord(0, 1.0, 0.5, None, "", ("a",), (1,), (3,), (True,))


def test_calibration_from_a_log_fits_its_steps_and_keeps_the_setup(tmp_path):
    write_log(tmp_path / "s.jsonl", synthetic_steps(), fit_lengths="scale")
    profile = load_calibration([tmp_path / "s.jsonl"])
    assert profile.model_spec is None and profile.roofline is None
    assert profile.fit_lengths == "scale"
    assert profile.scheduler_defaults()["num_kv_blocks"] == 64
    cost = profile.cost_model()
    for s in synthetic_steps()[:10]:
        assert cost.step_time_s(s.shape) == pytest.approx(s.duration_s, rel=0.02)
    held_out = profile.step_fit.held_out[profile.step_fit.model.name]
    assert held_out.num_samples == 12 and held_out.median < 0.02
    assert profile.step_fit.used == "interp" == profile.step_fit.model.name  # a step log's model


def test_rose_sim_needs_a_model_shape_for_an_engine_log(tmp_path, monkeypatch, capsys):
    write_log(tmp_path / "s.jsonl", synthetic_steps())
    code, _, err = run_cli(sim_cli.main, "rose-sim", monkeypatch, capsys,
                           "--cost-model", str(tmp_path / "s.jsonl"), "--num-requests", "5")  # fmt: skip
    assert code == 2 and "records no model shape; name it with --model" in err


def test_rose_sim_calibrates_from_a_log_and_writes_its_own(tmp_path, monkeypatch, capsys):
    write_log(tmp_path / "s.jsonl", synthetic_steps())
    code, out, err = run_cli(
        sim_cli.main, "rose-sim", monkeypatch, capsys, "--cost-model", str(tmp_path / "s.jsonl"),
        "--model", "gpt2", "--num-requests", "6", "--max-model-len", "400", "--quiet",
        "--save-result", str(tmp_path / "r.json"), "--save-steps", str(tmp_path / "sim.jsonl"),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["cost_model_kind"] == "profiled" and "s.jsonl" in result["cost_model_file"]
    assert (
        result["fit_lengths"].startswith("all 6 requests fit") or "clipped" in result["fit_lengths"]
    )
    sim = load_step_log(tmp_path / "sim.jsonl")
    assert sim.header["backend"] == "rose-sim" and len(sim.records) == result["num_steps"]
    # every simulated step is priced by the log's fit of the synthetic device
    for r in sim.records:
        assert r.duration_s == pytest.approx(true_cost_s(r.num_seqs, sum(r.num_new_tokens)),
                                             rel=0.05)  # fmt: skip


def test_a_profile_and_logs_are_pooled(tmp_path):
    from roseinfer.calibration import Profile, ProfileSample
    from roseinfer.calibration.cost_model import BatchShape
    from roseinfer.calibration.specs import get_model_spec

    samples = [
        ProfileSample("decode", BatchShape.decode([64] * b), (2e-3 + 1e-3 * b,))
        for b in range(1, 13)
    ]
    executor = {"num_kv_blocks": 32, "block_size": 16, "max_model_len": 256,
                "kv_cache_bytes": 1 << 20, "max_num_seqs": 8}  # fmt: skip
    Profile.create(model_name="tiny-gpt2", model_spec=get_model_spec("gpt2"), executor=executor,
                   environment={}, samples=samples).save(tmp_path / "p.json")  # fmt: skip
    write_log(tmp_path / "s.jsonl", synthetic_steps())
    pooled = load_calibration([tmp_path / "p.json", tmp_path / "s.jsonl"])
    assert len(pooled.samples) == 12 + len(step_samples(load_step_log(tmp_path / "s.jsonl")))
    assert pooled.executor["num_kv_blocks"] == 32  # the profile's setup
    assert pooled.roofline is not None  # the profile gave a model shape
    assert [s["kind"] for s in pooled.extra["sources"]] == ["profile", "step log"]
