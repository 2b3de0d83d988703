#!/usr/bin/env bash
# Retrain the SmolLM2-135M EAGLE-1 head from the committed conversations, from scratch,
# on 2 CPU cores in under two hours: fixed text, the feature pass, then two training
# phases (the plain EAGLE-1 recipe, then the training-time test with 3 unrolled steps).
#
#   scripts/reproduce_head.sh [OUT] [PHASE1_MIN] [PHASE2_MIN]
#
# OUT (default runs/repro) receives head_u1/ (phase 1), head/ (the result), the trainer
# checkpoints and times.txt (wall seconds per stage). Every stage resumes where it
# stopped when the script is rerun (features skip written shards, training resumes from
# its checkpoint). Compare the result with the shipped head on held-out prompts:
#   python scripts/ab.py assets/heldout_prompts.jsonl --exclude assets/bench/heldout20.jsonl --head OUT/head
set -euo pipefail
OUT=${1:-runs/repro}
P1=${2:-18}
P2=${3:-55}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
. "$(dirname "$0")/stage.sh"  # stage NAME CMD..., stage_total
stage fixed python -m core.train fixed
stage features python -m core.train features --threads "$THREADS" --head-kind eagle3
stage train_unroll1 python -m core.train train --threads "$THREADS" --unroll 1 --bf16 \
    --minutes "$P1" --out "$OUT/head_u1" --ckpt "$OUT/ckpt_u1"
stage train_unroll3 python -m core.train train --threads "$THREADS" --unroll 3 --bf16 --lr 1e-3 \
    --init "$OUT/head_u1" --minutes "$P2" --out "$OUT/head" --ckpt "$OUT/ckpt_u3"
stage_total
