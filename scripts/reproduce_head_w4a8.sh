#!/usr/bin/env bash
# The shipped head continued on features in the numerics it is served in: the embedded model's
# native decode step on the GGUF's 4-bit weights x 8-bit activations (w4a8, the default), where
# the head was trained on bf16 features before (same tree, 60 natural prompts: tau 1.98 served
# on bf16 weights against 1.85 on w4a8). The first CONVS Magpie conversations of the committed
# answers; the prompt before each last answer prefilled through transformers, as the engine
# prefills a chat (core.train.features.native_features). About 16 min of feature pass and MIN
# minutes of training at 2 threads on a quiet machine.
#
#   scripts/reproduce_head_w4a8.sh [OUT] [MIN]
#
# OUT (default runs/repro_w4a8) receives magpie<CONVS>.jsonl, init/ (the head it continues, from
# git), features/ (w4a8), ckpt/, head/ (the result) and times.txt. Rerun the same line after a
# stop: features skip written shards, training resumes from ckpt/. Measured 2026-12-04 (docs/training.md):
# +0.2 to +1.2% tau against the shipped head, no speed gain, not shipped. Compare with the shipped head:
#   python scripts/ab.py assets/heldout_natural.jsonl --limit 60 --head OUT/head --plain
set -euo pipefail
OUT=${1:-runs/repro_w4a8}
MIN=${2:-40}
THREADS=${THREADS:-2}
CONVS=${CONVS:-3500}
INIT_COMMIT=${INIT_COMMIT:-a31b631}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/init"
. scripts/stage.sh  # stage NAME CMD..., stage_total (the cd above made the repository root the folder)
data="$OUT/magpie$CONVS.jsonl"
[ -s "$data" ] || gunzip -c assets/train-data/magpie-distill.jsonl.gz | sed -n "1,${CONVS}p" > "$data"  # sed, not head: no SIGPIPE under pipefail
for f in config.json model.safetensors draft_vocab.safetensors; do
    [ -s "$OUT/init/$f" ] || git show "$INIT_COMMIT:assets/smollm2-135m-eagle/$f" > "$OUT/init/$f"
done
stage features python -m core.train features --work "$OUT" --threads "$THREADS" --data "$data" \
    --feature-weights w4a8
stage train python -m core.train train --work "$OUT" --threads "$THREADS" --data "$data" --head-kind eagle1 \
    --init "$OUT/init" --unroll 3 --lr 1e-3 --bf16 --minutes "$MIN" --out "$OUT/head" --ckpt "$OUT/ckpt"
stage_total
