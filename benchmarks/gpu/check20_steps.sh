#!/usr/bin/env bash
# The four real runs of the GPU fidelity check (../shared/checks/20-gpu-fidelity) again, with
# their step logs: budget 2048, and pack 2048 + force-FIFO 8 + decode-first, each at saturation
# then at 60% of the rate it reached (Poisson, seed 0); Llama-3.1-8B shapes, 500 Azure conv
# requests, --max-model-len 4096, as the check runs them. A second real run of the same
# combination gives the runs' own spread (what a simulator cannot beat), and its step log gives
# the profile's error class by class on the same card (benchmarks/gpu/step_classes.py).
#
#   bash benchmarks/gpu/check20_steps.sh     # on the GPU, project installed; writes $OUT/rerun.tgz
#   COMBOS=2 bash benchmarks/gpu/check20_steps.sh   # the second combination alone
#
# Writes run-{1,2}{s,l}.json and steps-{1,2}{s,l}.jsonl.gz (names as in
# benchmarks/gpu/results/h100-2026-11-26-checks). About 4 minutes on one H100 (20 s of set-up
# per run; a saturated run 30-50 s, a 60%-load run about 70 s).
set -uo pipefail
out=${OUT:-gpu-out}
work=$(mktemp -d)
mkdir -p "$out"
base=(--model llama-3.1-8b --num-requests 500 --max-model-len 4096 --seed 0 --quiet --device cuda)
combos=("--policy budget --prefill-max-tokens 2048"
        "--policy pack --prefill-max-tokens 2048 --force-fifo-every 8 --loop-order decode-first")
pack() { tar czf "$out/rerun.tgz.tmp" -C "$work" . && mv "$out/rerun.tgz.tmp" "$out/rerun.tgz"; }
for i in ${COMBOS:-1 2}; do
  for load in s l; do
    rate=inf
    if [ $load = l ]; then
      rate=$(python3 -c "import json;r=json.load(open('$work/run-${i}s.json'));print(0.6*r['completed']/r['duration'])") || break
    fi
    t0=$SECONDS
    # shellcheck disable=SC2086
    rose-run "${base[@]}" ${combos[$((i - 1))]} --request-rate "$rate" \
      --save-steps "$work/steps-${i}${load}.jsonl" --save-result "$work/run-${i}${load}.json" \
      > "$work/run-${i}${load}.txt" 2>&1 || tail -3 "$work/run-${i}${load}.txt"
    gzip -f "$work/steps-${i}${load}.jsonl" 2>/dev/null
    echo "run ${i}${load} at $rate req/s: $((SECONDS - t0)) s"
    pack
  done
done
