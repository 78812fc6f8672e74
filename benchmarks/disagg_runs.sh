#!/bin/bash
# One worker vs --data-parallel 2 vs --disagg 1:1 on long prompts joining steady decodes, each
# on a fresh server with the same requests (one trace, one seed), then `sim` replaying the same
# trace with calibrate profiles. Run from a worktree root; docs/disaggregation.md quotes it.
# QUICK=1 checks the pipeline in about a minute: a tiny random model (tests/tiny_models.py), a
# shorter trace, any fit accepted; its figures mean nothing.
set -u
PY=${PY:-.venv/bin/python}
OUT=${OUT:-disagg-runs}
mkdir -p $OUT
export PYTHONPATH=$PWD
# a float32 KV cache in the engines, as the simulator below prices the transfers (docs/disaggregation.md)
MODEL_FLAGS="--kv-cache-dtype float32" FIT_FLAGS= SIM_MODEL=smollm2-135m DECODES=3 DECODE_OUT=160 LONG=5 LONG_EVERY=3.0
if [ -n "${QUICK:-}" ]; then
  $PY -c 'import sys; from tests.tiny_models import write_tiny_llama; write_tiny_llama(sys.argv[1])' $OUT/model || exit 1
  MODEL_FLAGS="--model $OUT/model --kv-cache-dtype float32" FIT_FLAGS="--max-heldout-error 1e9" SIM_MODEL=$OUT/model DECODE_OUT=48 LONG=3 LONG_EVERY=0.3
fi
# $DECODES steady decodes from t=0 (64-token prompts, $DECODE_OUT tokens out), then a 512-token
# prompt (8 out) every $LONG_EVERY s from t=1.5 s (QUICK: t=0.1 s): each long prefill lands on running decodes.
$PY - $DECODES $DECODE_OUT $LONG $LONG_EVERY ${QUICK:+0.1} > $OUT/trace.jsonl <<'PYEOF'
import json, sys
decodes, decode_out, long, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
first = float(sys.argv[5]) if len(sys.argv) > 5 else 1.5
for i in range(decodes):
    print(json.dumps({"arrival_s": 0.0, "prompt_tokens": 64, "output_tokens": decode_out}))
for i in range(long):
    print(json.dumps({"arrival_s": first + every * i, "prompt_tokens": 512, "output_tokens": 8}))
PYEOF
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ; nproc $(nproc)" > $OUT/host.txt
uptime >> $OUT/host.txt
# profiles: 2 threads (one worker has the host) and 1 thread (each of two workers has a core)
$PY -m servelab calibrate --out $OUT/profile-t2.json --hardware-out $OUT/host.json $MODEL_FLAGS $FIT_FLAGS 2>&1 \
  | tail -3 > $OUT/calibrate-t2.txt
$PY -m servelab calibrate --threads 1 --out $OUT/profile-t1.json $MODEL_FLAGS $FIT_FLAGS 2>&1 | tail -3 > $OUT/calibrate-t1.txt
for mode in one dp2 disagg; do
  case $mode in
    one) flags="" ;;
    dp2) flags="--data-parallel 2" ;;
    disagg) flags="--disagg 1:1" ;;
  esac
  uptime >> $OUT/host.txt
  $PY -m servelab serve --port 0 --no-lab --no-access-log $flags $MODEL_FLAGS > $OUT/server-$mode.log 2>&1 &
  SP=$!
  URL=
  for i in $(seq 300); do
    URL=$(grep -o 'http://127.0.0.1:[0-9]*' $OUT/server-$mode.log | head -1)
    [ -n "$URL" ] && curl -sf $URL/health >/dev/null && break
    sleep 1
  done
  $PY -m servelab bench --base-url $URL --trace $OUT/trace.jsonl --seed 7 --no-progress \
     --save-result $OUT/bench-$mode.json --requests-out $OUT/requests-$mode.jsonl > $OUT/bench-$mode.txt 2>&1
  curl -s $URL/metrics | grep -E '^servelab:kv_transfer_(seconds|bytes|decode_queue_seconds)_(sum|count)' > $OUT/metrics-$mode.txt
  kill $SP; wait $SP
done
uptime >> $OUT/host.txt
# the server's router (least-outstanding) and the loopback bandwidth of benchmarks/kv_transfer.py
SIM="$PY -m servelab sim --model $SIM_MODEL --hardware $OUT/host.json --dtype float32 --kv-cache-dtype float32 \
     --trace $OUT/trace.jsonl --router least-outstanding --no-progress"
$SIM --profile $OUT/profile-t2.json --json > $OUT/sim-one.json
for p in t1 t2; do
  $SIM --profile $OUT/profile-$p.json --replicas 2 --json > $OUT/sim-dp2-$p.json
  $SIM --profile $OUT/profile-$p.json --disagg 1:1 --link-bandwidth ${LINK_GBPS:-0.4} --json > $OUT/sim-disagg-$p.json
done
$PY - $OUT > $OUT/table.txt <<'PYEOF'
import json, sys
out = sys.argv[1]
def load(name):
    return json.load(open(f"{out}/{name}.json"))["summary"]
rows = [("TTFT p50", "ttft_s", "p50"), ("TTFT p90", "ttft_s", "p90"), ("ITL p50", "itl_s", "p50"),
        ("ITL p90", "itl_s", "p90"), ("ITL p99", "itl_s", "p99"), ("ITL max", "itl_s", "max"),
        ("TPOT mean", "tpot_s", "mean"), ("E2E max", "e2e_s", "max")]
runs = [("one worker", "bench-one", ["sim-one"]), ("--data-parallel 2", "bench-dp2", ["sim-dp2-t1", "sim-dp2-t2"]),
        ("--disagg 1:1", "bench-disagg", ["sim-disagg-t1", "sim-disagg-t2"])]
for label, bench, sims in runs:
    b = load(bench)
    ss = [(s, load(s)) for s in sims]
    print(f"\n{label}: measured vs " + ", ".join(s for s, _ in ss))
    print(f"{'':12}{'measured':>10}" + "".join(f"{s.replace('sim-', 'sim '):>17}{'err':>7}" for s, _ in ss))
    for name, key, q in rows:
        m = b[key][q]
        line = f"{name:12}{m:>9.2f}s"
        for _, s in ss:
            v = s[key][q]
            line += f"{v:>16.2f}s" + (f"{(v - m) / m:>+7.0%}" if m else f"{'-':>7}")  # tokens in one chunk: ITL 0
        print(line)
PYEOF
