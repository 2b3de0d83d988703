#!/usr/bin/env bash
# The GPU check (core.gpucheck) on a CUDA machine, in one command of about 8 minutes:
# tiny smoke test, then vicuna-7b and llama-3-8b (random weights, real shapes) in fp16 and nf4.
#
#   bash scripts/gpu_run.sh            # results in $OUT (default runs/gpu) and assets/bench/gpu/
#
# Made for a machine with torch and transformers but no bitsandbytes and no network: carry
# the wheel along (about 43 MB; it holds the CUDA kernels for every CUDA version):
#   pip download bitsandbytes==0.50.2 --no-deps --only-binary=:all: \
#       --platform manylinux_2_24_x86_64 --python-version 3.11 -d wheels/
# Every wheel in wheels/ is installed with --no-deps --no-index (e.g. a transformers wheel
# too, should the installed one lack what the engine uses).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
DEST=assets/bench/gpu
RATIO=5.13  # H200 4.8 TB/s / RTX 3090 0.936 TB/s: memory-bound projection to a 3090
mkdir -p "$OUT" "$DEST"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# the nf4 path saves the random fp16 model (13-16 GB) once; RAM-backed if there is room
if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt 40000000 ] 2>/dev/null; then
    export TMPDIR=/dev/shm
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    if compgen -G "wheels/*.whl" > /dev/null; then
        pip install --quiet --no-deps --no-index wheels/*.whl
    fi
    python - <<'EOF'
import importlib.util, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__)
for m in ("bitsandbytes", "accelerate", "tokenizers", "safetensors", "tqdm"):
    print(m, "present" if importlib.util.find_spec(m) else "MISSING")
EOF
} 2>&1 | tee "$OUT/setup.log"

run() {  # name, time limit in seconds, gpucheck arguments...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): python -m core.gpucheck $*"
    timeout "$limit" python -m core.gpucheck --out "$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name exit ${PIPESTATUS[0]} after ${SECONDS}s in total"
    if [ -f "$OUT/$name/gpucheck.json" ]; then
        mkdir -p "$DEST/$name" && cp "$OUT/$name"/gpucheck.* "$DEST/$name/"
    fi
}

# tiny first: proves the whole path on CUDA (engine, tree mask, cache, nf4) in seconds
run tiny 60 --shape tiny --device cuda --quant fp32,nf4 --new-tokens 32
run vicuna-7b 200 --shape vicuna-7b --device cuda --quant fp16,nf4 --bandwidth-ratio "$RATIO"
run llama-3-8b 200 --shape llama-3-8b --device cuda --quant fp16,nf4 --bandwidth-ratio "$RATIO"
ls -l "$OUT" "$DEST"
