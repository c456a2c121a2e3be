"""Regression tests for the defects a hostile-input review found (issue 10, item 4).

Each test names the defect it pins; before the fix each input ended in a
traceback, a silent fallback, a lost run or an invalid file.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from conftest import ToyCostModel, req, run_cli

from roseinfer import workloads as w
from roseinfer.cli.sim import main as sim_main
from roseinfer.config import SchedulerConfig
from roseinfer.interface import AdmissionPolicy, Phase, PolicyError
from roseinfer.metrics import write_records, write_result
from roseinfer.registry import Entry, Registry, load_registry, make_plugin_manager
from roseinfer.simulator.engine import simulate
from roseinfer.workloads import traces

PLAIN_HEADER = "arrival_s,prompt_tokens,output_tokens"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def jsonl(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def sim_error(monkeypatch, capsys, *args: str) -> str:
    """The one error line of a failing ``rose-sim`` run (exit code 2, no traceback)."""
    code, _, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("rose-sim: error: "), err
    return lines[0]


# ------------------------------------------------------------------ traces
def test_plain_jsonl_id_check_is_a_hash_lookup_not_a_list_scan() -> None:
    """Before: ``rid in ids`` on a list made plain JSONL loading quadratic (100k
    rows: 119 s). Equality calls count list scans; a hash lookup makes none."""

    class CountingStr(str):
        calls = 0

        def __eq__(self, other: object) -> bool:
            CountingStr.calls += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    ids = [CountingStr(f"r-{i}") for i in range(3000)]
    traces._check_unique_ids(Path("t.jsonl"), ids, list(range(1, 3001)))
    assert CountingStr.calls < 100  # a list scan makes ~4.5 million


def test_plain_jsonl_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    row = {"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}
    path = write(
        tmp_path, "d.jsonl", jsonl({**row, "request_id": "a"}, row, {**row, "request_id": "a"})
    )
    with pytest.raises(
        w.WorkloadError, match=r"d.jsonl:3: request_id 'a' is already used at line 1"
    ):
        w.load_trace(path)


def test_blank_request_id_cells_get_the_automatic_id(tmp_path: Path) -> None:
    """Before: two blank cells were 'duplicates'."""
    path = write(tmp_path, "b.csv", f"{PLAIN_HEADER},request_id\n0,3,2,\n1,3,2, \n2,3,2,x\n")
    assert [r.request_id for r in w.load_trace(path)] == ["b-0", "b-1", "x"]
    row = {"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}
    path = write(tmp_path, "j.jsonl", jsonl({**row, "request_id": ""}, {**row, "request_id": None}))
    assert [r.request_id for r in w.load_trace(path)] == ["j-0", "j-1"]


def test_an_id_colliding_with_an_automatic_id_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "c.csv", f"{PLAIN_HEADER},request_id\n0,3,2,c-1\n1,3,2,\n")
    with pytest.raises(
        w.WorkloadError, match=r"c.csv:3: request_id 'c-1' is already used at line 2"
    ):
        w.load_trace(path)
    row = {"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}
    path = write(tmp_path, "c.jsonl", jsonl(row, {**row, "request_id": "c-0"}))
    with pytest.raises(w.WorkloadError, match=r"c.jsonl:2: request_id 'c-0'"):
        w.load_trace(path)
    path = write(tmp_path, "l.jsonl", jsonl({**row, "request_id": [1]}))
    with pytest.raises(
        w.WorkloadError, match=r"l.jsonl:1: request_id must be a string or an integer"
    ):
        w.load_trace(path)


@pytest.mark.parametrize(
    "name, text, needle",
    [
        # JSON integers past float range: OverflowError before
        ("p.jsonl", '{"arrival_s": 0, "prompt_tokens": 1%s, "output_tokens": 2}\n' % ("0" * 400),
         "p.jsonl:1: prompt_tokens must be a positive integer (at most 2147483647)"),
        ("a.jsonl", '{"arrival_s": 1%s, "prompt_tokens": 2, "output_tokens": 2}\n' % ("0" * 400),
         "a.jsonl:1: arrival_s must be a finite number"),
        ("m.jsonl", '{"timestamp": 1%s, "input_length": 2, "output_length": 2, "hash_ids": [1]}\n'
         % ("0" * 400), "m.jsonl:1: timestamp must be a finite number"),
        # 5,000 digits: Python refuses to parse them (ValueError, not JSONDecodeError)
        ("x.jsonl", '{"arrival_s": 0, "prompt_tokens": 1%s, "output_tokens": 2}\n' % ("0" * 5000),
         "x.jsonl:1: unreadable JSON"),
        # 1e30 in CSV: int64 overflow without file:line before
        ("p.csv", f"{PLAIN_HEADER}\n0,2,2\n0,1e30,2\n", "p.csv:3: prompt_tokens must be at most"),
        ("q.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,4,99999999999999999999\n",
         "q.csv:2: GeneratedTokens must be at most"),
    ],
)  # fmt: skip
def test_huge_numbers_name_file_and_line(tmp_path: Path, name: str, text: str, needle: str) -> None:
    with pytest.raises(w.WorkloadError) as err:
        w.load_trace(write(tmp_path, name, text))
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("t.csv", f"{PLAIN_HEADER}\n1e308,2,2\n-1e308,2,2\n", "t.csv:2: arrival_s must be within 1e+09 s"),
        ("t.csv", f"{PLAIN_HEADER}\n0,2,2\n1e10,2,2\n", "t.csv:3: arrival_s must be within"),
        ("t.jsonl", jsonl({"arrival_s": -1e308, "prompt_tokens": 2, "output_tokens": 2},
                          {"arrival_s": 1e308, "prompt_tokens": 2, "output_tokens": 2}),
         "t.jsonl:2: arrival_s must be within"),
        ("m.jsonl", jsonl({"timestamp": 0, "input_length": 2, "output_length": 2, "hash_ids": [1]},
                          {"timestamp": 1e300, "input_length": 2, "output_length": 2, "hash_ids": [1]}),
         "m.jsonl:2: timestamp must be within"),
    ],
)  # fmt: skip
def test_extreme_timestamps_are_rejected_at_load(tmp_path: Path, name, text, needle) -> None:
    """Before: +-1e308 gave inf arrivals, and Infinity in --save-result."""
    with pytest.raises(w.WorkloadError) as err:
        w.load_trace(write(tmp_path, name, text))
    assert needle in str(err.value)


def test_result_json_is_strict_even_with_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_result({"a": math.inf, "b": -math.inf, "c": math.nan, "d": {"e": [math.inf, 1.5]}}, path)

    def reject(constant: str) -> None:
        raise AssertionError(f"non-JSON constant {constant} written")

    data = json.loads(path.read_text(), parse_constant=reject)
    assert data == {"a": None, "b": None, "c": None, "d": {"e": [None, 1.5]}}


def test_unrecognised_header_is_cut_in_the_message(tmp_path: Path) -> None:
    """Before: the whole first line (150 MB once) went to stderr."""
    path = write(tmp_path, "h.csv", "x" * 100_000 + "\n1,2\n")
    with pytest.raises(w.WorkloadError) as err:
        w.load_trace(path)
    assert len(str(err.value)) < 1000 and "x" * 50 not in str(err.value)


def test_non_trace_file_content_is_not_echoed(tmp_path: Path) -> None:
    """Before: ``--trace /etc/passwd`` printed the file's first line (issue 18)."""
    for name, first in (("p.csv", "root:x:0:0:secret-token:/root:/bin/bash"),
                        ("p.jsonl", '{"secret-token": 1}')):  # fmt: skip
        path = write(tmp_path, name, first + "\n")
        with pytest.raises(w.WorkloadError, match="unrecognised trace format") as err:
            w.load_trace(path)
        assert "secret-token" not in str(err.value)


