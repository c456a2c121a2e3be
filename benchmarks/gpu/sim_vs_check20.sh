#!/usr/bin/env bash
# rose-sim against the real runs of the GPU fidelity check (../shared/checks/20-gpu-fidelity), on a CPU.
#
# The check ran rose-run --device cuda (Llama-3.1-8B shapes, 500 Azure conv requests, --max-model-len
# 4096, seed 0) for budget 2048 and pack 2048 + force-FIFO 8 + decode-first, at saturation and at 60%
# of it; R holds its result files (check20/r{1,2}{s,l}.json) and its GPU profile (check20/p.json).
# For each run this prints benchmarks/gpu/sim_vs_run.py's table: the signed error of every metric
# for the built-in h100-sxm (measured; and with --step-jitter measured), its datasheet constants,
# and the check's profile, priced with its step jitter and at its medians (--step-jitter off).
# Each run is simulated under the --cudagraph-mode its result file records. h100-2026-11-27d-full
# is the check run with --cudagraph-mode FULL as rose-run's and rose-sim's default.
# R defaults to the check's second run of 2026-11-27 (h100-2026-11-27b-checks: rose-run profile
# with its served run; requests beyond 4,096 tokens rejected on both sides; its rerun-*/ folders
# hold the same runs again with step logs, benchmarks/gpu/check20_steps.sh). The first run of that
# day is benchmarks/gpu/results/h100-2026-11-27-checks (same layout). The run of 2026-11-26
# (benchmarks/gpu/results/h100-2026-11-26-checks) predates both: its runs clipped those requests
# (rose-run's default then), so the simulations clip them too, and it adds the profile refitted with
# the step model's GPU terms (check20/p-refit.json, from benchmarks/gpu/refit_profile.py
# --decode-split-programs 528) and that refit pooled with the step log of a served run of the
# same morning (SERVED: fifo, the first 400 Azure conv requests at --max-model-len 8192, a
# stand-in for the served run the profile lacked; its requests overlap the check's).
#
#   bash benchmarks/gpu/sim_vs_check20.sh [R]   # R: default benchmarks/gpu/results/h100-2026-11-27b-checks
set -euo pipefail
R=${1:-benchmarks/gpu/results/h100-2026-11-27b-checks}
SERVED=${SERVED:-benchmarks/gpu/results/h100-2026-11-26/steps-fifo-cut.jsonl}
combos=("--policy budget --prefill-max-tokens 2048"
        "--policy pack --prefill-max-tokens 2048 --force-fifo-every 8 --loop-order decode-first")
calibrations=("$R/check20/p.json")
[ -f "$R/check20/p-refit.json" ] && calibrations+=("$R/check20/p-refit.json" "$R/check20/p-refit.json,$SERVED")
for i in 1 2; do
  rate=$(python -c "import json;r=json.load(open('$R/check20/r${i}s.json'));print(0.6*r['completed']/r['duration'])")
  for load in s l; do
    real=$R/check20/r${i}${load}.json
    r=inf; [ $load = l ] && r=$rate
    blocks=$(python -c "import json;print(json.load(open('$real'))['num_kv_blocks'])")
    # the runs of 2026-11-26 clipped requests beyond --max-model-len (rose-run's default then)
    clip=$(python -c "import json;print('--fit-lengths clip' if json.load(open('$real'))['fit_lengths'].startswith('clip') else '')")
    # the graphs the run replayed (results before the field: FULL_DECODE_ONLY)
    mode=$(python -c "import json;print(json.load(open('$real')).get('cudagraph_mode') or 'FULL_DECODE_ONLY')")
    echo "== ${combos[$((i - 1))]} at --request-rate $r"
    # shellcheck disable=SC2086
    python benchmarks/gpu/sim_vs_run.py "$real" --calibration "${calibrations[@]}" -- \
      --model llama-3.1-8b --hardware h100-sxm --num-requests 500 --max-model-len 4096 --seed 0 \
      ${combos[$((i - 1))]} --request-rate "$r" --num-kv-blocks "$blocks" --cudagraph-mode "$mode" $clip
  done
done
