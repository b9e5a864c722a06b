#!/usr/bin/env bash
# Every CPU figure of docs/BENCHMARKS.md, in one go (about an hour on 2 cores with all baselines).
# Writes benchmarks/results/<figure>.json, then benchmarks/summarize.py writes
# benchmarks/results/summary.json, docs/img/*.png and prints the Markdown tables for the docs.
#
#   benchmarks/run_all_cpu.sh                 # everything
#   ONLY="decode_b1_fp32 ttft2048_fp32" benchmarks/run_all_cpu.sh   # a subset (then the summary)
#
# Environment: SERVESCOPE (default .venv/bin/servescope), PYTHON (.venv/bin/python),
# OUT (benchmarks/results), THREADS (torch threads for ours and the baselines; default: all cores).
# A figure that fails is logged in $OUT/failures.txt and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
SS="${SERVESCOPE:-.venv/bin/servescope}"
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-benchmarks/results}"
THREADS="${THREADS:-$(nproc)}"
ONLY="${ONLY:-}"
mkdir -p "$OUT" docs/img
[[ -z "$ONLY" ]] && : > "$OUT/failures.txt"

run() {
  local name=$1; shift
  if [[ -n "$ONLY" && " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" || echo "$name failed (exit $?): $*" | tee -a "$OUT/failures.txt"
  echo "== $name took $((SECONDS - t0)) s"
}

# re-measure the roofline (memory bandwidth, matmul rates) at this thread count on the machine as it is
# now: the probe's result is cached per CPU and thread count, and the % of roofline figures divide by it
run probe $PY -c "import torch; torch.set_num_threads($THREADS)
from servescope.analysis.probe import probe_local_hardware as p; s = p(force=True)
print(f'probe: {s.memory_bandwidth / 1e9:.1f} GB/s, ' + ', '.join(f'{k} {v / 1e9:.0f} GFLOP/s' for k, v in s.peak_flops.items()))"

LAT="$SS bench latency --threads $THREADS --iters 3"
# issue 3 / issue 7: 64 requests, input 32..512, output 32..256, ignore_eos, seed 0; HF in padded batches of 16
run throughput_fp32 $SS bench throughput --threads $THREADS --dtype float32 --baseline hf --baseline llama-cpp \
    --json "$OUT/throughput_fp32.json"
run throughput_bf16 $SS bench throughput --threads $THREADS --dtype bfloat16 --baseline hf \
    --json "$OUT/throughput_bf16.json"
# issue 7: decode at batch 1 (128-token prompt, 128 new tokens)
run decode_b1_fp32 $LAT --dtype float32 --batch-size 1 --input-len 128 --output-len 128 \
    --baseline hf --baseline llama-cpp --json "$OUT/decode_b1_fp32.json"
run decode_b1_bf16 $LAT --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 128 --baseline hf \
    --json "$OUT/decode_b1_bf16.json"
run decode_b1_int8 $LAT --dtype float32 --quantization int8 --batch-size 1 --input-len 128 --output-len 128 \
    --json "$OUT/decode_b1_int8.json"
# issue 7: TTFT of a 2048-token prompt, whole prompt in one step
run ttft2048_fp32 $LAT --dtype float32 --batch-size 1 --input-len 2048 --output-len 2 \
    --max-num-batched-tokens 2048 --baseline hf --baseline llama-cpp --json "$OUT/ttft2048_fp32.json"
run ttft2048_bf16 $LAT --dtype bfloat16 --batch-size 1 --input-len 2048 --output-len 2 \
    --max-num-batched-tokens 2048 --baseline hf --json "$OUT/ttft2048_bf16.json"
# decode step time vs batch size (the memory-bandwidth bottleneck)
run decode_batch_sweep $PY benchmarks/decode_batch_sweep.py --threads "$THREADS" \
    --json "$OUT/decode_batch_sweep.json" --plot docs/img/decode_batch_sweep.png
# our server under Poisson load at several rates
run serve_sweep $PY benchmarks/serve_sweep.py --json "$OUT/serve_sweep.json" --plot docs/img/serve_sweep.png

$PY benchmarks/summarize.py --results "$OUT" --img docs/img