def test_unreadable_trace_file_is_one_error(tmp_path: Path, monkeypatch) -> None:
    """Before: PermissionError traceback. (Faked: root reads any file.)"""
    path = write(tmp_path, "u.csv", f"{PLAIN_HEADER}\n0,2,2\n")
    real_open = Path.open

    def deny(self: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(
        w.WorkloadError, match=r"u.csv: cannot read the trace \(Permission denied\)"
    ):
        w.load_trace(path)


# ----------------------------------------------------------------- records
def test_records_csv_escapes_formula_cells_but_not_numbers(tmp_path: Path) -> None:
    records = pd.DataFrame(
        {
            "request_id": ['=HYPERLINK("x")', "+1", "-2", "@SUM(A1)", "ok"],
            "tenant": ["-t", None, "a", "b", "c"],
            "delta": [-1.5, -2.0, 0.0, 1.0, 2.0],
            "token_times_s": [[0.1], [0.2], [], [0.3, 0.4], [0.5]],
        }
    )
    path = tmp_path / "r.csv"
    write_records(records, path)
    back = pd.read_csv(path, keep_default_na=False)
    assert list(back.request_id) == ['\'=HYPERLINK("x")', "'+1", "'-2", "'@SUM(A1)", "ok"]
    assert list(back.tenant) == ["'-t", "", "a", "b", "c"]
    assert list(back.delta) == [-1.5, -2.0, 0.0, 1.0, 2.0]


# -------------------------------------------------------------- output paths
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--save-result", "{tmp}"], "--save-result {tmp}: is a directory"),
        (["--save-result", "{tmp}/file.txt/r.json"], "is a file, not a folder"),
        (["--save-records", "{tmp}/r.txt"], "unsupported extension '.txt'; use .csv or .parquet"),
        (["--save-result", "/proc/no/r.json"], "--save-result /proc/no/r.json: cannot be written"),
        (["--save-result", "{tmp}/same.csv", "--save-records", "{tmp}/same.csv"], "same file"),
    ],
)
def test_output_paths_are_checked_before_the_run(
    monkeypatch, capsys, tmp_path, flags, needle
) -> None:
    """Before: checked after the run (a typo lost it; .txt records failed after
    the result file was written)."""
    (tmp_path / "file.txt").write_text("")
    result = tmp_path / "ok.json"
    args = [f.format(tmp=tmp_path) for f in flags]
    if "--save-result" not in args:
        args += ["--save-result", str(result)]
    line = sim_error(monkeypatch, capsys, "--num-requests", "3", *args)
    assert needle.format(tmp=tmp_path) in line
    assert not result.exists()  # nothing was written: the run never started


