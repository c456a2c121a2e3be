"""Fit a built-in device's roofline constants to steps measured on that device.

Reads ``rose-run profile`` files and/or step logs (``--save-steps``) of at least
two model shapes taken on one GPU, fits the roofline's constants (``mfu``,
``bandwidth_efficiency``, ``kv_bandwidth_efficiency``, ``overhead_s``,
``overhead_per_seq_s``, ``eager_launch_s_per_layer``,
``decode_imbalance_s_per_token``) of the built-in spec
(``roseinfer.calibration.roofline_fit.fit_device_constants``), prices shapes
left out of the fit (``--check``), prints the errors, writes ``--output``
(JSON), and with ``--write-specs`` records the result in
``calibration/specs.py`` (its ``MEASURED`` block) with the GPU, driver, torch,
date and command, and the fitted profiles' eager step ratios in
``calibration/measured_jitter.json``, so ``rose-sim --hardware NAME`` prices with
them and says so.

    python benchmarks/fit_device_spec.py --device h100-sxm \\
        --fit llama8b.json qwen7b.json --check llama3b.json --output h100-fit.json --write-specs

Run it where the profiles were taken (it reads the driver from ``nvidia-smi``), or
anywhere with ``--driver`` (e.g. from ``nvidia-smi`` output kept with the profiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roseinfer.calibration import ProfileError, ProfileSample
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.roofline_fit import (
    DeviceFit,
    ModelSteps,
    eager_step_ratios,
    fit_device_constants,
    replace_measured_block,
    replace_measured_jitter,
)
from roseinfer.calibration.specs import (
    DATASHEET_DEVICES,
    MEASURED,
    MEASURED_JITTER_FILE,
    DeviceSpec,
    ModelSpec,
)

SPECS_PY = Path(__file__).resolve().parents[1] / "calibration" / "specs.py"


def build_parser() -> argparse.ArgumentParser:
    """Flags of the device fit."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", required=True, choices=sorted(DATASHEET_DEVICES),
                   help="the built-in spec to fit (its datasheet peaks stay)")  # fmt: skip
    p.add_argument("--fit", nargs="+", type=Path, required=True,
                   help="profiles / step logs of the fitted shapes (two shapes or more)")  # fmt: skip
    p.add_argument("--check", nargs="*", type=Path, default=[],
                   help="profiles / step logs of shapes left out, priced with the fit")  # fmt: skip
    p.add_argument("--imbalance-steps", nargs="*", type=Path, default=[],
                   help="step logs of served runs to fit the decode imbalance to (default: "
                        "the --fit files' spread decode batches)")  # fmt: skip
    p.add_argument("--output", type=Path, help="write the fit and its errors as JSON")
    p.add_argument("--write-specs", action="store_true",
                   help="record the result in calibration/specs.py (MEASURED)")  # fmt: skip
    p.add_argument("--command", help="the measuring command to record (default: this one)")
    p.add_argument("--gpu", help="the GPU to record (default: the profiles' cuda_device)")
    p.add_argument("--driver", help="the driver to record (default: nvidia-smi's, here)")
    p.add_argument("--seed", type=int, default=0, help="held-out split")
    return p


def load_steps(paths: Sequence[Path]) -> tuple[list[ModelSteps], dict[str, Any]]:
    """Measured steps per model shape (files of one shape pooled) and the first
    file's environment.

    Raises:
        ProfileError: for a file without a model shape, or one whose prefill passes
            replayed CUDA graphs (the fit takes small prefills as eager: they pin the
            launch roof).
    """
    by_model: dict[str, tuple[ModelSpec, list[ProfileSample]]] = {}
    environment: dict[str, Any] = {}
    for path in paths:
        calibration = load_calibration([path])
        spec = calibration.model_spec
        if spec is None:
            raise ProfileError(f"{path} records no model shape; profile with rose-run")
        if calibration.graphs.max_mixed_tokens:
            raise ProfileError(
                f"{path} ran --cudagraph-mode FULL; fit a device from FULL_DECODE_ONLY runs "
                "(their eager small prefills pin the launch roof)"
            )
        spec = dataclasses.replace(spec, name=Path(spec.name).name)  # a model directory's name
        by_model.setdefault(spec.name, (spec, []))[1].extend(calibration.samples)
        environment = environment or dict(calibration.environment)
    return list(by_model.values()), environment


