#!/bin/bash
# session-12 device call (temporary): ring-form tests, variants, memcheck, the H16 sparse FP8 decode case
set -u
S=$(date +%s)
source .gpu/env.sh
export TILELANG_CACHE_DIR=/tmp/tlc
for v in narrow656 regs ring ring16; do
  python -m flashdsa.sparse.kernel_fwd_narrow656 --variants --compile-only $v > $OUT/pre_$v.log 2>&1 &
done
timeout -s KILL 270 python -m pytest -m gpu -v -p no:cacheprovider -p no:benchmark -n 8 --timeout 250 \
  tests/sparse_mla/test_kernel_narrow656_gpu.py -k "ring" > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - S )) s"
grep -E "passed|failed" $OUT/tests.log | tail -1
grep -E "FAILED|ERROR" $OUT/tests.log | head
wait
echo "precompiled $(( $(date +%s) - S )) s"
timeout 120 python -m flashdsa.sparse.kernel_fwd_narrow656 --variants 2>&1 | grep -E "variant|Error" | tee $OUT/variants.log
echo "variants $(( $(date +%s) - S )) s"
FLASHDSA_NARROW_CACHE656=ring timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python scripts/memcheck_small.py sparse_cache656 > $OUT/memcheck_ring.log 2>&1
echo "memcheck ring rc=$? $(( $(date +%s) - S )) s"; tail -2 $OUT/memcheck_ring.log
timeout 80 python -m flashdsa bench --op decode --case H16_sq1_topk --json $OUT/decode_h16_narrow656.json \
  > $OUT/bench_default.log 2>&1
echo "bench default rc=$? $(( $(date +%s) - S )) s"; grep -E "H16" $OUT/bench_default.log | tail -2
if grep -qE "[0-9]+ passed" $OUT/tests.log && ! grep -qE "failed|FAILED|ERROR" $OUT/tests.log; then
  FLASHDSA_NARROW_CACHE656=ring timeout 80 python -m flashdsa bench --op decode --case H16_sq1_topk \
    --json $OUT/decode_h16_ring.json > $OUT/bench_ring.log 2>&1
  echo "bench ring rc=$? $(( $(date +%s) - S )) s"; grep -E "H16" $OUT/bench_ring.log | tail -2
fi
echo "total $(( $(date +%s) - S )) s"
