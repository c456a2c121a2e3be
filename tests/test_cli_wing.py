"""The CLI wing: defects found by trying the commands as a new user would and with
hostile input, each pinned (the line it printed before is in the docstring)."""

from __future__ import annotations

import argparse
import importlib.machinery
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import run_cli

from roseinfer.cli.sim import main as sim_main
from roseinfer.interface import AdmissionPolicy
from roseinfer.registry import Entry, load_registry

ROOT = Path(__file__).resolve().parents[1]


def lines_of(err: str, prog: str, kind: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(f"{prog}: {kind}: ")]


def one_error(code: int, err: str, prog: str = "rose-sim") -> str:
    """The single ``prog: error:`` line of a refused command (warnings allowed)."""
    assert code == 2 and "Traceback" not in err, err
    errors = lines_of(err, prog, "error")
    assert len(errors) == 1, err
    return errors[0]


def sim(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(sim_main, "rose-sim", monkeypatch, capsys, *args)


def run_without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where ``modules`` cannot be imported."""
    blank = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    return subprocess.run(
        [sys.executable, "-c", f"import sys\n{blank}{code}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip


# ---------------------------------------------------- new user: no torch
def test_without_torch_rose_run_and_rose_serve_name_the_extra() -> None:
    """Before: ``rose-run --help`` and ``rose-serve`` ended in ModuleNotFoundError."""
    main = "from roseinfer.cli.{0} import main; sys.argv = {1!r}; raise SystemExit(main())"
    blocked = ("torch", "transformers")
    helped = run_without(blocked, main.format("run", ["rose-run", "--help"]))
    assert helped.returncode == 0 and "rose-run profile" in helped.stdout, helped.stderr
    for prog, extra in (("run", "executor"), ("serve", "serve")):
        proc = run_without(blocked, main.format(prog, [f"rose-{prog}", "--num-requests", "2"]
                                                if prog == "run" else ["rose-serve"]))  # fmt: skip
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"rose-{prog}: error: ") and f"roseinfer[{extra}]" in line


def test_a_bad_device_is_refused_before_torch_loads() -> None:
    """Before: ``rose-run --device tpu`` took 22-30 s (torch and transformers loaded
    first); now the flag is refused with torch unimportable."""
    code = (
        "from roseinfer.cli.run import main; sys.argv = ['rose-run', '--device', 'tpu']\n"
        "raise SystemExit(main())"
    )
    proc = run_without(("torch", "transformers"), code)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "rose-run: error: unknown --device 'tpu'; use cpu or cuda[:N]"
    )


def test_model_build_and_warm_up_say_what_happens(monkeypatch, capsys) -> None:
    """Before: silence until the first output (38.6 s for tiny-gpt2)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.cli.run import main as run_main

    args = ("--model", "tiny-gpt2", "--device", "cpu", "--num-requests", "2", "--no-summary",
            "--max-model-len", "64")  # fmt: skip
    code, _, err = run_cli(run_main, "rose-run", monkeypatch, capsys, *args)
    said = [ln for ln in err.splitlines() if ln.startswith("rose-run: ") and ln.endswith("...")]
    assert code == 0 and said == [
        "rose-run: loading tiny-gpt2 on cpu (float32)...",
        "rose-run: warming up with the largest step shapes...",
    ], err


# ------------------------------------------- new user: knobs of other policies
def test_a_knob_no_plugin_reads_warns_unless_strict(monkeypatch, capsys) -> None:
    """Before: ``--policy fifo --length-predictor oracle`` was an error, which broke a
    scripted comparison over one flag set."""
    flags = ("--policy", "fifo", "--length-predictor", "oracle", "--num-requests", "5")
    code, out, err = sim(monkeypatch, capsys, *flags, "--no-summary")
    (warning,) = lines_of(err, "rose-sim", "warning")
    assert code == 0 and "'length_predictor'" in warning and "--strict-options" in warning
    code, _, err = sim(monkeypatch, capsys, *flags, "--strict-options")
    assert "no plugin of this run reads 'length_predictor'" in one_error(code, err)
    code, _, err = sim(monkeypatch, capsys, "--policy", "pack", "--lookahead", "x")
    assert "--lookahead" in one_error(code, err)  # a bad value stays an error


def test_a_knob_given_twice_is_an_error(monkeypatch, capsys) -> None:
    """Before: ``--policy-arg lookahead=5 --lookahead 6`` silently used 5."""
    code, _, err = sim(monkeypatch, capsys, "--policy", "pack", "--policy-arg", "lookahead=5",
                       "--lookahead", "6")  # fmt: skip
    line = one_error(code, err)
    assert "'lookahead' is given twice" in line and "--lookahead" in line


def test_engine_owned_flags_list_every_scheduler_flag() -> None:
    """The embedding parser refuses the commands' scheduler flags by an explicit list
    (it read argparse's private ``_group_actions`` before): the list stays complete."""
    from roseinfer.cli.groups import add_scheduler_args
    from roseinfer.policy_args import ADMISSION_FLAGS, ENGINE_OWNED_FLAGS

    parser = argparse.ArgumentParser()
    add_scheduler_args(parser.add_argument_group("scheduler"))
    flags = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    assert flags - set(ADMISSION_FLAGS) == set(ENGINE_OWNED_FLAGS)


# ------------------------------------------------------- conflicting flags
def test_hardware_and_its_old_name_disagreeing_is_an_error(monkeypatch, capsys) -> None:
    """Before: ``--hardware h100-sxm --device a100-80gb`` silently used a100."""
    for order in (("--hardware", "h100-sxm", "--device", "a100-80gb"),
                  ("--device", "a100-80gb", "--hardware", "h100-sxm")):  # fmt: skip
        code, _, err = sim(monkeypatch, capsys, *order, "--num-requests", "4")
        line = one_error(code, err)
        assert "--hardware h100-sxm and --device a100-80gb disagree" in line


def test_burstiness_needs_a_request_rate(monkeypatch, capsys) -> None:
    """Before: ``--burstiness`` without ``--request-rate`` was silently ignored."""
    code, _, err = sim(monkeypatch, capsys, "--burstiness", "0.5", "--num-requests", "4")
    line = one_error(code, err)
    assert "--burstiness" in line and "--request-rate" in line
    code, _, _ = sim(monkeypatch, capsys, "--burstiness", "0.5", "--request-rate", "4",
                     "--num-requests", "4", "--no-summary")  # fmt: skip
    assert code == 0


def test_an_unknown_hardware_spec_is_named_as_one(monkeypatch, capsys) -> None:
    """Before: ``--hardware b200`` said ``unknown device``."""
    code, _, err = sim(monkeypatch, capsys, "--hardware", "b200")
    line = one_error(code, err)
    assert "unknown --hardware spec 'b200'" in line and "h100-sxm" in line


def test_a_pool_size_that_overflows_names_its_source() -> None:
    """Before: ``--kv-cache-memory-gb 1e308`` said "cannot convert float NaN to integer"."""
    from roseinfer.config import kv_blocks_from_bytes

    with pytest.raises(ValueError, match="--kv-cache-memory-gb gives inf bytes"):
        kv_blocks_from_bytes(1e308 * 2**30, 1024, 16)


# ------------------------------------------------------------ plugin faults
def test_a_policy_that_exits_gives_one_line_naming_it(monkeypatch, capsys) -> None:
    """Before: a policy raising SystemExit(3) made rose-sim exit 3 with no line."""

    class Exiting(AdmissionPolicy):
        name = "exiting"

        def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
            raise SystemExit(3)

    def registry(*args, **kwargs):  # type: ignore[no-untyped-def]
        reg = load_registry(*args, **kwargs)
        reg.policies["exiting"] = Entry(Exiting, "test_cli_wing")
        return reg

    monkeypatch.setattr("roseinfer.cli.flags.load_registry", registry)
    code, _, err = sim(monkeypatch, capsys, "--policy", "exiting", "--num-requests", "3")
    line = one_error(code, err)
    assert "policy 'exiting' (plugin test_cli_wing) raised SystemExit" in line


# ---------------------------------------------------------------- outputs
def test_outputs_in_a_missing_folder_are_refused_up_front(monkeypatch, capsys, tmp_path) -> None:
    """Before: the commands created missing folders (even at /) after the run, and
    rose-serve served, then wrote 0 records."""
    missing = tmp_path / "no" / "such"
    for flag, name in (("--save-result", "r.json"), ("--save-records", "r.csv"),
                       ("--save-steps", "s.jsonl")):  # fmt: skip
        code, _, err = sim(monkeypatch, capsys, flag, str(missing / name), "--num-requests", "3")
        assert f"folder {missing} does not exist" in one_error(code, err)
    assert not (tmp_path / "no").exists()
    pytest.importorskip("fastapi")
    pytest.importorskip("torch")
    from roseinfer.cli import serve

    args = serve.build_parser().parse_args(["--save-records", str(missing / "r.csv")])
    with pytest.raises(ValueError, match="does not exist"):
        serve.check_serve_args(args, load_registry())
    assert not (tmp_path / "no").exists()


def test_a_pool_that_holds_no_request_is_refused(monkeypatch, capsys) -> None:
    """Before: ``rose-serve --num-kv-blocks 1`` served a pool that holds no request
    (rose-serve and rose-run share the check; vLLM refuses to start then too)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.cli.run import main as run_main

    code, _, err = run_cli(run_main, "rose-run", monkeypatch, capsys, "--model", "tiny-gpt2",
                           "--device", "cpu", "--num-kv-blocks", "1", "--quiet")  # fmt: skip
    line = one_error(code, err, "rose-run")
    assert "holds 16 tokens, less than one request of max model length 256" in line
    assert "--max-model-len 16 or less" in line


def test_a_trace_spanning_hours_warns_before_the_model_loads(monkeypatch, capsys, tmp_path) -> None:
    """Before: rose-run waited in real time through a 1e9-s arrival gap, unannounced."""
    pytest.importorskip("torch")
    from roseinfer.cli.run import main as run_main

    trace = tmp_path / "gap.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,4,2\n1000000000,4,2\n")
    code, _, err = run_cli(run_main, "rose-run", monkeypatch, capsys, "--trace", str(trace),
                           "--model", "no-such-model", "--device", "cpu")  # fmt: skip
    (warning,) = lines_of(err, "rose-run", "warning")
    assert "1,000,000,000 s" in warning and "--request-rate" in warning and "--start-s" in warning
    assert "unknown model" in one_error(code, err, "rose-run")  # the warning came first


# ----------------------------------------------------------------- capacity
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--goodput", "ttft:1e308"], "longer than an hour"),
        (["--goodput", "ttft:2000", "--tolerance", "1e-9"], "--tolerance"),
        (["--goodput", "ttft:2000", "--min-duration-s", "1e308"], "--min-duration-s"),
        (["--goodput", "ttft:2000", "--min-measured-requests", "100000000"],
         "--min-measured-requests"),
    ],
)  # fmt: skip
def test_capacity_knobs_are_capped(monkeypatch, capsys, flags, named) -> None:
    """Before: each of these made ``rose-sim capacity`` run for hours."""
    code, _, err = sim(monkeypatch, capsys, "capacity", *flags, "--backend", "serial")
    assert named in one_error(code, err, "rose-sim capacity")


def test_capacity_says_its_plan_and_each_probe(monkeypatch, capsys) -> None:
    """Before: only ``sweep 0/1`` for minutes."""
    code, out, err = sim(monkeypatch, capsys, "capacity", "--goodput", "ttft:5000",
                         "--num-requests", "200", "--tolerance", "0.5", "--min-duration-s", "5",
                         "--min-measured-requests", "50", "--backend", "serial")  # fmt: skip
    assert code == 0, err
    said = [ln for ln in err.splitlines() if ln.startswith("rose-sim capacity: fifo: ")]
    assert "fluid estimate" in said[0] and "probes" in said[0] and "s wall" in said[0]
    probes = [ln for ln in said[1:] if " req/s " in ln]
    assert probes and all((" pass " in ln) or (" fail " in ln) for ln in probes)
    assert out.strip().splitlines()[-1].split()[-1] == str(len(probes))  # num_probes
    assert "sweep: 1 points, backend serial" in err


def test_capacity_num_requests_means_what_its_help_says() -> None:
    """Before: ``--help`` said "use the first N requests", the docstring "the fewest
    requests a probe simulates, not a cut of the trace"."""
    from roseinfer.cli.capacity import capacity_parser
    from roseinfer.experiments import capacity

    text = " ".join(capacity_parser().format_help().split())
    assert "fewest requests a probe simulates" in text and "first N requests" not in text
    assert "fewest requests a probe simulates" in " ".join((capacity.__doc__ or "").split())


def test_sweeps_say_which_backend_runs_and_keep_ray_quiet(monkeypatch, capsys) -> None:
    """Before: once Ray was installed, ``--backend auto`` moved sweeps onto it
    without a word, and its INFO lines filled notebooks. Ray itself is faked."""
    from roseinfer.experiments import sweep

    calls: dict = {}
    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    ray.is_initialized = lambda: False  # type: ignore[attr-defined]
    ray.init = lambda **kwargs: calls.update(kwargs)  # type: ignore[attr-defined]
    ray.put = lambda value: value  # type: ignore[attr-defined]
    ray.remote = lambda fn: types.SimpleNamespace(remote=fn)  # type: ignore[attr-defined]
    ray.wait = lambda pending, num_returns: (pending[:1], pending[1:])  # type: ignore[attr-defined]
    ray.get = lambda futures: futures  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    rows = sweep.map_points(lambda item, _: {"x": item}, [1, 2], None, "auto")  # type: ignore[arg-type]
    assert rows == [{"x": 1}, {"x": 2}]
    assert "sweep: 2 points, backend ray (a local Ray cluster)" in capsys.readouterr().err
    assert calls["log_to_driver"] is False and calls["logging_level"] == logging.WARNING


# ------------------------------------------------------------------ words
def test_help_and_readme_speak_of_the_project_only() -> None:
    """Before: "issue 8", "the issue's load", "the issue's first targets"."""
    import re

    from roseinfer.cli.capacity import capacity_parser
    from roseinfer.cli.run import build_parser as run_parser
    from roseinfer.cli.sim import build_parser as sim_parser
    from roseinfer.cli.sweep import sweep_parser

    texts = [p.format_help() for p in (sim_parser(), run_parser(), capacity_parser(),
                                       sweep_parser())]  # fmt: skip
    texts.append((ROOT / "README.md").read_text())
    for text in texts:
        assert not re.search(r"\bissue \d|\bissue's\b", text, re.IGNORECASE)


def test_a_bad_trace_suggests_the_flag(monkeypatch, capsys, tmp_path) -> None:
    """Before: a trace of no known format suggested ``pass fmt=`` (a function argument)."""
    trace = tmp_path / "t.csv"
    trace.write_text("foo,bar\n1,2\n")
    code, _, err = sim(monkeypatch, capsys, "--trace", str(trace))
    line = one_error(code, err)
    assert "--trace-format" in line and "fmt=" not in line


def test_the_tier_load_time_says_it_is_priced_not_measured() -> None:
    """Before: rose-run's summary printed "KV load time, priced" for a measured run."""
    from roseinfer.metrics import format_summary

    text = format_summary({"kv_hit_rate_device": 0.5, "kv_load_time_s": 1.5}, "t")
    assert "KV load time at tier bandwidth (s):" in text and "priced" not in text


def test_a_calibrated_header_says_what_prices_it(monkeypatch, capsys, tmp_path) -> None:
    """Before: the header said "(profiled)" for a calibrated roofline."""
    steps = tmp_path / "s.jsonl"
    code, _, err = sim(monkeypatch, capsys, "--num-requests", "60", "--no-summary",
                       "--save-steps", str(steps))  # fmt: skip
    assert code == 0, err
    code, out, err = sim(monkeypatch, capsys, "--cost-model", str(steps), "--num-requests", "5")
    assert code == 0 and "(fitted step times)" in out, err
    code, out, err = sim(monkeypatch, capsys, "--cost-model", str(steps), "--model", "gpt2",
                         "--num-requests", "5", "--num-kv-blocks", "2000")  # fmt: skip
    assert code == 0 and "(calibrated roofline)" in out and "(profiled)" not in out, err


def test_dev_extras_hold_what_the_readme_runs() -> None:
    """Before: ``jupyter nbconvert`` was not in ``[dev]`` although the README uses it."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("nbconvert") for req in dev["dev"])
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pytest -q -m "not slow"' in readme


# ----------------------------------------------------------------- library
def test_kv_tier_names_are_looked_up_in_the_registry_given() -> None:
    """The core loaded the global registry to resolve a tier policy name (an import
    circle registry -> hookspecs -> kv_tiers -> registry); now the caller's registry."""
    from roseinfer.kv_tiers import KVTierConfig, KVTierError, KVTierSpec, make_tiers

    config = KVTierConfig((KVTierSpec("t0", 4, 1e9, 1e9),), 4096, policy="arc")
    with pytest.raises(KVTierError, match="resolved"):
        make_tiers(config)
    registry = load_registry()
    (tier,) = make_tiers(config.resolved(registry))
    assert type(tier.policy) is registry.kv_tier_policy("arc")


def test_the_policy_flags_parse_without_a_command() -> None:
    """An engine embedding the policies parses the flags from the library, not the CLI."""
    from roseinfer.policy_args import PolicyArgsError, parse_policy_args

    parsed = parse_policy_args(["--policy", "pack", "--lookahead", "4"], load_registry(),
                               preset="vllm-v1")  # fmt: skip
    assert (parsed.policy, parsed.loop_order, parsed.options.values) == (
        "pack", "mixed", {"lookahead": 4})  # fmt: skip
    with pytest.raises(PolicyArgsError, match="--block-size sets vLLM's own scheduler"):
        parse_policy_args(["--block-size=32"], load_registry(), engine="vLLM")
    assert len(parsed) == 5  # a tuple: the bridge unpacks it
    with pytest.raises(PolicyArgsError, match="--force-fifo-every must be >= 0"):
        parse_policy_args(["--force-fifo-every", "-1"], load_registry())  # a wrapper's check


# ------------------------------------------- warnings that reach the user
def test_rose_sim_result_file_carries_the_extrapolation_of_a_fitted_cost_model(
    tmp_path, monkeypatch, capsys
) -> None:
    """Before: a cost model fitted on 32 small steps priced a long queue silently; the
    counts of steps priced outside its fit stayed inside the library."""
    import json

    from test_profiled import grid_shapes, linear_price, make_profile

    from roseinfer.calibration import ProfileSample

    small = [(k, s) for k, s in grid_shapes() if s.totals().num_seqs <= 8 and s.num_tokens <= 600]
    profile = tmp_path / "small.json"
    make_profile([ProfileSample(k, s, (linear_price(s),)) for k, s in small]).save(profile)
    result = tmp_path / "r.json"
    code, out, err = sim(monkeypatch, capsys, "--cost-model", str(profile), "--num-requests",
                         "64", "--request-rate", "inf", "--save-result", str(result))  # fmt: skip
    assert code == 0, err
    facts = json.loads(result.read_text())
    assert 0 < facts["cost_model_steps_outside_fit_share"] <= 1
    assert facts["cost_model_max_extrapolation"] > 1
    assert "were priced outside the step shapes" in out


def test_warnings_reach_stderr_when_the_summary_is_off(monkeypatch, capsys) -> None:
    """With --no-summary there is no table to carry the mass-rejection warning."""
    code, out, err = sim(monkeypatch, capsys, "--max-model-len", "100", "--num-requests", "50",
                         "--fit-lengths", "off", "--no-summary")  # fmt: skip
    assert code == 0 and out == "", err
    (warning,) = lines_of(err, "rose-sim", "warning")
    assert "of 50 requests" in warning and "were rejected" in warning and "most:" in warning


def test_capacity_grid_names_a_bad_variant_before_any_probe(tmp_path, monkeypatch, capsys):
    """Before: a grid variant ``lookahead = -5`` failed at its first probe (or, under
    load, as "a bug in that plugin"), without the variant's name."""
    grid = tmp_path / "grid.toml"
    grid.write_text('[variants.bad]\npolicy = "pack"\nlookahead = -5\n')
    code, _, err = sim(monkeypatch, capsys, "capacity", "--goodput", "ttft:2000", "--grid",
                       str(grid), "--backend", "serial")  # fmt: skip
    line = one_error(code, err, "rose-sim capacity")
    assert "variant 'bad'" in line and "lookahead" in line and "probe" not in err


# ------------------------------------------- new user: a model directory for vLLM
def test_save_model_writes_a_directory_transformers_loads_as_the_same_model(
    tmp_path, monkeypatch, capsys
) -> None:
    """Before: nothing said how to make a local MODEL directory for ``vllm serve MODEL``
    when no weights can be downloaded."""
    import torch

    from roseinfer.cli.run import main as run_main_
    from roseinfer.executor.models import build_model

    out = tmp_path / "tiny"
    code, _, err = run_cli(run_main_, "rose-run", monkeypatch, capsys, "save-model",
                           "--model", "tiny-gpt2", "--seed", "3", "--output", str(out))  # fmt: skip
    assert code == 0, err
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    saved, _, tokenizer = build_model(str(out), seed=0, dtype=torch.float32, device="cpu")
    fresh, _, _ = build_model("tiny-gpt2", seed=3, dtype=torch.float32, device="cpu")
    for (name, a), (_, b) in zip(saved.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert tokenizer is not None and tokenizer.encode("t5 t7") == [5, 7]


@pytest.mark.parametrize(
    ("setup", "argv", "named"),
    [
        ("file", ["--model", "tiny-gpt2"], "not an empty directory"),
        ("none", ["--model", "no-such-model"], "not a built-in model"),
        ("nested", ["--model", "tiny-gpt2"], "does not exist"),
    ],
)  # fmt: skip
def test_save_model_refuses_bad_outputs_in_one_line(tmp_path, monkeypatch, capsys, setup, argv,
                                                    named) -> None:  # fmt: skip
    from roseinfer.cli.run import main as run_main_

    out = {"file": tmp_path / "f", "none": tmp_path / "new", "nested": tmp_path / "a" / "b"}[setup]
    if setup == "file":
        out.write_text("x")
    code, _, err = run_cli(run_main_, "rose-run", monkeypatch, capsys, "save-model", *argv,
                           "--output", str(out))  # fmt: skip
    assert named in one_error(code, err, "rose-run save-model")
