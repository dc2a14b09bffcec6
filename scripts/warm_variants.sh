#!/bin/bash
# Warm the TileLang cache for a module's --variants rows in parallel (one process per row, each compiles and runs
# its row once), so that the timing run that follows (one process, rows in sequence) does not compile.
#
#   scripts/warm_variants.sh MODULE "EXTRA ARGS" ROW,ROW,...      e.g.
#   scripts/warm_variants.sh flashdsa.sparse.kernel_fwd_pair_cache "--skv 8192" bf16_pair,cache_pair,cache_pair_no_convert
#
# Run on the GPU host after `source .gpu/env.sh` with TILELANG_CACHE_DIR set; logs: $OUT/warm_<row>.log.
set -u
module=$1; extra=$2; rows=$3
start=$(date +%s)
for row in ${rows//,/ }; do
  python -m "$module" --variants $extra --rows "$row" --compile-only > "$OUT/warm_$row.log" 2>&1 &
done
wait
echo "warm $module ($rows): $(( $(date +%s) - start )) s"
grep -lE "Error|Traceback" "$OUT"/warm_*.log 2>/dev/null | sed 's/^/  failed: /'