# ------------------------------------------------------------------ plugins
class Crashing(AdmissionPolicy):
    """A plugin policy whose every hook raises (set ``crash_in``)."""

    name = "crashing"
    crash_in = ""

    def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
        if self.crash_in == "admit":
            raise KeyError("boom")
        return super().admit(waiting, budget, ctx)

    def order(self, ctx):  # type: ignore[no-untyped-def]
        if self.crash_in == "order":
            raise ZeroDivisionError("division by zero")
        return (Phase.PREFILL, Phase.DECODE)

    def select_victim(self, running, ctx):  # type: ignore[no-untyped-def]
        if self.crash_in == "select_victim":
            raise IndexError("list index out of range")
        return super().select_victim(running, ctx)


@pytest.mark.parametrize(
    "method, raised",
    [("admit", "KeyError"), ("order", "ZeroDivisionError"), ("select_victim", "IndexError")],
)
def test_an_exception_in_a_policy_hook_is_a_policy_error_naming_the_plugin(method, raised) -> None:
    """Before: a raw traceback, or a bare error line that read like a user mistake."""
    cls = type("Crash", (Crashing,), {"crash_in": method})
    base = load_registry()
    reg = Registry(dict(base.policies), dict(base.loop_orders), base.wrappers)
    reg.policies["crashing"] = Entry(cls, "rose-crash")
    reg.loop_orders["crashing"] = Entry(cls, "rose-crash")
    # 4 blocks of 4 tokens for 3 requests of 4 + 6 tokens: decodes must preempt.
    config = SchedulerConfig(num_kv_blocks=4, block_size=4, max_num_seqs=4, policy="crashing",
                             loop_order="crashing", max_model_len=16)  # fmt: skip
    requests = [req(i, 4, 6) for i in range(3)]
    with pytest.raises(PolicyError) as err:
        simulate(requests, config, ToyCostModel(), registry=reg)
    message = str(err.value)
    assert f"(plugin rose-crash) raised {raised}" in message and f"in {method}()" in message
    assert "a bug in that plugin" in message


BROKEN_IMPORT = "raise RuntimeError('plugin import exploded')\n"
BROKEN_HOOK = textwrap.dedent(
    """
    from roseinfer import hookimpl

    @hookimpl
    def register_admission_policies():
        raise ValueError("hook exploded")
    """
)


