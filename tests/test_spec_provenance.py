"""What a cost model stands on: device provenance, the fit of a built-in device's
constants to measured steps, and the source every cost model names (no torch)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from roseinfer.calibration import Profile, ProfileSample, load_profile
from roseinfer.calibration.cost_model import (
    BatchShape,
    RooflineCostModel,
    cost_model_source,
    make_cost_model,
)
from roseinfer.calibration.graph_replay import cuda_graph_batch_sizes
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.profile_grid import GridLimits, profile_grid
from roseinfer.calibration.roofline_fit import fit_device_constants
from roseinfer.calibration.specs import (
    DATASHEET_DEVICES,
    DEVICES,
    MEASURED,
    Measurement,
    ModelSpec,
    Provenance,
    get_model_spec,
    summarize_devices,
)
from roseinfer.calibration.steplog import StepLogWriter, StepRecord, make_header

H100 = DATASHEET_DEVICES["h100-sxm"]
# Made-up "true" constants the synthetic H100 steps are generated from.
TRUTH = dataclasses.replace(
    H100, mfu=0.47, bandwidth_efficiency=0.71, overhead_s=4.2e-3, kv_bandwidth_efficiency=0.55,
    overhead_per_seq_s=8e-6, eager_launch_s_per_layer=3e-4,
)  # fmt: skip
LIMITS = GridLimits(2048, 256, 8192, 300_000, 16, cuda_graph_batch_sizes(256))
# A 3B shape (Llama-3.2-3B's config) left out of the fit.
LLAMA_3B = ModelSpec(
    name="llama-3.2-3b", num_layers=28, hidden_size=3072, num_attention_heads=24,
    num_kv_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
    max_model_len=131072, gated_mlp=True, tied_embeddings=True,
)  # fmt: skip


def measured_steps(model: ModelSpec, noise: float, seed: int) -> list[ProfileSample]:
    """The profile grid's steps of ``model`` priced by the TRUTH roofline (x noise)."""
    rng = np.random.default_rng(seed)
    cost = RooflineCostModel(model, TRUTH)
    samples = []
    for kind, seqs in profile_grid(LIMITS, seed):
        prefills = [(n, c) for n, c in seqs if n > 1]
        shape = BatchShape([n for n, _ in prefills], [c for _, c in prefills],
                           [c for n, c in seqs if n == 1])  # fmt: skip
        times = cost.step_time_s(shape) * (1 + noise * rng.standard_normal(3))
        samples.append(ProfileSample(kind, shape, tuple(times)))
    return samples


def two_shapes(noise: float = 0.0) -> list[tuple[ModelSpec, list[ProfileSample]]]:
    return [(get_model_spec(name), measured_steps(get_model_spec(name), noise, seed))
            for seed, name in enumerate(("llama-3.1-8b", "qwen2.5-7b"))]  # fmt: skip


def test_every_builtin_device_says_what_it_stands_on():
    for name, spec in DEVICES.items():
        assert spec.provenance is not None, name
        measured = spec.name in MEASURED
        assert (spec.provenance.kind == "measured") == measured, name
        assert spec.peak_flops == DATASHEET_DEVICES[spec.name].peak_flops  # peaks stay
    assert DATASHEET_DEVICES["h100-sxm"].provenance.label() == "datasheet (unmeasured)"
    assert DATASHEET_DEVICES["cpu"].provenance.label() == "assumed (unmeasured)"
    summary = summarize_devices()
    assert "h100-sxm (h100): " in summary and summary.count(";") == 3


def test_a_measurement_names_its_device_and_error():
    with pytest.raises(ValueError, match="gpu, date, command"):
        Provenance(kind="measured", source="x.json")
    with pytest.raises(ValueError, match="kind"):
        Provenance(kind="guessed", source="")
    prov = Provenance(kind="measured", source="a.json", gpu="NVIDIA H100 80GB HBM3",
                      date="2026-11-30", command="fit", median_step_error=0.041)  # fmt: skip
    measured = Measurement(mfu=0.5, bandwidth_efficiency=0.75, overhead_s=4e-3, provenance=prov)
    spec = measured.apply(H100)
    assert (spec.peak_flops, spec.mfu, spec.overhead_s) == (H100.peak_flops, 0.5, 4e-3)
    source = cost_model_source(make_cost_model("llama-3.1-8b", spec))
    assert (
        source
        == "roofline h100-sxm, measured 2026-11 on NVIDIA H100 80GB HBM3, median step error 4.1%"
    )
    assert (
        cost_model_source(make_cost_model("gpt2", "a100"))
        == "roofline a100-80gb, datasheet (unmeasured)"
    )