def driver_version() -> str:
    """The NVIDIA driver version from ``nvidia-smi``, or ``unknown``."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def report_lines(fit: DeviceFit, base_name: str) -> list[str]:
    """The fitted constants next to the datasheet's, and every error."""
    d, base = fit.device, DATASHEET_DEVICES[base_name]
    lines = [
        f"{base_name}: mfu {base.mfu:.3f} -> {d.mfu:.3f}, bandwidth efficiency "
        f"{base.bandwidth_efficiency:.3f} -> {d.bandwidth_efficiency:.3f}, overhead "
        f"{base.overhead_s * 1e3:.2f} -> {d.overhead_s * 1e3:.2f} ms ({fit.num_steps} steps)",
        f"  KV bandwidth efficiency {_kv(base)} -> {_kv(d)}, per sequence "
        f"{base.overhead_per_seq_s * 1e6:.2f} -> {d.overhead_per_seq_s * 1e6:.2f} us, eager "
        f"launch per layer {base.eager_launch_s_per_layer * 1e3:.3f} -> "
        f"{d.eager_launch_s_per_layer * 1e3:.3f} ms, decode imbalance "
        f"{base.decode_imbalance_s_per_token * 1e6:.3f} -> "
        f"{d.decode_imbalance_s_per_token * 1e6:.3f} us per token",
        f"  held-out step error (20% of the steps): median {fit.held_out.median:.1%}, "
        f"p90 {fit.held_out.p90:.1%}",
    ]
    for title, errors in (("fitted", fit.per_model), ("check (not fitted)", fit.checks)):
        for name, err in errors.items():
            lines.append(f"  {title} {name}: median {err.median:.1%}, p90 {err.p90:.1%}, "
                         f"max {err.max:.1%} over {err.num_samples} steps")  # fmt: skip
    if fit.clamped:
        lines.append(
            f"  held at its bound of 1: {', '.join(fit.clamped)} (the steps do not pin it "
            "down: no step was bound by it, or another constant trades off with it)"
        )
    return lines


def _kv(device: DeviceSpec) -> str:
    """A spec's KV bandwidth efficiency, or what it falls back to."""
    kv = device.kv_bandwidth_efficiency
    return f"{kv:.3f}" if kv is not None else "(as weights)"


def write_jitter(device: str, paths: Sequence[Path], samples: Sequence[ProfileSample]) -> None:
    """Record the fitted profiles' eager step ratios in ``MEASURED_JITTER_FILE``."""
    ratios = eager_step_ratios(samples)
    doc = json.loads(MEASURED_JITTER_FILE.read_text()) if MEASURED_JITTER_FILE.exists() else {}
    source = " ".join(str(p) for p in paths)
    doc = replace_measured_jitter(doc, device, source, ratios)
    MEASURED_JITTER_FILE.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    count = sum(len(r) for _, r in ratios)
    print(f"recorded in {MEASURED_JITTER_FILE}: {count} eager repetitions of {len(ratios)} shapes")


def main() -> int:
    """Entry point: load, fit, report, record."""
    args = build_parser().parse_args()
    try:
        fitted, environment = load_steps(args.fit)
        checks, _ = load_steps(args.check)
        imbalance, _ = load_steps(args.imbalance_steps)
        if len(fitted) < 2:
            raise ProfileError(f"--fit needs two model shapes or more, got {len(fitted)}")
        fit = fit_device_constants(
            DATASHEET_DEVICES[args.device], fitted, checks, args.seed, imbalance
        )
    except (ProfileError, ValueError) as err:
        print(f"fit_device_spec: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report_lines(fit, args.device)))
    command = args.command or shlex.join(["python", *sys.argv])
    measurement = fit.measurement(
        source=" ".join(str(p) for p in [*args.fit, *args.check, *args.imbalance_steps]),
        gpu=args.gpu or str(environment.get("cuda_device") or environment.get("processor") or "?"),
        driver=args.driver or driver_version(), torch=str(environment.get("torch", "unknown")),
        date=datetime.date.today().isoformat(), command=command,
    )  # fmt: skip
    if args.output is not None:
        doc = {"device": args.device, "measurement": dataclasses.asdict(measurement),
               "held_out": dataclasses.asdict(fit.held_out),
               "per_model": {k: dataclasses.asdict(v) for k, v in fit.per_model.items()},
               "checks": {k: dataclasses.asdict(v) for k, v in fit.checks.items()},
               "clamped": list(fit.clamped)}  # fmt: skip
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    if args.write_specs:
        entries = {**MEASURED, args.device: measurement}
        SPECS_PY.write_text(replace_measured_block(SPECS_PY.read_text(), entries))
        print(f"recorded in {SPECS_PY}: {measurement.provenance.label()}")
        write_jitter(args.device, args.fit, [s for _, samples in fitted for s in samples])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