@pytest.fixture()
def broken_plugins(tmp_path: Path, monkeypatch) -> Path:
    """Two installed entry points: one whose module fails to import, one whose hook raises."""
    (tmp_path / "rose_bad_import.py").write_text(BROKEN_IMPORT)
    (tmp_path / "rose_bad_hook.py").write_text(BROKEN_HOOK)
    dist = tmp_path / "rose_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rose-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[roseinfer]\nbadimport = rose_bad_import\nbadhook = rose_bad_hook\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_broken_plugins_are_skipped_with_a_warning_naming_the_entry_point(broken_plugins) -> None:
    """Before: one broken package broke every run, --policy fifo and --list-policies included."""
    warnings: list[str] = []
    registry = load_registry(make_plugin_manager(warn=warnings.append), warn=warnings.append)
    assert "fifo" in registry.policies and "prefill-first" in registry.loop_orders
    assert any("'badimport'" in m and "plugin import exploded" in m for m in warnings), warnings
    assert any("'badhook'" in m and "hook exploded" in m for m in warnings), warnings


def test_cli_runs_fifo_and_lists_policies_beside_broken_plugins(
    broken_plugins, monkeypatch, capsys
) -> None:
    code, out, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, "--list-policies")
    assert code == 0 and "fifo" in out
    assert "rose-sim: warning: skipped plugin entry point 'badimport'" in err
    code, out, err = run_cli(
        sim_main, "rose-sim", monkeypatch, capsys, "--num-requests", "5", "--quiet"
    )
    assert code == 0 and "warning" in err and "Traceback" not in err


# -------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--num-kv-blocks", "0"], "argument --num-kv-blocks: must be an integer in [1, "),
        (["--max-model-len", "0"], "argument --max-model-len: must be an integer in [1, "),
        (["--kv-cache-memory-gb", "0"], "argument --kv-cache-memory-gb: must be a number in (0, "),
        (["--kv-cache-memory-gb", "nan"], "argument --kv-cache-memory-gb: must be a number in (0, "),
        # before: "cannot convert float NaN to integer", naming no flag
        (["--kv-cache-memory-gb", "1e308"], "argument --kv-cache-memory-gb: must be a number in (0, "),
        (["--gpu-memory-utilization", "nan"], "argument --gpu-memory-utilization: must be a number in (0, 1]"),
        (["--gpu-memory-utilization", "5"], "argument --gpu-memory-utilization: must be a number in (0, 1]"),
        (["--block-size", "1000000000"], "argument --block-size: must be an integer in [1, 4096]"),
        (["--block-size", "0"], "argument --block-size: must be an integer in [1, 4096]"),
        (["--num-kv-blocks", "100000000000"], "argument --num-kv-blocks: must be an integer in [1, 16777216]"),
        (["--kv-cache-memory-gb", "1e-9"], "--kv-cache-memory-gb leaves 1e-09 GiB for the KV cache, less than one block"),
        (["--kv-cache-memory-gb", "1e9"], "more than the 16777216 the block manager indexes"),
        (["--burstiness", "nan"], "argument --burstiness"),
        (["--seed", "-1"], "argument --seed"),
        (["--start-s", "nan"], "argument --start-s"),
    ],
)  # fmt: skip
def test_bad_memory_and_pool_flags_give_one_error_naming_the_flag(
    monkeypatch, capsys, flags, needle
) -> None:
    """Before: 0 fell back to defaults, a 1-block pool rejected everything with exit 0,
    NaN said 'cannot convert float NaN to integer', 10^11 blocks was a MemoryError."""
    line = sim_error(monkeypatch, capsys, "--num-requests", "3", *flags)
    assert needle in line


def test_unknown_policy_arg_key_is_an_error_listing_known_keys(monkeypatch, capsys) -> None:
    line = sim_error(monkeypatch, capsys, "--policy-arg", "lookahed=8", "--strict-options")
    assert "no plugin of this run reads 'lookahed'" in line and "policy 'fifo'" in line


def test_a_declared_policy_arg_is_accepted_and_others_listed() -> None:
    from roseinfer.cli.config import policy_options
    from roseinfer.cli.sim import build_parser
    from roseinfer.interface import PolicyOption

    specs = (PolicyOption("alpha", int, 1, "a knob"), PolicyOption("beta", str, "x", "another"))
    cls = type("Knobby", (AdmissionPolicy,), {"name": "knobby", "option_specs": specs})
    reg = load_registry()
    reg.policies["knobby"] = Entry(cls, "t")
    args = build_parser().parse_args(["--policy", "knobby", "--policy-arg", "alpha=2"])
    assert policy_options(args, reg).values == {"alpha": 2}
    args = build_parser().parse_args(
        ["--policy", "knobby", "--policy-arg", "gamma=2", "--strict-options"]
    )
    with pytest.raises(ValueError, match="reads: alpha, beta"):
        policy_options(args, reg)


