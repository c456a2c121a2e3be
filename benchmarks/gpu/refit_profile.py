"""Refit a ``rose-run profile`` file's samples with this roseinfer's step model.

A profile keeps every timed sample, so a newer fit can be applied to an older
measurement without the device. ``--decode-split-programs N`` records what a
profile taken before the field existed lacks (``executor.decode_split_programs``:
4 x the GPU's SMs for roseinfer's Triton attention, 528 on an H100), so the step
model gains its GPU terms (eager launches, the decode tail; see
``roseinfer.calibration.step_model.GPU_TERMS``). Prints each candidate's
held-out error before and after.

    python benchmarks/gpu/refit_profile.py \\
        benchmarks/gpu/results/h100-2026-11-26-checks/check20/p.json p-refit.json \\
        --decode-split-programs 528
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from roseinfer.calibration.profile import Profile, load_profile


def refit(profile: Profile, decode_split_programs: int | None) -> Profile:
    """``profile``'s samples fitted again, with ``decode_split_programs`` recorded
    when given (the rest of the file as it was)."""
    executor = dict(profile.executor)
    if decode_split_programs is not None:
        executor["decode_split_programs"] = decode_split_programs
    return Profile.create(
        model_name=profile.model_name, model_spec=profile.model_spec, executor=executor,
        environment=profile.environment, samples=profile.samples,
        base_device=profile.roofline.device if profile.roofline else None,
        overhead_samples=profile.overhead_samples, extra=profile.extra,
    )  # fmt: skip


def _errors(profile: Profile) -> str:
    fit = profile.step_fit
    cells = (f"{name} {e.median:.1%} / {e.p90:.1%}" for name, e in fit.held_out.items())
    return f"chosen {fit.model.name}; held-out median / p90: " + ", ".join(cells)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path, help="PROFILE.json to refit")
    p.add_argument("output", type=Path, help="where to write the refitted profile")
    p.add_argument("--decode-split-programs", type=int,
                   help="record executor.decode_split_programs (4 x SMs; 528 on an H100)")  # fmt: skip
    args = p.parse_args(argv)
    before = load_profile(args.profile)
    after = refit(before, args.decode_split_programs)
    after.save(args.output)
    print(f"before: {_errors(before)}")
    print(f"after:  {_errors(after)} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
