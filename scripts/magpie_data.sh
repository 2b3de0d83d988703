#!/usr/bin/env bash
# Self-written prompts and their answers (issue 31, items 1-2), in the background next to
# other work: one thread, niced, resumable. Rerun the same line after a stop or a reboot and
# each stage continues where it stopped (magpie at its next batch, distill skips answered ids).
#
#   nohup nice -n 10 scripts/magpie_data.sh [COUNT] > runs/train/magpie.log 2>&1 &
#
# 1. magpie: COUNT (default 20000) user prompts -> runs/train/magpie.jsonl (a prompt needs no exact
#    numerics; bf16 where the CPU multiplies bf16 natively (avx512_bf16: 1.4x the rows per hour of fp32
#    at batch 32 on the Intel AMX VM), else fp32: on the AVX2-only AMD Zen 3 VM, 2 threads, 2026-12-06,
#    fp32 kept ~3,400 prompts an hour and bf16 ~340, torch having no AVX2 bf16 GEMM); carves
#    assets/heldout_natural.jsonl once 2,000 exist.
# 2. distill: their answers, half greedy and half at T 0.7, by the app's own engine in the served
#    numerics, 32 answers at a time as branches of one cache (core.decoding.batched: each the
#    engine's own answer token for token; 320 answer tokens/s at two threads, 1.5-2x one answer at
#    a time) -> runs/train/magpie_distill.jsonl; the natural held-out prompts are never answered.
#    (The first 1,776 answers came from the batched transformers distiller, bf16.)
# Then, by hand: `python -m core.train magpie --followups` and distill its file the same way.
set -euo pipefail
COUNT=${1:-20000}
cd "$(dirname "$0")/.."
. .venv/bin/activate
DTYPE=float32
grep -q avx512_bf16 /proc/cpuinfo && DTYPE=bfloat16
python -m core.train magpie --threads 1 --count "$COUNT" --distill-dtype "$DTYPE"
python -m core.train distill --threads 1 --prompt-file runs/train/magpie.jsonl \
    --answers runs/train/magpie_distill.jsonl --sampled-fraction 0.5 --distiller engine --batch-size 32
