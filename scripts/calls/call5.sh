# after a dispatch change: the whole GPU suite, then the decode suite (cache .tlc/A, B; M does not fit beside them)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
bash scripts/gpu_cache.sh unpack .tlc/A.tar.xz .tlc/B.tar.xz
SECONDS=0
timeout 330 python -m pytest -m gpu -q -n 14 -p no:cacheprovider --timeout 300 tests > $OUT/tests.log 2>&1
echo "rc=$? in $SECONDS s"; grep -E "passed|failed" $OUT/tests.log | tail -2; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -40
for op in decode; do timeout 120 python -m flashdsa bench --op $op --results-dir $OUT 2>&1 | tail -n 22; done
bash scripts/gpu_cache.sh report