def test_a_model_config_with_zero_heads_is_one_error(monkeypatch, capsys, tmp_path: Path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 0, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 128}  # fmt: skip
    path = write(tmp_path, "zero.json", json.dumps(config))
    line = sim_error(monkeypatch, capsys, "--model", str(path), "--num-requests", "3")
    assert "config key 'num_attention_heads' must be a positive integer, got 0" in line
    path = write(tmp_path, "list.json", "[1, 2]")
    assert "a model config is a JSON object" in sim_error(monkeypatch, capsys, "--model", str(path))


# ----------------------------------------------------------------- rose-run
def run_error(monkeypatch, capsys, *args: str) -> str:
    """The error line of a failing ``rose-run`` (exit 2, no traceback); transformers
    may print its own warnings before it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.cli.run import main as run_main

    code, _, err = run_cli(run_main, "rose-run", monkeypatch, capsys, *args)
    assert code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rose-run: error: "), err
    return last


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Path:
    """Saved tiny GPT-2 directories: good, weightless, broken config, bad weights,
    zero heads, and pickle-only weights."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.executor.models import build_model

    root = tmp_path_factory.mktemp("models")
    model, config, _ = build_model("tiny-gpt2", seed=0, dtype=torch.float32, device="cpu")
    model.save_pretrained(root / "good")
    config.save_pretrained(root / "weightless")
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    config.save_pretrained(root / "badweights")
    (root / "badweights" / "model.safetensors").write_bytes(b"garbage")
    model.save_pretrained(root / "zeroheads")
    data = json.loads((root / "zeroheads" / "config.json").read_text())
    (root / "zeroheads" / "config.json").write_text(json.dumps({**data, "n_head": 0}))
    config.save_pretrained(root / "pickle")
    torch.save(model.state_dict(), root / "pickle" / "pytorch_model.bin")
    return root


@pytest.mark.parametrize(
    "name, needle",
    [
        ("weightless", "cannot load the weights"),
        ("broken", "cannot load the config.json"),
        (
            "badweights",
            "cannot load the weights (model.safetensors or pytorch_model.bin) of --model",
        ),
        ("zeroheads", "model config num_attention_heads must be a positive integer, got 0"),
    ],
)
def test_rose_run_bad_model_directories_are_one_error(
    monkeypatch, capsys, model_dirs, name, needle
):
    """Before: OSError, SafetensorError and ZeroDivisionError tracebacks."""
    line = run_error(monkeypatch, capsys, "--model", str(model_dirs / name), "--device", "cpu",
                     "--num-requests", "2", "--quiet", "--no-progress")  # fmt: skip
    assert needle in line


def test_rose_run_loads_a_pickle_only_directory(monkeypatch, capsys, model_dirs, tmp_path) -> None:
    """pytorch_model.bin is read by transformers with ``weights_only`` loading."""
    from roseinfer.cli.run import main as run_main

    result = tmp_path / "r.json"
    code, _, err = run_cli(
        run_main, "rose-run", monkeypatch, capsys, "--model", str(model_dirs / "pickle"),
        "--device", "cpu", "--num-requests", "2", "--quiet", "--no-progress", "--no-warmup",
        "--attention-backend", "sdpa",
        "--workload", "synthetic", "--prompt-tokens", "8", "--output-tokens", "4",
        "--save-result", str(result),
    )  # fmt: skip
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(result.read_text())["completed"] == 2


@pytest.mark.parametrize("device", ["meta", "mps", "cuda:x"])
def test_rose_run_refuses_devices_the_runner_cannot_use(monkeypatch, capsys, device) -> None:
    line = run_error(monkeypatch, capsys, "--model", "tiny-gpt2", "--device", device)
    assert "use cpu or cuda[:N]" in line


