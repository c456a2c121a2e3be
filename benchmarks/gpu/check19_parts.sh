#!/usr/bin/env bash
# The parts of the GPU executor check (../shared/checks/19-gpu-executor) one by one, each with its
# own exit line, in the order a default change can break them: the fifo run with default flags
# (1,000 Azure conv requests at t=0, --max-model-len 8192), rose-sim on its flags (sim / real
# duration), then the synthetic 215/198 run under what is left of LIMIT seconds. Results in $OUT.
# On 2026-11-27 with --cudagraph-mode FULL as the default, the fifo run died in the memory
# planner's graph capture (benchmarks/gpu/results/h100-2026-11-27d-full/check19-parts/).
#   LIMIT=180 bash benchmarks/gpu/check19_parts.sh        # on the GPU, from the repository root
set -u
W=${OUT:-gpu-out}; mkdir -p "$W"; t0=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . || exit 1
common=(--model llama-3.1-8b --device cuda --request-rate inf --quiet)
rose-run "${common[@]}" --policy fifo --num-requests 1000 --max-model-len 8192 --save-result "$W/a.json" >"$W/a.txt" 2>&1; echo "fifo rc=$? at $(( $(date +%s)-t0 )) s"
rose-sim --model llama-3.1-8b --hardware h100-sxm --policy fifo --num-requests 1000 --max-model-len 8192 \
  --request-rate inf --quiet --no-summary --save-result "$W/s.json" >"$W/s.txt" 2>&1; echo "sim rc=$?"
python3 -c "import json;a,s=(json.load(open('$W/'+x+'.json')) for x in 'as');print('fifo',a['completed'],a.get('rejected',0),round(a['output_throughput']),'peak',a.get('peak_memory_gb'),'sim/real',round(s['duration']/a['duration'],3), a.get('cudagraph_mode'))"
timeout $(( ${LIMIT:-180} - ($(date +%s)-t0) )) rose-run "${common[@]}" --workload synthetic --prompt-tokens 215 --output-tokens 198 --unique-prompts --num-requests 1000 \
  --save-result "$W/b.json" >"$W/b.txt" 2>&1; echo "synthetic rc=$? at $(( $(date +%s)-t0 )) s"
python3 -c "import json;b=json.load(open('$W/b.json'));print('synthetic out tok/s',round(b['output_throughput']))"
