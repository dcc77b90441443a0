#!/usr/bin/env bash
# W1 (pagedserve bench throughput defaults) with the step trace on (the default ring buffer of
# 1024 records), off (--trace-buffer-steps 0) and on plus a JSON-lines file (--trace-file),
# interleaved ROUNDS times so that a drifting machine hits every mode alike. Prints output tok/s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/pagedserve-trace-overhead}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for mode in on off file; do
    case $mode in
      on) flags=() ;;
      off) flags=(--trace-buffer-steps 0) ;;
      file) flags=(--trace-file "$OUT/trace-$i.jsonl") ;;
    esac
    $PY -m pagedserve.entrypoints.cli --log-level warning bench throughput --peak-tflops 1 "${flags[@]}" \
      --output-json "$OUT/$mode-$i.json" "$@" > /dev/null
    $PY -c "import json, sys; r = json.load(open(sys.argv[1]))['results']['pagedserve']; print(sys.argv[2], sys.argv[3], f\"{r['output_tokens_per_s']:.1f} output tok/s\")" \
      "$OUT/$mode-$i.json" "$mode" "$i"
  done
done
