#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-quantize and llama-perplexity from the llama-cpp-python sdist, and convert HF
# model dirs to BF16 GGUF with the same sources' convert_hf_to_gguf.py, for
# benchmarks/vs_llama_server.py and benchmarks/compare_llamacpp.py.
#
# Usage (from the repository root):
#   benchmarks/llamacpp_setup.sh build                 # llama-server + llama-bench (~15 min on 2 cores; skipped if built)
#   benchmarks/llamacpp_setup.sh convert HF_DIR OUT.gguf   # BF16 GGUF of an HF LlamaForCausalLM dir
#   benchmarks/llamacpp_setup.sh smollm2 [OUT.gguf]    # BF16 GGUF of pagedserve's default model (SmolLM2)
#   benchmarks/llamacpp_setup.sh paths                 # print where things are
#   benchmarks/llamacpp_setup.sh status                # and which of them exist (no download, no build)
#   benchmarks/llamacpp_setup.sh --tiny                # smoke run: the same as status
#
# Environment: LLAMACPP_CACHE (default ~/.cache/pagedserve-llamacpp), LLAMACPP_SDIST (a
# llama_cpp_python-$VERSION.tar.gz already downloaded; otherwise `pip download` fetches it),
# PYTHON (default .venv/bin/python of this checkout, else /work/main/.venv/bin/python; needs
# torch, transformers, safetensors, numpy, sentencepiece-free tokenizers), JOBS (default 2).
# The build runs under `nice -n 10`. The converter's `gguf` package comes from the sdist's
# vendor/llama.cpp/gguf-py via PYTHONPATH; OUTTYPE (default bf16) is the converter's --outtype; the only other download is a sentencepiece wheel
# (pip, pinned) into $LLAMACPP_CACHE/pydeps, which the converter imports.
set -euo pipefail

VERSION=0.3.36
CACHE=${LLAMACPP_CACHE:-$HOME/.cache/pagedserve-llamacpp}
SRC=$CACHE/llama_cpp_python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
BUILD=$CACHE/build
BIN=$CACHE/bin
PYDEPS=$CACHE/pydeps
SENTENCEPIECE=0.2.3
JOBS=${JOBS:-2}
OUTTYPE=${OUTTYPE:-bf16}  # the converter's --outtype (f16: llama.cpp's fast type on CPUs without AVX512-BF16)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=/work/main/.venv/bin/python; fi
fi

unpack() {
  [[ -f $LLAMA/CMakeLists.txt ]] && return 0
  mkdir -p "$CACHE"
  local sdist=${LLAMACPP_SDIST:-}
  if [[ -z $sdist ]]; then
    sdist=$CACHE/llama_cpp_python-$VERSION.tar.gz
    if [[ ! -f $sdist ]]; then
      "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    fi
  fi
  tar xzf "$sdist" -C "$CACHE"
  [[ -f $LLAMA/CMakeLists.txt ]] || { echo "no vendor/llama.cpp in $sdist" >&2; exit 1; }
}

build() {
  if [[ -x $BIN/llama-server && -x $BIN/llama-bench && -x $BIN/llama-quantize && -x $BIN/llama-perplexity ]]; then
    echo "already built: $BIN/llama-server $BIN/llama-bench $BIN/llama-quantize $BIN/llama-perplexity"
    return 0
  fi
  unpack
  nice -n 10 cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
  nice -n 10 cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-server llama-bench llama-quantize llama-perplexity
  mkdir -p "$BIN"
  cp "$BUILD/bin/llama-server" "$BUILD/bin/llama-bench" "$BUILD/bin/llama-quantize" "$BUILD/bin/llama-perplexity" "$BIN/"
  echo "built: $BIN/llama-server $BIN/llama-bench $BIN/llama-quantize $BIN/llama-perplexity"
}

convert() {
  local hf=$1 out=$2
  unpack
  if [[ -f $out ]]; then echo "exists: $out"; return 0; fi
  mkdir -p "$(dirname "$out")"
  # The llama converter imports sentencepiece before it looks for a tokenizer.model (SmolLM2 has
  # none: it falls back to tokenizer.json), so it must be importable; kept out of the venv.
  if [[ ! -d $PYDEPS/sentencepiece ]]; then
    "$PYTHON" -m pip install --no-deps --only-binary :all: --target "$PYDEPS" "sentencepiece==$SENTENCEPIECE"
  fi
  PYTHONPATH=$LLAMA/gguf-py:$PYDEPS${PYTHONPATH:+:$PYTHONPATH} nice -n 10 "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" \
    "$hf" --outtype "$OUTTYPE" --outfile "$out.tmp"
  mv "$out.tmp" "$out"
  echo "converted: $out"
}

smollm2() {
  # pagedserve's default model is a Q4_1 GGUF, served quantized; its cached folder holds only the
  # config and tokenizer. The converter needs float weights and "architectures" in config.json:
  # write the file's tensors dequantized (float32 safetensors, HF names) beside a copy of those.
  local out=${1:-$CACHE/smollm2-bf16.gguf}
  if [[ -f $out ]]; then echo "exists: $out"; return 0; fi
  local hf=$CACHE/smollm2-hf
  (cd "$ROOT" && "$PYTHON" - "$hf" <<'PY'
import json, os, shutil, sys
from safetensors.torch import save_file
from pagedserve.model import loader
src, dst = loader.resolve_model(None), sys.argv[1]
os.makedirs(dst, exist_ok=True)
for name in os.listdir(src):
    if name in ("config.json", "source.json") or name.startswith("."):
        continue
    shutil.copy(os.path.join(src, name), os.path.join(dst, name))
with open(os.path.join(src, "config.json")) as fh:
    cfg = json.load(fh)
cfg["architectures"] = ["LlamaForCausalLM"]
with open(os.path.join(dst, "config.json"), "w") as fh:
    json.dump(cfg, fh, indent=2)
hf_config = loader.load_config(src)
tensors = {name: t.contiguous() for name, t in loader.iterate_weights(src, hf_config, quantized=False)}
save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
print(f"HF dir for the converter: {dst} (float32 weights of {loader.gguf_source(src)})")
PY
  )
  convert "$hf" "$out"
}

status() {
  echo "cache=$CACHE"
  local item name path
  for item in "llama-server:$BIN/llama-server" "llama-bench:$BIN/llama-bench" "converter:$LLAMA/convert_hf_to_gguf.py" \
              "smollm2-gguf:$CACHE/smollm2-bf16.gguf"; do
    name=${item%%:*}; path=${item#*:}
    if [[ -e $path ]]; then echo "$name: present $path"; else echo "$name: absent $path"; fi
  done
}

case "${1:-build}" in
  build) build ;;
  convert) [[ $# -eq 3 ]] || { echo "usage: $0 convert HF_DIR OUT.gguf" >&2; exit 2; }; convert "$2" "$3" ;;
  smollm2) smollm2 "${2:-}" ;;
  paths) echo "cache=$CACHE"; echo "llama-server=$BIN/llama-server"; echo "llama-bench=$BIN/llama-bench";
         echo "converter=$LLAMA/convert_hf_to_gguf.py"; echo "smollm2-gguf=$CACHE/smollm2-bf16.gguf" ;;
  status|--tiny) status ;;
  *) echo "usage: $0 {build|convert HF_DIR OUT.gguf|smollm2 [OUT.gguf]|paths|status|--tiny}" >&2; exit 2 ;;
esac
