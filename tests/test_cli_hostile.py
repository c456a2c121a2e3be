"""Hostile input to the CLIs (issue 18): each case below was accepted (a NaN, a
truncated float, a wrong type), echoed a file's content, printed a warning per
point, or had no cap. Each now ends with one ``prog: error:`` line, exit code 2
and no traceback. Also the flags that had two meanings (issue 18, item 5) and the
surface that was hidden (item 6)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from roseinfer.cli.sim import main as sim_main

ROOT = Path(__file__).resolve().parents[1]


def sim(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(sim_main, "rose-sim", monkeypatch, capsys, *args)


def one_error(code: int, err: str, prog: str = "rose-sim") -> str:
    """The single error line of a refused command."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ": warning: " not in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ------------------------------------------------------------- numbers and types
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-replicas", "2", "--router-staleness-s", "nan"], "--router-staleness-s"),
        (["--num-replicas", "2", "--router-staleness-s", "-1"], "--router-staleness-s"),
        (["--num-replicas", "2", "--router", "prefix-aware", "--router-arg", "load_weight=nan"],
         "load_weight"),
        (["--num-replicas", "2", "--router", "prefix-aware", "--router-arg", "load_weight=inf"],
         "load_weight"),
        (["--num-replicas", "2", "--router-arg", "load_wieght=0.5"], "load_wieght"),
        (["--num-replicas", "2", "--router", "prefix-aware", "--router-arg", "foo=1"], "foo"),
        (["--num-replicas", "100000"], "--num-replicas"),
        (["--num-prefill-replicas", "1", "--num-decode-replicas", "5000"], "--num-decode-replicas"),
        (["--policy", "vtc", "--vtc-output-weight", "inf"], "--vtc-output-weight"),
        (["--policy", "lpm", "--lpm-aging-s", "nan"], "--lpm-aging-s"),
        (["--policy", "sjf", "--length-predictor", "noisy-oracle",
          "--length-predictor-sigma", "-1"], "--length-predictor-sigma"),
    ],
)  # fmt: skip
def test_rose_sim_refuses_non_finite_and_unknown_values(monkeypatch, capsys, args, needle) -> None:
    code, _, err = sim(monkeypatch, capsys, *args, "--num-requests", "4", "--no-summary")
    assert needle in one_error(code, err)


def test_unknown_router_arg_was_ignored_before(monkeypatch, capsys) -> None:
    """A known key still works (and only the unknown one is named)."""
    code, _, err = sim(
        monkeypatch, capsys, "--num-replicas", "2", "--router", "prefix-aware",
        "--router-arg", "load_weight=0.5", "--num-requests", "4", "--no-summary",
    )  # fmt: skip
    assert code == 0, err


def test_capacity_refuses_nan_tolerance(monkeypatch, capsys) -> None:
    for flag, value in (("--tolerance", "nan"), ("--attainment", "inf"), ("--min-rate", "nan"),
                        ("--min-measured-requests", "0")):  # fmt: skip
        code, _, err = sim(monkeypatch, capsys, "capacity", "--goodput", "ttft:2000", flag, value)
        assert flag in one_error(code, err, "rose-sim capacity")


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("num_kv_blocks = 1.5", "num_kv_blocks must be an integer"),
        ('count = "2"', "count must be an integer"),
        ("count = 2.0", "count must be an integer"),
        ("count = 0", "count must be an integer"),
        ("count = 100000", "count must be an integer"),
        ("count = true", "count must be an integer"),
        ("tensor_parallel_size = 1.5", "tensor_parallel_size must be an integer"),
        ("hardware = 3", "hardware must be a string"),
        ('hardware = "h100-sxm"\ndevice = "h200"', "both hardware and device"),
    ],
)
def test_replica_config_values_are_typed(monkeypatch, capsys, tmp_path, entry, needle) -> None:
    path = tmp_path / "r.toml"
    path.write_text(f"[[replica]]\n{entry}\n\n[[replica]]\ncount = 1\n")
    code, _, err = sim(monkeypatch, capsys, "--replica-config", str(path), "--num-requests", "4")
    assert needle in one_error(code, err)


