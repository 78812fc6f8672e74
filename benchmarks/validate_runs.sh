#!/bin/bash
# calibrate (coarse) -> serve -> validate at concurrency 1, 4, 16 and a Poisson rate; run from a worktree root
set -u
PY=${PY:-.venv/bin/python}
OUT=${OUT:-validate-runs}
mkdir -p $OUT
export PYTHONPATH=$PWD
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ; nproc $(nproc)" > $OUT/host.txt
uptime >> $OUT/host.txt
$PY -m servelab calibrate --out $OUT/profile.json 2>&1 | tail -12 > $OUT/calibrate.txt
uptime >> $OUT/host.txt
$PY -m servelab serve --port 8123 --no-access-log > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -sf 127.0.0.1:8123/health >/dev/null && break; sleep 1; done
for c in 1 4 16; do
  uptime >> $OUT/host.txt
  $PY -m servelab validate --base-url http://127.0.0.1:8123 --profile $OUT/profile.json --concurrency $c \
     --num-requests $((c*6+8)) --input-len 128 --output-len 64 --seed $c --warmup 2 --no-progress \
     --save-result $OUT/c$c.json > $OUT/c$c.txt 2>&1
done
uptime >> $OUT/host.txt
$PY -m servelab validate --base-url http://127.0.0.1:8123 --profile $OUT/profile.json --rate ${RATE:-0.6} \
   --num-requests 40 --input-len 128 --output-len 64 --seed 99 --warmup 2 --no-progress \
   --save-result $OUT/rate.json > $OUT/rate.txt 2>&1
uptime >> $OUT/host.txt
kill $SP; wait $SP
