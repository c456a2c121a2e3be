#!/usr/bin/env bash
# The GPU executor's checks in one device call (5.5 min on one H200; the first rose-run on a cold
# Triton cache sets up in ~50 s on an H100, so each run may take 150 s): the CUDA
# tests, the throughput benchmark (every backend, the step table, kernel tables of the
# eager runs), and default-flag rose-run runs that must not run out of memory.
#
#   bash benchmarks/gpu/executor_check.sh          # from the repository root, on the GPU
#
# Knobs (environment): NUM_REQUESTS (benchmark, default 1000), SUBSET (default 128),
# RUN_REQUESTS (rose-run, default 400), BENCH_FLAGS (more gpu_throughput.py flags),
# SKIP (space-separated steps to skip: tests bench run), *_TIMEOUT (s per step).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$SECONDS
skip=" ${SKIP:-} "
step() { echo "== $1 ($((SECONDS - start)) s)"; }

step "device"
$py benchmarks/gpu/device_line.py | tee "$out/device.txt"
$py -c "import roseinfer._core as c; print(c.core_info())"
if [[ $skip != *" tests "* ]]; then
  step "tests: CUDA, and the Triton kernels compiled"
  timeout "${TEST_TIMEOUT:-100}" $py -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/test_layer_kernels.py tests/test_triton_attention.py 2>&1 | tail -40
fi
if [[ $skip != *" bench "* ]]; then
  step "gpu_throughput"
  # shellcheck disable=SC2086
  (cd benchmarks && timeout "${BENCH_TIMEOUT:-270}" $py gpu_throughput.py \
    --num-requests "${NUM_REQUESTS:-1000}" --subset "${SUBSET:-128}" ${BENCH_FLAGS:-}) 2>&1 \
    | tee "$out/throughput.txt"
fi
if [[ $skip != *" run "* ]]; then
  # The 400-request run: fifo (no token budget) must not run out of memory;
  # budget 8192 is the run the simulator is compared with.
  for policy in fifo budget; do
    step "rose-run --policy $policy, default flags"
    extra=()
    [[ $policy == budget ]] && extra=(--prefill-max-tokens 8192)
    timeout "${RUN_TIMEOUT:-150}" $py -m roseinfer.cli.run --device cuda --model llama-3.1-8b \
      --policy "$policy" "${extra[@]}" --num-requests "${RUN_REQUESTS:-400}" --request-rate inf \
      --max-model-len 8192 --save-result "$out/run-$policy.json" \
      --save-steps "$out/steps-$policy.jsonl" 2>&1 | tail -25
  done
fi
step "done"
