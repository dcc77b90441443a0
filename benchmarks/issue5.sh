#!/usr/bin/env bash
# Re-measure every issue-5 target in one go (about 4 minutes on the 2-core reference machine;
# run it on a quiet machine: other busy processes make 2-thread OpenMP runs 5-15x slower).
#   bash benchmarks/issue5.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
mkdir -p "$out"
bin=.venv/bin
echo "== W1 throughput vs HF (3 runs)"
for i in 1 2 3; do
  $bin/pagedserve bench throughput --backend both --dtype bfloat16 --output-json "$out/w1_$i.json" 2>/dev/null \
    | grep -E "Throughput|/ hf|Load average"
done
echo "== batch-1 latency"
$bin/pagedserve bench latency --dtype bfloat16 --output-json "$out/latency.json" 2>/dev/null | grep -E "prefill|decode|bandwidth|Load"
echo "== chunked prefill: p99 ITL of 16 streams while a 2,000-token prompt arrives"
$bin/python benchmarks/chunked_prefill_itl.py 2>/dev/null | tail -3
echo "== CPU time outside the forward at 64 running requests"
$bin/python benchmarks/profile_step.py 2>/dev/null | tail -8
echo "== KV pool and peak RSS of a W1 run"
/usr/bin/time -v $bin/pagedserve bench throughput --backend pagedserve --dtype bfloat16 2>&1 \
  | grep -E "KV cache|Throughput|Maximum resident" | sed 's/^INFO [^:]*: //'
