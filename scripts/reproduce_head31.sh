#!/usr/bin/env bash
# Issue 31's head from the committed data: the previous shipped EAGLE-1 head (the one in
# commit INIT_COMMIT, trained by scripts/reproduce_head.sh) continued on the Magpie answers,
# with the training-time test (3 unrolled steps). About 55 min of feature pass and MIN minutes
# of training at 2 threads on a quiet machine: under 3 hours with the default MIN.
#
#   scripts/reproduce_head31.sh [OUT] [MIN]
#
# OUT (default runs/repro31) receives magpie_distill.jsonl (unpacked), init/ (the previous
# head, from git), features_eagle3/ (one pass serves both head kinds), ckpt/, head/ (the
# result) and times.txt. Rerun the same line after a stop: features skip written shards,
# training resumes from ckpt/. Compare with the shipped head on the natural held-out prompts:
#   python scripts/ab.py assets/heldout_natural.jsonl --head OUT/head --tree 3,8,6
set -euo pipefail
OUT=${1:-runs/repro31}
MIN=${2:-115}
THREADS=${THREADS:-2}
INIT_COMMIT=${INIT_COMMIT:-5f56bac}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/init"
. scripts/stage.sh  # stage NAME CMD..., stage_total (the cd above made the repository root the folder)
data="$OUT/magpie_distill.jsonl"
[ -s "$data" ] || gunzip -c assets/train-data/magpie-distill.jsonl.gz | sed -n 1,9048p > "$data"  # the 9,048 it trained on (sed reads to the end: no SIGPIPE under pipefail)
for f in config.json model.safetensors draft_vocab.safetensors; do
    [ -s "$OUT/init/$f" ] || git show "$INIT_COMMIT:assets/smollm2-135m-eagle/$f" > "$OUT/init/$f"
done
stage features python -m core.train features --work "$OUT" --threads "$THREADS" --head-kind eagle3 --data "$data"
stage train python -m core.train train --work "$OUT" --threads "$THREADS" --data "$data" --head-kind eagle1 \
    --init "$OUT/init" --unroll 3 --lr 1e-3 --bf16 --minutes "$MIN" --out "$OUT/head" --ckpt "$OUT/ckpt"
stage_total
