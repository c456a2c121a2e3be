#!/usr/bin/env bash
# One whole device call, ordered by what is least measured, inside a deadline: the issue's
# 400-request rose-run runs (step logs kept), the throughput benchmark (roseinfer-triton
# only), the h100-sxm fit (fit_h100.sh), then the CUDA tests with whatever time is left.
#
#   python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . && \
#     DEADLINE=570 bash benchmarks/gpu/session.sh        # on the GPU, from the repository root
#
# A device call brings back at most 8 files from $OUT, so every stage writes into a work
# folder, and results.tgz in $OUT is rewritten after each stage: a call cut short still brings
# back what finished. log.txt holds everything printed.
# STAGES="full" is the A/B of --cudagraph-mode FULL: its CUDA test, then the step table and
# workload (b) with and without it (about 5 minutes).
# STAGES="probe probe-full jitter adopts" looks for the small-prefill stretch: check 20's budget
# run at 60% load (10.4 req/s, the 2026-11-27 rate) under benchmarks/gpu/step_probe.py, eager then
# with --cudagraph-mode FULL (about 2 minutes each), eager_jitter.py, and the tune-cache CUDA test;
# probe-omp1 and probe-full-omp1 run them with one torch CPU thread (OMP_NUM_THREADS=1,
# --num-threads 1), cpu-facts writes the machine's CPU and memory settings.
# STAGES="decode-ab flip-full check19-parts" (carry .base, made by decode_ab.sh prepare): this
# tree's and a baseline's step tables on one lease, then check 19's parts with FULL as the default
# (the copy on the device is edited; nothing comes back but the results).
# STAGES="tests balanced": the CUDA tests (balanced key splits compiled), then gpu_throughput.py's
# workload (b) and step table with the warm-up free to keep balanced splits and with them ruled
# out (triton:nosplit), one process each (about 4-5 minutes; the first also prints the profiler's
# kernels of every step and cProfile's host functions of each decode step, into balanced-triton.txt
# with the rest); "unified" adds (b) with a mixed
# pass's decodes in its one launch, as before 2026-11-27 (triton:unified, about 2.5 minutes).
# Knobs: DEADLINE (s from the start, default 570), STAGES (default "runs bench fit tests"),
# BENCH_FLAGS (gpu_throughput.py flags, default "--backends triton --no-hf").
set -uo pipefail
out=${OUT:-gpu-out}
work=${WORK:-/tmp/rose-session}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
command -v python >/dev/null || { mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python; export PATH=/tmp/bin:$PATH; }
deadline=${DEADLINE:-570}
start=$SECONDS
left() { echo $((deadline - (SECONDS - start))); }
pack() { tar czf "$out/results.tgz.tmp" -C "$work" . && mv "$out/results.tgz.tmp" "$out/results.tgz"; }

stage() {  # stage NAME MAX_S COMMAND...: run under min(MAX_S, time left - 10 s)
  local name=$1 max=$2 budget
  shift 2
  budget=$(( $(left) - 10 ))
  (( budget > max )) && budget=$max
  if (( budget < 20 )); then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($((SECONDS - start)) s, up to $budget s)"
  timeout "$budget" "$@"
  echo "== $name: exit $? ($((SECONDS - start)) s)"
  pack
}

{
  for s in ${STAGES:-runs bench fit tests}; do
    case $s in
      runs) stage runs 320 env OUT="$work" SKIP="tests bench" bash benchmarks/gpu/executor_check.sh ;;
      bench) stage bench 200 env OUT="$work" SKIP="tests run" \
        BENCH_FLAGS="${BENCH_FLAGS:---backends triton --no-hf}" bash benchmarks/gpu/executor_check.sh ;;
      fit) stage fit 330 env OUT="$work" bash benchmarks/gpu/fit_h100.sh ;;
      tests) stage tests 120 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py \
        tests/test_layer_kernels.py tests/test_triton_attention.py ;;
      full) stage full-test 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k full_mode
        stage full-ab 240 sh -c "cd benchmarks && python3 gpu_throughput.py --backends \
          triton,triton:full --no-hf --workloads b > '$work/full-ab.txt' 2>&1" ;;
      cpu-facts) stage cpu-facts 20 sh -c "nproc; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA node0'; \
          cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1; \
          cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1; uptime" > "$work/cpu-facts.txt" 2>&1 ;;
      probe|probe-full|probe-omp1|probe-full-omp1)
        mode=FULL_DECODE_ONLY; case $s in probe-full*) mode=FULL ;; esac
        threads=""; case $s in *omp1) threads="--num-threads 1" ;; esac
        stage "$s" 170 sh -c "${threads:+OMP_NUM_THREADS=1 }python3 benchmarks/gpu/step_probe.py --probe-out '$work/$s.jsonl' -- \
          --device cuda --model llama-3.1-8b --num-requests 500 --max-model-len 4096 --seed 0 \
          --quiet --policy budget --prefill-max-tokens 2048 --request-rate ${PROBE_RATE:-10.4} \
          --cudagraph-mode $mode $threads --save-steps '$work/steps-$s.jsonl' \
          --save-result '$work/run-$s.json' > '$work/$s.txt' 2>&1; tail -8 '$work/$s.txt'" ;;
      jitter) stage jitter 150 python3 benchmarks/gpu/eager_jitter.py --output "$work/eager-jitter.json" ;;
      adopts) stage adopts 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k adopts ;;
      balanced) stage balanced-ab 300 sh -c "cd benchmarks && for b in triton triton:nosplit; do \
          f=$work/balanced-\${b#*:}.txt; x=''; [ \$b = triton ] && x='--kernel-table --host-profile'; \
          python3 gpu_throughput.py --backends \$b --no-hf --save-steps $work --workloads b \$x \
          > \$f 2>&1; tail -14 \$f; done" ;;
      unified) stage unified-ab 170 sh -c "cd benchmarks && python3 gpu_throughput.py --backends \
          triton:unified --no-hf --save-steps $work --workloads b > $work/unified.txt 2>&1; \
          tail -14 $work/unified.txt" ;;
      decode-ab) stage decode-ab 240 env OUT="$work/decode-ab" bash benchmarks/gpu/decode_ab.sh run ;;
      flip-full)  # this copy only: later stages run with --cudagraph-mode FULL as the default
        sed -i 's/^DEFAULT_CUDAGRAPH_MODE = .*/DEFAULT_CUDAGRAPH_MODE = "FULL"/' calibration/graph_replay.py
        grep -n "^DEFAULT_CUDAGRAPH_MODE" calibration/graph_replay.py ;;
      check19-parts) stage check19-parts 200 env OUT="$work/check19-parts" LIMIT=190 \
        bash benchmarks/gpu/check19_parts.sh ;;
      *) echo "unknown stage $s" ;;
    esac
  done
  echo "== session done ($((SECONDS - start)) s)"
} 2>&1 | tee "$out/log.txt"