def test_replica_config_total_is_capped(monkeypatch, capsys, tmp_path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("[[replica]]\ncount = 3000\n\n[[replica]]\ncount = 3000\n")
    code, _, err = sim(monkeypatch, capsys, "--replica-config", str(path), "--num-requests", "4")
    assert "6000 replicas, more than 4096" in one_error(code, err)


def test_example_replica_config_runs(monkeypatch, capsys, tmp_path) -> None:
    """``examples/replicas.toml`` ships (the README names it) and loads."""
    out = tmp_path / "r.json"
    code, stdout, err = sim(
        monkeypatch, capsys, "--replica-config", str(ROOT / "examples" / "replicas.toml"),
        "--router", "least-loaded", "--num-requests", "40", "--save-result", str(out),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["num_replicas"] == 4
    names = [r["name"] for r in result["replica_summaries"]]
    assert names == ["h100", "h100", "a100-small-pool", "h200-tp2"]
    assert result["num_kv_blocks"][2] == 20000
    assert "h200-tp2" in stdout


# ------------------------------------------------------------------ grid caps
def test_grid_size_and_values_are_checked(monkeypatch, capsys, tmp_path) -> None:
    grid = tmp_path / "g.toml"
    rates = ", ".join(str(r) for r in range(1, 5001))
    grid.write_text(
        f"[base]\nnum_requests = 4\n[grid]\nrequest_rates = [{rates}]\nseeds = [0, 1, 2]\n"
        '[variants.fifo]\npolicy = "fifo"\n'
    )
    code, _, err = sim(monkeypatch, capsys, "sweep", str(grid), "--backend", "serial")
    assert "15000 points" in one_error(code, err, "rose-sim sweep")
    grid.write_text(
        '[base]\nnum_requests = 4\n[grid]\nrequest_rates = [nan]\n[variants.fifo]\npolicy = "fifo"\n'
    )
    code, _, err = sim(monkeypatch, capsys, "sweep", str(grid), "--backend", "serial")
    assert "request_rates" in one_error(code, err, "rose-sim sweep")
    grid.write_text(
        "[base]\nnum_requests = 4\n[grid]\nnum_replicas = [100000]\n"
        '[variants.fifo]\npolicy = "fifo"\n'
    )
    code, _, err = sim(monkeypatch, capsys, "sweep", str(grid), "--backend", "serial")
    assert "num_replicas" in one_error(code, err, "rose-sim sweep")
    grid.write_text(
        "[base]\nnum_requests = 4\n[grid]\nnum_replicas = [2]\n"
        '[variants.pa]\nrouter = "prefix-aware"\nrouter_args = { load_weight = "nan" }\n'
    )
    code, _, err = sim(monkeypatch, capsys, "sweep", str(grid), "--backend", "serial")
    assert "load_weight" in one_error(code, err, "rose-sim sweep")


# -------------------------------------------------------------- cost models
def _profile_doc() -> dict:
    from test_profiled import linear_price, make_profile, samples_from

    return make_profile(samples_from(linear_price, noise=0.02)).to_json()


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda d: d["fit"]["model"]["coefficients"].update(step=float("nan")),
            "coefficients.step",
        ),
        (lambda d: d["fit"]["model"]["coefficients"].update(step=-1.0), "coefficients.step"),
        (lambda d: d["executor"].update(num_kv_blocks=float("inf")), "executor.num_kv_blocks"),
        (lambda d: d["calibrated_roofline"]["device"].update(peak_flops=1e308), "peak_flops"),
        (lambda d: d["samples"][0].update(median_s=-42.0), "samples[0].median_s"),
        (lambda d: d["fit"].update(chosen="quadratic"), "fit.chosen"),
    ],
)
def test_damaged_cost_model_is_refused(monkeypatch, capsys, tmp_path, edit, needle) -> None:
    """Before: NaN, negative, inf and 1e308 gave null or negative results with exit 0,
    and an unknown ``fit.chosen`` was ignored."""
    doc = _profile_doc()
    edit(doc)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
    code, _, err = sim(monkeypatch, capsys, "--cost-model", str(path), "--num-requests", "4")
    assert needle in one_error(code, err)


