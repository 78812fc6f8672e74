#!/bin/bash
# calibrate (coarse, with the serving term) -> serve -> validate at concurrency 1, 4, 16 and a
# Poisson rate; run from a worktree root. Writes $OUT/{profile.json,calibrate.txt,c1,c4,c16,rate}.{txt,json}
# and host.txt (CPU, load average before each stage). Extra calibrate flags: CALIBRATE_FLAGS;
# THINK=20ms gives the closed loops that think time (bench sleeps it, the replay prices it).
# Ends by printing docs/fidelity.md's rows (benchmarks/validate_table.py), also in $OUT/table.md.
set -u
PY=${PY:-.venv/bin/python}
OUT=${OUT:-validate-runs}
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p $OUT
export PYTHONPATH=$PWD
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ; nproc $(nproc)" > $OUT/host.txt
echo "calibrate: $(uptime)" >> $OUT/host.txt
$PY -m servelab calibrate --out $OUT/profile.json --server-term ${CALIBRATE_FLAGS:-} > $OUT/calibrate.txt 2>&1 || {
  echo "calibrate failed (see $OUT/calibrate.txt)"; exit 1; }
$PY -m servelab serve --port $PORT --no-access-log --no-lab --step-log $OUT/steps.jsonl > $OUT/server.log 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null; wait $SP 2>/dev/null' EXIT
for i in $(seq 300); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
for c in 1 4 16; do
  echo "c$c: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
  $PY -m servelab validate --base-url http://127.0.0.1:$PORT --profile $OUT/profile.json --concurrency $c \
     --num-requests $((c*6+8)) --input-len 128 --output-len 64 --seed $c --warmup 2 --no-progress ${THINK:+--think-time $THINK} \
     --step-log $OUT/steps.jsonl --save-result $OUT/c$c.json > $OUT/c$c.txt 2>&1
done
echo "rate: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
$PY -m servelab validate --base-url http://127.0.0.1:$PORT --profile $OUT/profile.json --rate ${RATE:-0.6} \
   --num-requests 40 --input-len 128 --output-len 64 --seed 99 --warmup 2 --no-progress \
   --step-log $OUT/steps.jsonl --save-result $OUT/rate.json > $OUT/rate.txt 2>&1
echo "end: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
kill $SP 2>/dev/null; wait $SP 2>/dev/null
$PY benchmarks/validate_table.py $OUT | tee $OUT/table.md
