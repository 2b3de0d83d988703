#!/usr/bin/env bash
# The head shipped on 2026-12-06 (seventeenth session), in two runs from the previous EAGLE-1 head (INIT_COMMIT's),
# both with the depth-1 recipe (no unroll: the served trees on the 8-bit step draft one head token), checked on
# 272 held-out Magpie conversations at every checkpoint (the best head checked is each run's result; PATIENCE > 0:
# stop after that many checks without a better one):
#   1. (sixteenth session) on 8,244 Magpie answers it never saw plus a replay of 2,087 it did, MIN minutes -> head/;
#   2. (seventeenth session) head/ continued on every Magpie conversation but the held-out ones (13,371 sequences,
#      the last 3,040 conversations added), MIN2 minutes -> head_all/, the shipped weights.
# About 45-60 min of feature pass (3.3 M tokens with the prompts), 11 min more for the last conversations, and
# MIN + MIN2 minutes of training at 2 threads: about 2.5 h.
#
#   scripts/reproduce_head_all.sh [OUT] [MIN] [MIN2]
#
# OUT (default runs/repro_all) receives the conversation files (lines of the committed
# assets/train-data/magpie-distill.jsonl.gz), init/ (the starting head, from git), features_eagle3/ and
# features_eagle3_heldout/ (one feature pass serves both head kinds), ckpt/ and ckpt_all/ (each with best/ and
# best.json), all/ (run 2's work folder), head/ and head_all/ (the results) and times.txt. Rerun the same line after a stop: features skip
# written shards, training resumes from its checkpoint. Compare with the shipped head through the engine on the
# natural held-out prompts:
#   python scripts/ab.py assets/heldout_natural.jsonl --head OUT/head_all --plain
set -euo pipefail
OUT=${1:-runs/repro_all}
MIN=${2:-32}
MIN2=${3:-60}
LR=${LR:-1e-4}
PATIENCE=${PATIENCE:-0}
THREADS=${THREADS:-2}
INIT_COMMIT=${INIT_COMMIT:-895fb1f}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/init" "$OUT/data"
. scripts/stage.sh  # stage NAME CMD..., stage_total (the cd above made the repository root the folder)
all="$OUT/data/magpie_distill.jsonl"
[ -s "$all" ] || gunzip -c assets/train-data/magpie-distill.jsonl.gz > "$all"
# the folders' names order the training sequences (fresh, new, old, train): the same order as the run measured
part() { [ -s "$OUT/data/$1.jsonl" ] || sed -n "$2,$3p" "$all" > "$OUT/data/$1.jsonl"; }
part old 1 2087         # a replay of answers the starting head trained on
part train 9049 10248   # the thirteenth session's answers ...
part fresh 10249 11200
part val 11201 11472    # ... less 272 held out (never trained on by any head)
part new 11473 17564    # the next 6,092 (the fourteenth and fifteenth sessions'; the run measured stopped its
                        # feature pass there, at 04:00 UTC, to leave an hour for training)
for f in config.json model.safetensors draft_vocab.safetensors; do
    [ -s "$OUT/init/$f" ] || git show "$INIT_COMMIT:assets/smollm2-135m-eagle/$f" > "$OUT/init/$f"
done
stage features python -m core.train features --work "$OUT" --threads "$THREADS" --head-kind eagle3 \
    --layer-ids 2,15,27 --data "$OUT/data/old.jsonl" --data "$OUT/data/train.jsonl" --data "$OUT/data/fresh.jsonl" \
    --data "$OUT/data/new.jsonl" --val-data "$OUT/data/val.jsonl"
stage train python -m core.train train --work "$OUT" --threads "$THREADS" --head-kind eagle1 --init "$OUT/init" \
    --unroll 1 --lr "$LR" --bf16 --minutes "$MIN" --patience "$PATIENCE" --val-data "$OUT/data/val.jsonl" \
    --out "$OUT/head" --ckpt "$OUT/ckpt"
# run 2 reads the features of run 1 (linked) and of the last 3,040 conversations (798 of them follow-ups of
# earlier openings) from a work folder of its own, so run 1 still resumes on its own data after a stop
part rest 17565 20604
mkdir -p "$OUT/all/features_eagle3"
for d in fresh new old train; do ln -sfn "../../features_eagle3/$d" "$OUT/all/features_eagle3/$d"; done
ln -sfn ../features_eagle3_heldout "$OUT/all/features_eagle3_heldout"
stage features_rest python -m core.train features --work "$OUT/all" --threads "$THREADS" --head-kind eagle3 \
    --layer-ids 2,15,27 --data "$OUT/data/rest.jsonl" --val-data "$OUT/data/val.jsonl"
stage train_all python -m core.train train --work "$OUT/all" --threads "$THREADS" --head-kind eagle1 --init "$OUT/head" \
    --unroll 1 --lr "$LR" --bf16 --minutes "$MIN2" --patience "$PATIENCE" --val-data "$OUT/data/val.jsonl" \
    --out "$OUT/head_all" --ckpt "$OUT/ckpt_all"
stage_total