def test_step_log_with_an_absurd_step_is_refused() -> None:
    from roseinfer.calibration.steplog import StepRecord

    with pytest.raises(ValueError, match="lasts"):
        StepRecord(step=0, start_s=0.0, end_s=1e308, forward_s=None, phase="mixed",
                   request_ids=("a",), num_new_tokens=(1,), num_context_tokens=(1,),
                   is_decode=(False,))  # fmt: skip


# -------------------------------------------------------------- other fronts
def test_profile_refuses_zero_batched_tokens(monkeypatch, capsys, tmp_path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.cli.run import main as run_main

    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--repetitions"):
        code, _, err = run_cli(
            run_main, "rose-run", monkeypatch, capsys, "profile", "--output",
            str(tmp_path / "p.json"), flag, "0",
        )  # fmt: skip
        assert flag in one_error(code, err, "rose-run profile")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("port", ["-1", "70000", "nan"])
def test_serve_refuses_a_bad_port_before_the_model(monkeypatch, capsys, port) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from roseinfer.cli import serve as serve_cli

    def no_model(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(serve_cli, "build_engine", no_model)
    code, _, err = run_cli(serve_cli.main, "rose-serve", monkeypatch, capsys, "--port", port)
    assert "--port" in one_error(code, err, "rose-serve")


def _broken_plugin(tmp_path: Path, monkeypatch) -> None:
    """An installed distribution whose ``roseinfer`` entry point cannot import."""
    dist = tmp_path / "site" / "hostile_broken-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[roseinfer]\nhostile = no_such_module_hostile\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()


def test_a_broken_plugin_is_reported_once(monkeypatch, capsys, tmp_path) -> None:
    """Before: a sweep or capacity search printed the warning once per registry load
    (several per run), as a Python ``RuntimeWarning`` with a source line."""
    _broken_plugin(tmp_path, monkeypatch)
    grid = tmp_path / "g.toml"
    grid.write_text(
        "[base]\nnum_requests = 4\n[grid]\nrequest_rates = [1, 2]\nnum_replicas = [1, 2]\n"
        '[variants.fifo]\npolicy = "fifo"\n[variants.budget]\npolicy = "budget"\n'
        "prefill_max_tokens = 512\n"
    )
    runs = {
        "rose-sim": ["--num-requests", "4", "--no-summary"],
        "rose-sim sweep": ["sweep", str(grid), "--backend", "serial", "--quiet", "--no-summary",
                           "--output", str(tmp_path / "g.csv")],
    }  # fmt: skip
    for prog, args in runs.items():
        code, _, err = sim(monkeypatch, capsys, *args)
        assert code == 0, err
        lines = [ln for ln in err.splitlines() if "no_such_module_hostile" in ln]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"{prog}: warning: skipped plugin entry point 'hostile'")
    # the CLI's sink does not outlive its run: a library load warns as before
    from roseinfer.registry import load_registry

    with pytest.warns(RuntimeWarning, match="hostile"):
        load_registry()


# ------------------------------------------------------- one meaning per flag
def test_hardware_flag_and_deprecated_device_alias(monkeypatch, capsys, tmp_path) -> None:
    out = tmp_path / "r.json"
    code, _, err = sim(monkeypatch, capsys, "--hardware", "a100-80gb", "--num-requests", "4",
                       "--no-summary", "--save-result", str(out))  # fmt: skip
    assert code == 0 and err == "", err
    assert json.loads(out.read_text())["device"] == "a100-80gb"
    code, _, err = sim(monkeypatch, capsys, "--device", "a100-80gb", "--num-requests", "4",
                       "--no-summary", "--save-result", str(out))  # fmt: skip
    assert code == 0
    assert err.strip() == (
        "rose-sim: warning: --device is deprecated here and goes in the next release; "
        "use --hardware"
    )
    assert json.loads(out.read_text())["device"] == "a100-80gb"


def test_quiet_keeps_the_summary_and_no_summary_drops_it(monkeypatch, capsys) -> None:
    code, out, _ = sim(monkeypatch, capsys, "--num-requests", "4", "--quiet")
    assert code == 0 and "Successful requests:" in out
    code, out, _ = sim(monkeypatch, capsys, "--num-requests", "4", "--no-progress")
    assert code == 0 and "Successful requests:" in out  # the same flag
    code, out, _ = sim(monkeypatch, capsys, "--num-requests", "4", "--no-summary")
    assert code == 0 and out == ""


def test_gpu_memory_utilization_means_the_same_everywhere() -> None:
    """One help text meaning: share of total device memory for weights + activations +
    KV, as vLLM (rose-run and rose-serve used the share of *free* memory for KV)."""
    pytest.importorskip("torch")
    from roseinfer.cli.run import build_parser as run_parser
    from roseinfer.cli.sim import build_parser as sim_parser

    for parser in (sim_parser(), run_parser()):
        action = next(a for a in parser._actions if a.dest == "gpu_memory_utilization")
        assert "total memory" in (action.help or ""), action.help
        assert "free memory" not in (action.help or "")


def test_gpu_memory_utilization_sizes_kv_from_total_memory(monkeypatch) -> None:
    """rose-run on CUDA: the memory planner sizes the KV pool from total x utilization
    less weights, profiled activations and graphs (its rule: tests/test_memory_planner.py,
    its wiring: tests/test_builder.py); size_kv_pool only hands it the share and the cap."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from roseinfer.executor import builder

    def no_reading(device=None):
        raise AssertionError("the pool is planned when the runner is built, not here")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_reading)
    loaded = SimpleNamespace(spec=SimpleNamespace(kv_bytes_per_token=1024),
                             device=torch.device("cuda", 0))  # fmt: skip
    pool = builder.KVPoolChoice(block_size=16, gpu_memory_utilization=0.9)
    size = builder.size_kv_pool(pool, loaded, 500)  # type: ignore[arg-type]
    assert size.planner_utilization == 0.9 and size.num_blocks == 500
    assert "--gpu-memory-utilization 0.9" in size.source


# ------------------------------------------------------------------- surface
def test_subcommands_appear_in_help(monkeypatch, capsys) -> None:
    code, out, _ = sim(monkeypatch, capsys, "--help")
    assert code == 0 and "rose-sim sweep" in out and "rose-sim capacity" in out
    assert "--no-summary" in out and "--hardware" in out
    pytest.importorskip("torch")
    from roseinfer.cli.run import main as run_main

    code, out, _ = run_cli(run_main, "rose-run", monkeypatch, capsys, "--help")
    assert code == 0 and "rose-run profile" in out
    assert "random weights of a built-in model" in " ".join(out.split())  # --seed's meanings


def test_serve_takes_every_policy_option_flag() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from roseinfer.cli.serve import build_parser as serve_parser

    serve_flags = {o for a in serve_parser()._actions for o in a.option_strings}
    sim_groups = {g.title: g for g in __import__("roseinfer.cli.sim", fromlist=["x"])
                  .build_parser()._action_groups}  # fmt: skip
    policy_flags = {
        o
        for title in ("policy", "policy options (declared by the plugins; see --list-policies)")
        for a in sim_groups[title]._group_actions
        for o in a.option_strings
    }
    assert policy_flags - serve_flags == set()
    for flag in ("--length-predictor", "--vtc-input-weight", "--lpm-aging-s", "--drop-late",
                 "--hrrn-decode-ms"):  # fmt: skip
        assert flag in serve_flags


def test_seed_004_prints_before_then_after() -> None:
    """``benchmarks/seed_experiments.py all`` printed 004 backwards once (1976 -> 7058)."""
    spec = importlib.util.spec_from_file_location(
        "seed_recipes", ROOT / "benchmarks" / "seed_recipes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("seed_recipes", module)
    spec.loader.exec_module(module)
    # 004-prefix: before = misses prefilled one request per step (the post's baseline),
    # after = one batched prefill; 004-prefix-shared: before = cache off, after = on
    serial, batched = module.SEED_EXPERIMENTS["004-prefix"].variants.values()
    assert serial["prefill_max_seqs"] == 1 and "prefill_max_seqs" not in batched
    off, on = module.SEED_EXPERIMENTS["004-prefix-shared"].variants.values()
    assert off["enable_prefix_caching"] is False and on["enable_prefix_caching"] is True