def test_device_fit_recovers_known_constants_from_two_shapes():
    fit = fit_device_constants(H100, two_shapes(), [(LLAMA_3B, measured_steps(LLAMA_3B, 0, 9))])
    d = fit.device
    assert d.mfu == pytest.approx(0.47, rel=1e-3)
    assert d.bandwidth_efficiency == pytest.approx(0.71, rel=1e-3)
    assert d.overhead_s == pytest.approx(4.2e-3, rel=1e-3)
    assert d.kv_bandwidth_efficiency == pytest.approx(0.55, rel=1e-3)
    assert d.overhead_per_seq_s == pytest.approx(8e-6, rel=1e-3)
    assert d.eager_launch_s_per_layer == pytest.approx(3e-4, rel=1e-3)
    assert d.peak_flops == H100.peak_flops and fit.clamped == ()
    assert fit.held_out.median < 1e-3 and fit.checks["llama-3.2-3b"].median < 1e-3
    assert set(fit.per_model) == {"llama-3.1-8b", "qwen2.5-7b"}


def test_device_fit_with_noise_stays_close_and_records_a_measurement():
    fit = fit_device_constants(
        H100, two_shapes(noise=0.03), [(LLAMA_3B, measured_steps(LLAMA_3B, 0.03, 9))]
    )
    assert fit.device.mfu == pytest.approx(0.47, rel=0.03)
    assert fit.device.bandwidth_efficiency == pytest.approx(0.71, rel=0.03)
    assert fit.device.overhead_s == pytest.approx(4.2e-3, rel=0.05)
    assert 0.005 < fit.held_out.median < 0.03  # the noise, not a misfit
    m = fit.measurement(source="a.json b.json", gpu="GPU", driver="1", torch="2",
                        date="2026-11-30", command="fit")  # fmt: skip
    assert m.provenance.models == ("llama-3.1-8b", "qwen2.5-7b")
    assert m.provenance.check_model == "llama-3.2-3b" and m.provenance.num_steps > 600
    assert m.apply(H100).provenance.label().startswith("measured 2026-11 on GPU")


def test_a_term_no_step_was_bound_by_is_held_at_one():
    decodes = [(m, [s for s in steps if s.kind == "decode"]) for m, steps in two_shapes()]
    slow = dataclasses.replace(H100, peak_flops=1e12)  # a "peak" every fit exceeds
    fit = fit_device_constants(slow, decodes)
    assert "mfu" in fit.clamped and fit.device.mfu == 1.0


def steplog(path, records: list[StepRecord]) -> None:
    header = make_header("rose-run", model={"name": "gpt2", "spec": None})
    with StepLogWriter(path, header) as writer:
        for record in records:
            writer.write(record)


