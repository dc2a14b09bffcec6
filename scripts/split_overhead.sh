#!/usr/bin/env bash
# Graph-replay and eager times of the decode suite's small-batch cases (the ones that run split-KV,
# decode/kernel_split.py), split and not split ($FLASHDSA_DECODE_SPLIT=0), on the GPU host:
#   bash scripts/split_overhead.sh        (after source .gpu/env.sh; JSON and logs under $OUT)
set -u
out=${OUT:-.}
cases=$(python -c "from flashdsa.bench import suites
print(','.join('decode:' + c.name for c in suites.decode_cases(True) if 'small batch' in c.target))")
for e in "" 0; do
  tag=$([ -z "$e" ] && echo split || echo nosplit)
  FLASHDSA_DECODE_SPLIT=$e python scripts/bench_overhead.py --only-suite-cases --suite-cases "$cases" \
    --json "$out/decode_${tag}_overhead.json" > "$out/overhead_$tag.log" 2>&1
  echo "$tag rc=$?"
  grep -E '^\{' "$out/overhead_$tag.log" | cut -c1-200
done
