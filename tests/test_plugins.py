"""Third-party plugins: found through the ``roseinfer`` entry-point group,
listed by ``--list-policies``, and run exactly like built-ins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest

from roseinfer import hookspecs
from roseinfer.registry import DEFAULT_PLUGINS, load_registry, make_plugin_manager

PLUGIN = textwrap.dedent(
    '''
    """A third-party policy: shortest prompt first, no token budget."""
    from roseinfer import hookimpl
    from roseinfer.interface import AdmissionPolicy


    class ShortestFirst(AdmissionPolicy):
        name = "shortest-first"
        description = "shortest prompt first (test plugin)"

        def admit(self, waiting, budget, ctx):
            ranked = sorted(waiting, key=lambda s: (s.num_prompt_tokens, s.arrival_time_s))
            return ranked[: budget.max_seqs]


    @hookimpl
    def register_admission_policies():
        return [ShortestFirst]
    '''
)


@pytest.fixture()
def plugin_path(tmp_path: Path) -> Path:
    """A module plus a dist-info that declares it in the ``roseinfer`` group."""
    (tmp_path / "rose_shortest.py").write_text(PLUGIN)
    dist = tmp_path / "rose_shortest-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rose-shortest\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[roseinfer]\nshortest = rose_shortest\n")
    return tmp_path


def _run(plugin_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{plugin_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, "-m", "roseinfer.cli.sim", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_entry_point_plugin_is_listed(plugin_path: Path) -> None:
    out = _run(plugin_path, "--list-policies")
    assert out.returncode == 0, out.stderr
    assert "shortest-first" in out.stdout
    assert "plugin: shortest" in out.stdout
    assert "pack" in out.stdout and "decode-first" in out.stdout and "force-fifo" in out.stdout


def test_entry_point_plugin_runs_in_the_simulator(plugin_path: Path, tmp_path: Path) -> None:
    result_file = tmp_path / "r.json"
    out = _run(
        plugin_path, "--policy", "shortest-first", "--num-requests", "200", "--quiet",
        "--save-result", str(result_file),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(result_file.read_text())
    assert result["completed"] == 200
    assert result["policy"].startswith("shortest-first")


def test_builtins_register_through_the_same_hooks() -> None:
    pm = make_plugin_manager(load_entry_points=False)
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert set(DEFAULT_PLUGINS) <= names
    registry = load_registry(pm)
    assert {"fifo", "budget", "pack"} <= set(registry.policies)
    assert {"prefill-first", "decode-first"} <= set(registry.loop_orders)
    assert {"force-fifo"} <= set(registry.wrappers)


def test_duplicate_names_are_an_error() -> None:
    pm = make_plugin_manager(load_entry_points=False)

    class Again:
        @hookspecs.hookimpl
        def register_admission_policies(self):  # type: ignore[no-untyped-def]
            from roseinfer.policies.admission import Fifo

            return [Fifo]

    pm.register(Again(), name="again")
    with pytest.raises(ValueError, match="both register 'fifo'"):
        load_registry(pm)


def test_every_hook_is_documented_and_implemented_by_a_builtin() -> None:
    pm = make_plugin_manager(load_entry_points=False)
    for name in ("register_admission_policies", "register_loop_orders", "register_policy_wrappers"):
        caller = getattr(pm.hook, name)
        assert caller.spec is not None and (caller.spec.function.__doc__ or "").strip()
        assert caller.get_hookimpls(), f"no built-in implements {name}"
    assert isinstance(pm, pluggy.PluginManager)