def test_calibrations_name_their_files(tmp_path):
    from test_profiled import linear_price, make_profile, samples_from

    profile: Profile = make_profile(samples_from(linear_price, noise=0.02))
    assert cost_model_source(profile.cost_model()).startswith("unsaved profile of gpt2")
    profile.save(tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    own = cost_model_source(loaded.cost_model())
    assert own.startswith(f"profile {tmp_path / 'p.json'}, held-out median step error ")
    other = cost_model_source(loaded.cost_model(get_model_spec("llama-3.1-8b")))
    assert other == f"calibrated roofline from profile {tmp_path / 'p.json'}"
    ends = np.cumsum([0.01 + 0.001 * (k % 3) for k in range(12)])
    records = [StepRecord(k, float(ends[k] - 0.01 - 0.001 * (k % 3)), float(ends[k]), None,
                          "decode", ("a", "b"), (1, 1), (10 + k, 20 + k), (True, True))
               for k in range(12)]  # fmt: skip
    steplog(tmp_path / "s.jsonl", records)
    pooled = load_calibration([tmp_path / "s.jsonl"])
    assert cost_model_source(pooled.cost_model()).startswith(
        f"step log {tmp_path / 's.jsonl'} (12 steps)"
    )


def test_rose_sim_names_its_cost_model_source(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "roseinfer.cli.sim", "--model", "gpt2", "--hardware",
           "a100", "--workload", "synthetic", "--num-requests", "4", "--save-result", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| roofline a100-80gb, datasheet (unmeasured) ==" in proc.stdout
    result = json.loads(out.read_text())
    assert result["cost_model_source"] == "roofline a100-80gb, datasheet (unmeasured)"
    helped = " ".join(
        subprocess.run(
            [*cmd[:3], "--help"], capture_output=True, text=True, timeout=60
        ).stdout.split()
    )
    assert "a100-80gb (a100): datasheet (unmeasured)" in helped
    assert "h100-sxm (h100): measured 2026-11 on NVIDIA H100 80GB HBM3" in helped


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "results"


@pytest.mark.skipif(not (RESULTS / "h100-2026-11-26").is_dir(), reason="no shipped H100 results")
def test_the_recorded_h100_constants_are_the_fit_of_the_shipped_profiles():
    """``MEASURED['h100-sxm']`` is what the fit gives on the profiles it names (so
    the constants can be re-derived, and a change to the fit shows here)."""
    sys.path.insert(0, str(RESULTS.parents[1]))
    from fit_device_spec import load_steps

    recorded = MEASURED["h100-sxm"]
    root = RESULTS.parents[2]
    sources = recorded.provenance.source.split()
    fitted, _ = load_steps([root / name for name in sources[:2]])
    logs = [root / name for name in sources if ".jsonl" in name]  # the served run's step log
    imbalance, _ = load_steps(logs)
    assert logs and recorded.decode_imbalance_s_per_token > 0
    fit = fit_device_constants(DATASHEET_DEVICES["h100-sxm"], fitted, imbalance_steps=imbalance)
    again = fit.measurement(**{k: getattr(recorded.provenance, k) for k in
                               ("source", "gpu", "driver", "torch", "date", "command")})  # fmt: skip
    assert again.provenance.models == recorded.provenance.models
    for name in ("mfu", "bandwidth_efficiency", "overhead_s", "kv_bandwidth_efficiency",
                 "overhead_per_seq_s", "eager_launch_s_per_layer",
                 "decode_imbalance_s_per_token"):  # fmt: skip
        assert getattr(again, name) == pytest.approx(getattr(recorded, name), rel=1e-3), name
    assert again.provenance.median_step_error == pytest.approx(
        recorded.provenance.median_step_error, abs=1e-3
    )


@pytest.mark.skipif(not (RESULTS / "h100-2026-11-26").is_dir(), reason="no shipped H100 results")
def test_the_recorded_h100_step_ratios_are_the_shipped_profiles_eager_repetitions():
    """``calibration/measured_jitter.json`` holds the eager repetitions of the
    profiles its entry names (the fitted ones), as ``fit_device_spec.py
    --write-specs`` writes them; the built-in spec carries them, the datasheet
    specs none; a rewrite replaces one device's entry and keeps the others."""
    import json

    sys.path.insert(0, str(RESULTS.parents[1]))
    from fit_device_spec import load_steps

    from roseinfer.calibration.roofline_fit import eager_step_ratios, replace_measured_jitter
    from roseinfer.calibration.specs import MEASURED_JITTER_FILE, get_device_spec

    doc = json.loads(MEASURED_JITTER_FILE.read_text())
    root = RESULTS.parents[2]
    sources = doc["h100-sxm"]["source"].split()
    assert sources == MEASURED["h100-sxm"].provenance.source.split()[:2]
    fitted, _ = load_steps([root / name for name in sources])
    ratios = eager_step_ratios([s for _, samples in fitted for s in samples])
    assert ratios == get_device_spec("h100-sxm").eager_step_ratios and len(ratios) > 100
    assert get_device_spec("a100").eager_step_ratios == ()
    again = replace_measured_jitter({"h200": {"eager": []}, **doc}, "h100-sxm", sources[0], ())
    assert list(again) == ["h200"]


def test_a_measurement_is_recorded_in_the_specs_source():
    from pathlib import Path

    from roseinfer.calibration import specs
    from roseinfer.calibration.roofline_fit import measured_source, replace_measured_block

    fit = fit_device_constants(H100, two_shapes())
    entry = fit.measurement(source="a.json b.json", gpu="NVIDIA H100 80GB HBM3", driver="580.1",
                            torch="2.13.0+cu130", date="2026-11-30", command="bash fit.sh")  # fmt: skip
    text = Path(specs.__file__).read_text()
    assert measured_source(MEASURED) in text  # the block as it stands
    updated = replace_measured_block(text, {"h100-sxm": entry})
    assert updated.count("# BEGIN MEASURED") == 1 and updated.count("# END MEASURED") == 1
    namespace = {"Measurement": Measurement, "Provenance": Provenance}
    exec(measured_source({"h100-sxm": entry}), namespace)
    assert namespace["MEASURED"] == {"h100-sxm": entry}
    compile(updated, "specs.py", "exec")
    with pytest.raises(ValueError, match="BEGIN MEASURED"):
        replace_measured_block("x = 1\n", {})


def test_fit_script_reads_profiles_of_two_shapes_and_a_check(tmp_path):
    from pathlib import Path

    executor = {"device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 1000, "block_size": 16,
                "kv_cache_bytes": 1, "max_model_len": 8192, "max_num_seqs": 256}  # fmt: skip
    shapes = [*two_shapes(noise=0.01), (LLAMA_3B, measured_steps(LLAMA_3B, 0.01, 9))]
    paths = []
    for model, steps in shapes:
        environment = {"torch": "2.13.0+cu130", "cuda_device": "NVIDIA H100 80GB HBM3"}
        Profile.create(model_name=model.name, model_spec=model, executor=executor,
                       environment=environment, samples=steps).save(tmp_path / f"{model.name}.json")  # fmt: skip
        paths.append(str(tmp_path / f"{model.name}.json"))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_device_spec.py"
    cmd = [sys.executable, str(script), "--device", "h100-sxm", "--fit", *paths[:2], "--check",
           paths[2], "--driver", "580.65", "--output", str(tmp_path / "fit.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "check (not fitted) llama-3.2-3b" in proc.stdout
    prov = json.loads((tmp_path / "fit.json").read_text())["measurement"]["provenance"]
    assert (prov["gpu"], prov["driver"], prov["torch"]) == ("NVIDIA H100 80GB HBM3", "580.65",
                                                            "2.13.0+cu130")  # fmt: skip
    assert prov["models"] == ["llama-3.1-8b", "qwen2.5-7b"] and prov["median_step_error"] < 0.02
    one = subprocess.run([*cmd[:4], "--fit", paths[0]], capture_output=True, text=True, timeout=300)
    assert one.returncode == 2 and "two model shapes" in one.stderr
