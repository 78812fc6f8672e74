#!/bin/bash
# calibrate (coarse, with the serving term) -> serve -> validate at concurrency 1, 4, 16 and a
# Poisson rate; run from a worktree root. Writes $OUT/{profile.json,calibrate.txt,c1,c4,c16,rate}.{txt,json}
# and host.txt (CPU, load average before each stage). Extra calibrate flags: CALIBRATE_FLAGS;
# THINK=20ms gives the closed loops that think time (bench sleeps it, the replay prices it).
# QUICK=1 checks the pipeline in about a minute: a tiny random model (tests/tiny_models.py)
# simulated as the catalog's smollm2-135m, short loads, any fit accepted; its figures mean nothing.
# Ends by printing docs/fidelity.md's rows (benchmarks/validate_table.py), also in $OUT/table.md.
set -u
PY=${PY:-.venv/bin/python}
OUT=${OUT:-validate-runs}
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p $OUT
export PYTHONPATH=$PWD
MODEL_FLAGS= SIM_FLAGS= FIT_FLAGS= IN_LEN=128 OUT_LEN=64 PER_C=6 EXTRA=8 RATE_N=40 RATE=${RATE:-0.6}
if [ -n "${QUICK:-}" ]; then
  $PY -c 'import sys; from tests.tiny_models import write_tiny_llama; write_tiny_llama(sys.argv[1])' $OUT/model || exit 1
  MODEL_FLAGS="--model $OUT/model" SIM_FLAGS="--sim-model smollm2-135m" FIT_FLAGS="--max-heldout-error 1e9"
  IN_LEN=32 OUT_LEN=16 PER_C=1 EXTRA=3 RATE_N=12 RATE=${QUICK_RATE:-8}
fi
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ; nproc $(nproc)" > $OUT/host.txt
echo "calibrate: $(uptime)" >> $OUT/host.txt
$PY -m servelab calibrate --out $OUT/profile.json --server-term $MODEL_FLAGS $SIM_FLAGS $FIT_FLAGS ${CALIBRATE_FLAGS:-} \
  > $OUT/calibrate.txt 2>&1 || { echo "calibrate failed (see $OUT/calibrate.txt)"; exit 1; }
$PY -m servelab serve --port $PORT --no-access-log --no-lab --step-log $OUT/steps.jsonl $MODEL_FLAGS > $OUT/server.log 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null; wait $SP 2>/dev/null' EXIT
for i in $(seq 300); do curl -sf 127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
for c in 1 4 16; do
  echo "c$c: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
  $PY -m servelab validate --base-url http://127.0.0.1:$PORT --profile $OUT/profile.json $SIM_FLAGS --concurrency $c \
     --num-requests $((c*PER_C+EXTRA)) --input-len $IN_LEN --output-len $OUT_LEN --seed $c --warmup 2 --no-progress \
     ${THINK:+--think-time $THINK} --step-log $OUT/steps.jsonl --save-result $OUT/c$c.json > $OUT/c$c.txt 2>&1
done
echo "rate: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
$PY -m servelab validate --base-url http://127.0.0.1:$PORT --profile $OUT/profile.json $SIM_FLAGS --rate $RATE \
   --num-requests $RATE_N --input-len $IN_LEN --output-len $OUT_LEN --seed 99 --warmup 2 --no-progress \
   --step-log $OUT/steps.jsonl --save-result $OUT/rate.json > $OUT/rate.txt 2>&1
echo "end: $(uptime); steps logged $(wc -l < $OUT/steps.jsonl)" >> $OUT/host.txt
kill $SP 2>/dev/null; wait $SP 2>/dev/null
$PY benchmarks/validate_table.py $OUT | tee $OUT/table.md
