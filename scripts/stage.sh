# Sourced by the retraining scripts: `stage NAME CMD...` runs CMD and appends its wall
# seconds to $OUT/times.txt; `stage_total` prints them and their sum.
stage() {
    local name=$1 t0
    shift
    t0=$(date +%s)
    echo "== $name: $*"
    "$@"
    echo "$name $(( $(date +%s) - t0 ))" >> "$OUT/times.txt"
}
stage_total() {
    awk '{s += $2; print} END {printf "total %d s (%.1f min)\n", s, s / 60}' "$OUT/times.txt"
}
