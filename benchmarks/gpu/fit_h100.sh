#!/usr/bin/env bash
# Fit the built-in h100-sxm roofline to steps measured on an H100 (one device call, < 10 min).
#
# Profiles two model shapes (Llama-3.1-8B, Qwen2.5-7B, random bf16 weights) and a third shape
# left out of the fit (Llama-3.2-3B), fits the roofline's constants (benchmarks/fit_device_spec.py:
# mfu, weight and KV bandwidth efficiencies, overhead per step and per sequence, eager launch per
# layer, decode imbalance), and prints the held-out and third-shape errors. The decode imbalance
# is best fitted to a served run's step log (IMBALANCE=steps.jsonl[.gz], e.g. the 2026-11-26
# budget run's): the profiles' spread decode batches are evenly spread, a workload's are skewed. The limits are rose-run's serving
# defaults but a 4,096-token window: decodes up to 256 sequences, prefills up to 2,048 tokens; no
# served run (the roofline is fitted to the grid's medians; IMBALANCE brings a served run's steps).
# Everything lands in $OUT (or ./gpu-out): bring it back, then record the fit here with the
# command the script prints last (it edits calibration/specs.py's MEASURED block).
#
#   bash benchmarks/gpu/fit_h100.sh                 # on the H100, from the repository root
#   DEVICE=cpu MODELS="tiny-llama tiny-qwen2" CHECK=tiny-gpt2 LIMITS="--max-model-len 128 \
#     --max-num-seqs 8 --max-num-batched-tokens 128 --repetitions 1" bash benchmarks/gpu/fit_h100.sh
#                                                   # a dry run of the pipeline on a CPU
set -euo pipefail
out=${OUT:-gpu-out}/fit-h100
mkdir -p "$out"
device=${DEVICE:-cuda}
models=${MODELS:-"llama-3.1-8b qwen2.5-7b"}
check=${CHECK:-llama-3.2-3b}
limits=${LIMITS:-"--max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 2048 --repetitions 2 --served-requests 0"}
start=$SECONDS

python benchmarks/gpu/device_line.py | tee "$out/device.txt"
fits=()
for model in $models; do
  name=$(basename "$model")
  echo "== profile $name ($((SECONDS - start)) s)"
  # shellcheck disable=SC2086
  rose-run profile --device "$device" --model "$model" $limits --quiet --output "$out/$name.json"
  fits+=("$out/$name.json")
done
echo "== profile $(basename "$check") (not fitted) ($((SECONDS - start)) s)"
# shellcheck disable=SC2086
rose-run profile --device "$device" --model "$check" $limits --quiet --output "$out/check.json"

echo "== fit ($((SECONDS - start)) s)"
imbalance=()
[ -n "${IMBALANCE:-}" ] && imbalance=(--imbalance-steps "$IMBALANCE")
python benchmarks/fit_device_spec.py --device h100-sxm --fit "${fits[@]}" --check "$out/check.json" \
  "${imbalance[@]}" --output "$out/h100-fit.json" --command "bash benchmarks/gpu/fit_h100.sh" \
  | tee "$out/fit.txt"
driver=$(sed -n 's/^driver //p' "$out/device.txt")
echo "== done in $((SECONDS - start)) s. To record it (here or after bringing $out back):"
echo "python benchmarks/fit_device_spec.py --device h100-sxm --fit ${fits[*]} --check $out/check.json" \
     "${imbalance[*]} --driver '$driver' --command 'bash benchmarks/gpu/fit_h100.sh' --write-specs"
