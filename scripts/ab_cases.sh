#!/usr/bin/env bash
# A / B timing of `flashdsa bench` cases under two values of one environment switch, on the GPU host (after
# `source .gpu/env.sh`): graph-replay and eager medians from scripts/bench_overhead.py, JSON and logs under $OUT.
#
#   bash scripts/ab_cases.sh NAME VAR A B CASES
#     NAME   file prefix: $OUT/NAME_<value>_overhead.json ("default" for an empty value)
#     VAR    the switch, e.g. FLASHDSA_DECODE_SPLIT (split-KV; "0" off) or FLASHDSA_DECODE_PAIR_CLUSTER ("1" on)
#     A, B   its two values ("" = unset)
#     CASES  SUITE:CASE,... or "small-decode" (the decode suite's small-batch, split-KV cases)
set -u
name=$1; var=$2; a=$3; b=$4; cases=$5
out=${OUT:-.}
if [ "$cases" = small-decode ]; then
  cases=$(python -c "from flashdsa.bench import suites
print(','.join('decode:' + c.name for c in suites.decode_cases(True) if 'small batch' in c.target))")
fi
for v in "$a" "$b"; do
  tag=${v:-default}
  env "$var=$v" python scripts/bench_overhead.py --only-suite-cases --suite-cases "$cases" \
    --json "$out/${name}_${tag}_overhead.json" > "$out/${name}_$tag.log" 2>&1
  echo "$var=$tag rc=$?"
  grep -E '^\{' "$out/${name}_$tag.log" | cut -c1-220
done
