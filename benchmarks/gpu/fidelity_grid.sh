#!/usr/bin/env bash
# rose-sim against rose-run --device cuda on one Azure trace: one device call (< 10 min).
#
# The serving grid (fifo, budget 2048, pack 2048 + force-FIFO 8, budget 2048 decode-first,
# mixed + chunked 2048) at 60% and 100% of capacity, 3 real runs each, priced by the GPU
# profile (made first, or reused from an earlier call) and by the built-in h100-sxm roofline
# (measured once fit_h100.sh's fit is recorded). The real runs are sized by the simulator to
# fit TIME_BUDGET_S: requests are cut, never combinations, and the report says how many ran.
# Run it twice, one trace per device call:
#
#   bash benchmarks/gpu/fidelity_grid.sh conv
#   bash benchmarks/gpu/fidelity_grid.sh code
#
# The Azure CSVs are read from TRACE_DIR (default ../shared/traces, else ./traces: copy them
# into the tree before the call when ../shared is not on the device). The first call makes the
# GPU profile (gpu-runs/llama-3.1-8b-fidelity.json) and copies it to $OUT/fidelity: put it back
# at gpu-runs/ in the tree before the second call, which then reuses it.
set -euo pipefail
trace=${1:?usage: fidelity_grid.sh conv|code}
out=${OUT:-gpu-out}/fidelity
mkdir -p "$out"
device=${DEVICE:-cuda}
model=${MODEL:-llama-3.1-8b}
hardware=${HARDWARE:-h100-sxm}
limits=${LIMITS:-"--max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 --repetitions 2"}
budget_s=${TIME_BUDGET_S:-300}
requests=${NUM_REQUESTS:-500}
profile=${PROFILE:-gpu-runs/$model-fidelity.json}
trace_dir=${TRACE_DIR:-../shared/traces}
[[ -d "$trace_dir" ]] || trace_dir=traces
start=$SECONDS

python benchmarks/gpu/device_line.py | tee "$out/device.txt"
if [[ ! -f "$profile" ]]; then
  mkdir -p "$(dirname "$profile")"
  echo "== profile $model ($((SECONDS - start)) s)"
  # shellcheck disable=SC2086
  rose-run profile --device "$device" --model "$model" $limits --quiet --output "$profile"
fi
cp "$profile" "$out/"
echo "== fidelity $trace ($((SECONDS - start)) s)"
# shellcheck disable=SC2086
python benchmarks/fidelity.py --device "$device" --model "$model" --profile "$profile" \
  --grid serving --budget-tokens 2048 --traces "$trace" --trace-dir "$trace_dir" \
  --num-requests "$requests" --prompt-scale 1 --max-prompt-tokens 3072 --max-output-tokens 1024 \
  --loads 0.6 1.0 --repeats 3 --roofline "$hardware" --time-budget-s "$budget_s" \
  --run-overhead-s 2 ${FIDELITY_FLAGS:-} --output "$out/fidelity-$trace"
echo "== done in $((SECONDS - start)) s"
