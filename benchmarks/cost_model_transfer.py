"""Cross-model error of the calibrated roofline: profile one model, price another.

``rose-run profile`` fits the roofline's device rates and a dispatch overhead
from one model's steps; ``rose-sim --cost-model PROFILE.json --model OTHER``
then prices another shape on the same device. This script measures how well:
it times the real steps of each target model over the profiler's grid (fewer
repetitions), and compares, shape by shape, with

* ``calibrated``: the source profile's calibrated roofline for the target shape;
* ``builtin``: the uncalibrated roofline with the built-in device spec (``cpu``);
* ``own fit``: the target's own profiled fit, held out (the best one can do).

Relative error ``|predicted - measured| / measured``, median and p90 over the
target's grid. Targets: ``gpt2-medium`` (355M: 24 layers, 1024 wide; built from
GPT-2's config with random weights) and ``tiny-llama`` (another architecture),
or any built-in name.

    python benchmarks/cost_model_transfer.py --source gpt2.json
    python benchmarks/cost_model_transfer.py --source gpt2.json --targets tiny-llama --repetitions 1

Run ``rose-run profile --device cpu --model gpt2 --output gpt2.json`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/_common.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

from roseinfer.calibration import (  # noqa: E402
    HeldOutError,
    ProfileSample,
    calibrate_roofline,
    fit_step_model,
    load_profile,
)
from roseinfer.calibration.cost_model import make_cost_model  # noqa: E402
from roseinfer.calibration.specs import ModelSpec, get_device_spec  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.builder import new_runner  # noqa: E402
from roseinfer.executor.facts import model_spec_of  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.executor.profiler import (  # noqa: E402
    GridLimits,
    batch_shape_of,
    measure_host_overhead,
    profile_grid,
    time_grid,
)
from roseinfer.executor.warmup import warm_up  # noqa: E402

# target name -> (built-in config, overrides): shapes the executor can build offline
TARGETS = {
    "gpt2-medium": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}),
    "tiny-llama": ("tiny-llama", {}),
    "tiny-gpt2": ("tiny-gpt2", {}),
    "gpt2": ("gpt2", {}),
}


def measure_target(name: str, args: argparse.Namespace, profile_executor: dict):
    """Time the target's grid under the source profile's limits (pool in bytes)."""
    base, overrides = TARGETS[name]
    model, hf_config, _ = build_model(
        base, seed=0, dtype=torch.float32, device="cpu", config_overrides=overrides
    )
    spec = model_spec_of(name, hf_config, torch.float32)
    max_len = min(spec.max_model_len, profile_executor["max_model_len"])
    block = profile_executor["block_size"]
    blocks = profile_executor["kv_cache_budget_bytes"] // (spec.kv_bytes_per_token * block)
    blocks = int(min(blocks, args.max_num_seqs * -(-max_len // block)))
    config = SchedulerConfig(
        num_kv_blocks=blocks,
        block_size=block,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
    )
    runner = new_runner(model, config, device="cpu", dtype=torch.float32)
    warm_up(runner, config)
    host = measure_host_overhead(config, runner.vocab_size)
    limits = GridLimits(args.max_num_batched_tokens, args.max_num_seqs, max_len, blocks * block)
    samples = []
    for kind, seqs, times in time_grid(runner, profile_grid(limits), args.repetitions):
        shape = batch_shape_of(seqs)
        samples.append(ProfileSample(kind, shape, tuple(times), host.seconds(shape)))
    return spec, samples


def load_or_measure(name: str, args: argparse.Namespace, profile_executor: dict):
    """The target's samples from ``--samples-dir`` if saved there, else measured (and saved)."""
    path = Path(args.samples_dir, f"{name}.json") if args.samples_dir else None
    if path is not None and path.exists():
        doc = json.loads(path.read_text())
        return ModelSpec(**doc["spec"]), [ProfileSample.from_json(r) for r in doc["samples"]]
    spec, samples = measure_target(name, args, profile_executor)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"spec": dataclasses.asdict(spec), "samples": [s.to_json() for s in samples]}
        path.write_text(json.dumps(doc))
    return spec, samples


def errors(cost_model, samples) -> HeldOutError:
    predicted = np.array([cost_model.step_time_s(s.shape) for s in samples])
    return HeldOutError.of(predicted, np.array([s.target_s for s in samples]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="PROFILE.json of the source model")
    parser.add_argument("--targets", default="gpt2-medium,tiny-llama")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, help="torch threads (default: the profile's)")
    parser.add_argument(
        "--refit",
        action="store_true",
        help="refit the source's calibrated roofline from its raw samples with this code",
    )
    parser.add_argument(
        "--samples-dir", help="save each target's timed steps here; reuse them if present"
    )
    args = parser.parse_args()
    profile = load_profile(args.source)
    if args.refit:
        base = (
            get_device_spec(profile.executor["device"].split(":")[0])
            if "cpu" in profile.executor["device"]
            else None
        )
        roofline = calibrate_roofline(
            profile.model_spec, profile.samples, base, 0, profile.overhead_samples
        )
        profile = dataclasses.replace(profile, roofline=roofline)
    torch.set_num_threads(args.threads or profile.environment.get("num_threads") or 1)
    print(f"source: {profile.label}; {profile.roofline.cost_model(profile.model_spec).describe()}")
    print(f"load average {os.getloadavg()[0]:.2f}; threads {torch.get_num_threads()}")
    header = f"{'target':12s} {'steps':>5s} {'calibrated':>17s} {'builtin':>17s} {'own fit':>17s}"
    rows = []
    for name in args.targets.split(","):
        start = time.perf_counter()
        spec, samples = load_or_measure(name.strip(), args, profile.executor)
        calibrated = errors(profile.cost_model(spec), samples)
        builtin = errors(make_cost_model(spec, "cpu", dtype_bytes=4), samples)
        own = fit_step_model(samples).held_out
        best = min(own.values(), key=lambda e: e.median + e.p90)
        rows.append(
            f"{name:12s} {len(samples):5d} "
            + " ".join(f"{e.median:7.1%} / {e.p90:6.1%}" for e in (calibrated, builtin, best))
            + f"   ({time.perf_counter() - start:.0f} s)"
        )
        print(rows[-1], flush=True)
    print("\nrelative step-time error, median / p90 over the target's grid")
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
