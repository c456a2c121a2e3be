"""``rose-sim``: replay a workload through the shared scheduler with a cost model.

Example::

    rose-sim --policy pack --prefill-max-tokens 256 --force-fifo-every 8
    rose-sim --policy budget --prefill-max-tokens 2048 \\
        --trace AzureLLMInferenceTrace_conv.csv --model llama-3.1-8b --hardware h100-sxm
    rose-sim --num-replicas 8 --router prefix-aware --trace synthetic_trace.jsonl
    rose-sim sweep grid.toml --backend ray
    rose-sim capacity --goodput ttft:2000 tpot:100 --policy budget --prefill-max-tokens 2048

``rose-sim sweep`` and ``rose-sim capacity`` are :mod:`roseinfer.cli.sweep` and
:mod:`roseinfer.cli.capacity`; a cluster run is :mod:`roseinfer.cli.cluster`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from roseinfer import _core
from roseinfer.calibration.cost_model import cost_model_source
from roseinfer.cli.cluster import replica_specs, run_cluster, wants_cluster
from roseinfer.cli.config import (
    check_args,
    config_facts,
    policy_facts,
)
from roseinfer.cli.flags import (
    run_main,
)
from roseinfer.cli.report import report
from roseinfer.cli.sim_flags import build_parser, kv_pool, run_config, setup_of
from roseinfer.cli.workload import build_workload, fit_workload
from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.kv_tiers import kv_tier_summary
from roseinfer.metrics.lazy import tqdm
from roseinfer.registry import Registry
from roseinfer.sequence import Sequence
from roseinfer.simulator.engine import simulate
from roseinfer.simulator.setup import (
    SimSetup,
)

if TYPE_CHECKING:
    from roseinfer.calibration.steplog import StepRecorder


def _run(args: argparse.Namespace, registry: Registry, options: PolicyOptions) -> None:
    requests, workload_name = build_workload(args)
    setup = setup_of(args)
    max_model_len = args.max_model_len or setup.max_model_len
    requests, fit_note = fit_workload(args, requests, max_model_len, default=setup.fit_lengths)
    config = run_config(args, registry, options, setup)
    facts = {"backend": "sim", "workload": workload_name, **setup.extra}
    if wants_cluster(args):
        specs = replica_specs(args, config, setup, kv_pool(args))
        title = f"rose-sim: {config.policy} | {workload_name}"
        run_cluster(args, registry, requests, specs, title=title, extra=facts)
        return
    recorder = _step_recorder(args, setup, config)
    try:
        with _progress(len(requests), quiet=args.quiet) as on_ended:
            result = simulate(
                requests, config, setup.cost_model, registry=registry, jump=not args.no_jump,
                keep_token_times=args.save_records is not None, on_ended=on_ended,
                on_step=recorder,
            )  # fmt: skip
    finally:
        if recorder is not None and recorder.writer is not None:
            recorder.writer.close()
    extra = {
        **facts, "policy": result.policy, "model": setup.model.name, "device": setup.device_name,
        "cost_model": setup.cost_model.describe(), "cost_model_kind": setup.cost_model.name,
        "fit_lengths": fit_note, "scheduler_preset": args.scheduler_preset or "seeds",
        **config_facts(config), **policy_facts(config, registry), "sim_wall_s": result.wall_s,
        "num_steps": result.num_steps,
        **kv_tier_summary([result.scheduler.block_manager.kv_tier_counters()]),
        **{k: v for k, v in result.info.items() if k != "cost_model"},  # extrapolation counts
    }  # fmt: skip
    title = (
        f"rose-sim: {result.policy} | {workload_name} | {setup.model.name} on {setup.device_name}"
        f" | {cost_model_source(setup.cost_model)}"
    )
    report(args, result.columns, duration_s=result.duration_s, title=title, extra=extra,
           itl=result.itl)  # fmt: skip
    if not args.no_summary:
        core = "" if _core.COMPILED else f" ({_core.core_info()})"
        print(
            f"simulated {len(requests)} requests, {result.num_steps} steps "
            f"in {result.wall_s:.2f} s wall{core}"
        )


def _step_recorder(
    args: argparse.Namespace, setup: SimSetup, config: SchedulerConfig
) -> StepRecorder | None:
    """``--save-steps``: a step log of the simulated steps, in the schema real runs write."""
    if args.save_steps is None:
        return None
    from roseinfer.calibration.steplog import StepLogWriter, StepRecorder, make_header

    header = make_header(
        "rose-sim",
        model={"name": setup.model.name, "spec": dataclasses.asdict(setup.model)},
        executor={
            "device": setup.device_name,
            "cost_model": setup.cost_model.describe(),
            **{
                k: getattr(config, k)
                for k in (
                    "num_kv_blocks",
                    "block_size",
                    "max_model_len",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                )
            },
            "fit_lengths": args.fit_lengths or setup.fit_lengths,
        },  # fmt: skip
        scheduler=config_facts(config),
    )
    return StepRecorder(StepLogWriter(args.save_steps, header))


@contextlib.contextmanager
def _progress(num_requests: int, *, quiet: bool) -> Iterator[Callable[[list[Sequence]], None]]:
    """A progress bar on stderr (requests ended, simulated time) that appears
    only when a run lasts more than 2 s wall; none with ``--quiet``."""
    if quiet:  # not even tqdm's import (40 ms)
        yield lambda seqs: None
        return
    with tqdm.tqdm(
        total=num_requests, desc="simulating", unit="req", disable=quiet, delay=2.0,
        file=sys.stderr, mininterval=0.5,
    ) as bar:  # fmt: skip

        def on_ended(seqs: list[Sequence]) -> None:
            bar.update(len(seqs))
            last = seqs[-1].finish_s
            if last is not None and bar.n % 512 < len(seqs):
                bar.set_postfix_str(f"sim time {last:,.0f} s", refresh=False)

        yield on_ended


def main() -> int:
    """Entry point of ``rose-sim`` (``rose-sim sweep ...`` and ``rose-sim capacity ...``
    are subcommands)."""
    argv = sys.argv[1:]
    if argv[:1] == ["sweep"]:
        from roseinfer.cli.sweep import sweep_main

        return sweep_main(argv[1:])
    if argv[:1] == ["capacity"]:
        from roseinfer.cli.capacity import capacity_main

        return capacity_main(argv[1:])
    return run_main("rose-sim", build_parser(), check_args, _run)


if __name__ == "__main__":
    raise SystemExit(main())