def test_rose_run_checks_the_kv_pool_against_memory_first(monkeypatch, capsys) -> None:
    """Before: a pool too large for memory died inside torch's allocation."""
    pytest.importorskip("torch")
    from roseinfer.executor import builder

    monkeypatch.setattr(builder, "available_memory_bytes", lambda device: 2**20)
    line = run_error(monkeypatch, capsys, "--model", "tiny-gpt2", "--device", "cpu",
                     "--num-kv-blocks", "1000", "--num-requests", "2")  # fmt: skip
    # tiny-gpt2 fp32: 2 layers x (K, V) x 64 wide x 4 B = 1 KiB per token, 16 KiB per block
    assert "a KV pool of 1000 blocks needs 0.0153 GiB but cpu has 0.000977 GiB available" in line


def test_rose_run_checks_outputs_before_loading_the_model(monkeypatch, capsys, tmp_path) -> None:
    line = run_error(monkeypatch, capsys, "--model", "no-such-model", "--device", "cpu",
                     "--save-records", str(tmp_path / "r.txt"))  # fmt: skip
    assert "--save-records" in line and "unsupported extension '.txt'" in line


# ------------------------------------------------------------- block hashes
def test_executor_block_hashes_are_sha256_and_resist_a_builtin_collision() -> None:
    """Before: Python ``hash()`` on tuples (64-bit; CPython even maps -1 and -2 to
    the same hash), the class of vLLM's CVE-2025-25183."""
    from roseinfer.block_manager import (
        BlockManager,
        builtin_block_hash,
        compute_block_hashes,
        sha256_block_hash,
    )

    assert builtin_block_hash(0, (-1, 5)) == builtin_block_hash(0, (-2, 5))  # a real collision
    assert sha256_block_hash(0, (-1, 5)) != sha256_block_hash(0, (-2, 5))
    assert BlockManager(4, 4, True).block_hasher is sha256_block_hash
    assert SchedulerConfig(num_kv_blocks=4).prefix_caching_hash_algo == "sha256"
    a = req(0, 12, prompt_token_ids=tuple(range(12)))
    b = req(1, 12, prompt_token_ids=(*range(8), 99, 9, 10, 11))
    ha, hb = compute_block_hashes(a, 4), compute_block_hashes(b, 4)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # chained: equal prefixes, then apart
    assert all(0 <= h < 2**256 for h in ha) and max(ha) > 2**64
    assert ha[1] == sha256_block_hash(ha[0], range(4, 8))


def test_backends_record_their_hash_algo(monkeypatch, capsys, tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    code, _, err = run_cli(sim_main, "rose-sim", monkeypatch, capsys, "--num-requests", "3",
                           "--quiet", "--save-result", str(result))  # fmt: skip
    assert code == 0, err
    assert json.loads(result.read_text())["prefix_caching_hash_algo"] == "builtin"
    pytest.importorskip("torch")
    from roseinfer.cli.run import build_parser

    assert build_parser().parse_args([]).prefix_caching_hash_algo == "sha256"


def test_a_csv_row_wider_than_the_header_names_its_line(tmp_path: Path) -> None:
    """Found by tests/test_fuzz.py: pandas turned the extra leading cells of the first
    row into an index, and the line lookup raised TypeError."""
    path = write(tmp_path, "w.csv", f"{PLAIN_HEADER}\n0,2,2,9\n")
    with pytest.raises(
        w.WorkloadError, match=r"w.csv: not a valid CSV \(Expected 3 fields in line 2"
    ):
        w.load_trace(path)
    path = write(tmp_path, "d.csv", f"{PLAIN_HEADER},arrival_s\n0,2,2,1\n")
    with pytest.raises(
        w.WorkloadError, match=r"d.csv:1: column\(s\) arrival_s appear more than once"
    ):
        w.load_trace(path)


def test_sim_default_pool_with_the_parser_default_block_size() -> None:
    """benchmarks/sim_speed.py's child calls default_num_kv_blocks on parsed flags,
    whose block size is None until a setup fills it: that was a TypeError."""
    from roseinfer.calibration.specs import get_device_spec, get_model_spec
    from roseinfer.cli.sim import build_parser, kv_pool
    from roseinfer.simulator.setup import default_num_kv_blocks

    args = build_parser().parse_args([])
    model, device = get_model_spec("llama-3.1-8b"), get_device_spec("h100-sxm")
    args16 = build_parser().parse_args(["--block-size", "16"])
    assert default_num_kv_blocks(kv_pool(args), model, device) == default_num_kv_blocks(
        kv_pool(args16), model, device
    )
