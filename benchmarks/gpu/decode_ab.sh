#!/usr/bin/env bash
# The step table of benchmarks/gpu_throughput.py (decode 1-256 x ctx 1,024, prefills) for this
# tree and a baseline commit's, alternating processes on one machine, so a change to the
# executor's host path is measured on one lease (host speed differs up to 1.6x between leases).
#
#   BASE=1e6c9a0 bash benchmarks/gpu/decode_ab.sh prepare    # here: the baseline's tree in .base/
#   bash benchmarks/gpu/decode_ab.sh run                     # on the GPU, a call with carry [".base"]
#
# `prepare` writes the baseline's files (no result folders) into .base/, ignored by git: a device
# call sends it only when carried. `run` installs it into /tmp/rose-base (pip --target, no index),
# installs this tree editable, then runs ROUNDS (default 2) rounds of both tables from outside
# the repository root, writing $OUT/steps-{now,base}-R.txt and printing each table's step rows.
# BENCH_FLAGS (default: Triton with decode graphs, no transformers, no workloads) go to both.
set -euo pipefail
here=$(pwd)
case ${1:?usage: decode_ab.sh prepare|run} in
  prepare)
    rm -rf .base && mkdir -p .base
    git archive "${BASE:?BASE=commit}" -- . ':!benchmarks/gpu/results' | tar -x -C .base
    grep -qx "/.base/" .git/info/exclude || echo "/.base/" >> .git/info/exclude
    du -sh .base ;;
  run)
    [[ -d .base ]] || { echo "no .base/: run 'decode_ab.sh prepare' and carry .base"; exit 2; }
    out=${OUT:-gpu-out}; mkdir -p "$out"
    python3 -m pip install --no-deps --no-build-isolation --no-index -q -e .
    rm -rf /tmp/rose-base
    python3 -m pip install --no-deps --no-build-isolation --no-index -q --target /tmp/rose-base ./.base
    flags=${BENCH_FLAGS:---backends triton --no-hf --workloads ''}
    cd /tmp
    for r in $(seq "${ROUNDS:-2}"); do
      for side in now base; do
        if [[ $side == now ]]; then
          script=$here/benchmarks/gpu_throughput.py; path=""
        else
          script=$here/.base/benchmarks/gpu_throughput.py; path=/tmp/rose-base
        fi
        # shellcheck disable=SC2086
        eval PYTHONPATH="$path" python3 "$script" $flags > "$out/steps-$side-$r.txt" 2>&1 \
          || { tail -3 "$out/steps-$side-$r.txt"; echo "$side round $r failed"; exit 1; }
        echo "== $side, round $r"
        grep -E "^ *(decode|prefill|mixed) .*\|" "$out/steps-$side-$r.txt" \
          || { tail -3 "$out/steps-$side-$r.txt"; echo "$side round $r: no step rows"; exit 1; }
      done
    done ;;
  *) echo "usage: decode_ab.sh prepare|run"; exit 2 ;;
esac
