#!/usr/bin/env bash
# Run acceptance checks on a lent GPU in one device call, each under its own time limit, keeping
# what they leave behind.
#
# ../shared does not travel to the device, so copy the checks into .checks/ first (ignored by git):
#   mkdir -p .checks && cp ../shared/checks/{19-gpu-executor,20-gpu-fidelity} .checks/ \
#     && echo /.checks/ >> .git/info/exclude
# then call the device with carry [".checks"] and
#   bash benchmarks/gpu/run_checks.sh 19-gpu-executor:235 20-gpu-fidelity:350
# (NAME:SECONDS each). Every check runs as shipped, except that its temporary folder is packed into
# $OUT/NAME.tgz before it is removed (result files, profiles), so a failing check can be studied
# on the CPU afterwards. The log is $OUT/checks.log; the device line $OUT/device.txt.
# On 2026-11-26 on one H100, 19 took 170 s and 20 took 317 s (installation 34 s before them).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out" .checks/run
start=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation --no-index -q -e . || exit 1
python3 benchmarks/gpu/device_line.py > "$out/device.txt" 2>&1
for item in "$@"; do
  name=${item%%:*}; limit=${item##*:}
  [ -f ".checks/$name" ] || { echo "no .checks/$name: copy it from ../shared/checks" | tee -a "$out/checks.log"; continue; }
  # the check as shipped, but packing its work folder into $OUT before removing it
  sed "s|trap 'rm -rf \"\$W\"' EXIT|trap 'tar czf \"$out/$name.tgz\" -C \"\$W\" . 2>/dev/null; rm -rf \"\$W\"' EXIT|" \
    ".checks/$name" > ".checks/run/$name"
  t0=$(date +%s)
  echo "== $name (limit $limit s) at +$((t0 - start)) s" | tee -a "$out/checks.log"
  timeout -k 5 "$limit" bash ".checks/run/$name" 2>&1 | tee -a "$out/checks.log"
  echo "== $name rc=${PIPESTATUS[0]} in $(($(date +%s) - t0)) s" | tee -a "$out/checks.log"
  pkill -f rose-run; pkill -f rose-sim; sleep 1  # nothing a timed-out check started outlives it
done
