#!/usr/bin/env bash
# The seed posts' experiments on CUDA, as the posts ran them (GPT-2 124M, float32), with
# warm-up, 3 repeats and the simulator priced by a GPT-2 CUDA profile (< 10 min), plus the
# 004 prefix-hit step check.
#
#   bash benchmarks/gpu/seeds_cuda.sh
#
# On a CPU, as a dry run of the script (tiny model, one repeat, about 5 minutes):
#   rose-run profile --device cpu --model tiny-gpt2 --max-model-len 256 --max-num-seqs 8 \
#     --max-num-batched-tokens 256 --repetitions 1 --quiet --output /tmp/p.json
#   DEVICE=cpu PROFILE=/tmp/p.json OUT=/tmp/sc REPEATS=1 \
#     SEED_FLAGS="--model tiny-gpt2 --num-requests 8" bash benchmarks/gpu/seeds_cuda.sh
set -euo pipefail
out=$(realpath -m "${OUT:-gpu-out}/seeds")  # absolute: the experiments run in benchmarks/
mkdir -p "$out"
device=${DEVICE:-cuda}
profile=$(realpath -m "${PROFILE:-gpu-runs/gpt2-$device-fp32.json}")
start=$SECONDS
python benchmarks/gpu/device_line.py | tee "$out/device.txt"
if [[ ! -f "$profile" ]]; then
  mkdir -p "$(dirname "$profile")"
  rose-run profile --device "$device" --model gpt2 --dtype float32 --max-model-len 1024 \
    --max-num-seqs 128 --max-num-batched-tokens 2048 --repetitions 2 --quiet --output "$profile"
fi
cp "$profile" "$out/"
cd benchmarks
python seed_experiments.py 004-prefix-shared --step-check --device "$device" ${SEED_FLAGS:-} | tee "$out/step-check.txt"
python seed_experiments.py all --backend both --device "$device" --repeats "${REPEATS:-3}" \
  --cost-model "$profile" ${SEED_FLAGS:-} | tee "$out/seeds.txt"
echo "== done in $((SECONDS - start)) s"
