#!/usr/bin/env bash
# The seed posts' experiments on CUDA, as the posts ran them (GPT-2 124M, float32), with
# warm-up, 3 repeats and the simulator priced by a GPT-2 CUDA profile (< 10 min), plus the
# 004 prefix-hit step check.
#
#   bash benchmarks/gpu/seeds_cuda.sh
set -euo pipefail
out=${OUT:-gpu-out}/seeds
mkdir -p "$out"
device=${DEVICE:-cuda}
profile=${PROFILE:-gpu-runs/gpt2-$device-fp32.json}
start=$SECONDS
python benchmarks/gpu/device_line.py | tee "$out/device.txt"
if [[ ! -f "$profile" ]]; then
  mkdir -p "$(dirname "$profile")"
  rose-run profile --device "$device" --model gpt2 --dtype float32 --max-model-len 1024 \
    --max-num-seqs 128 --max-num-batched-tokens 2048 --repetitions 2 --quiet --output "$profile"
fi
cp "$profile" "$out/"
cd benchmarks
python seed_experiments.py 004-prefix-shared --step-check --device "$device" | tee "../$out/step-check.txt"
python seed_experiments.py all --backend both --device "$device" --repeats "${REPEATS:-3}" \
  --cost-model "../$profile" ${SEED_FLAGS:-} | tee "../$out/seeds.txt"
echo "== done in $((SECONDS - start)) s"
