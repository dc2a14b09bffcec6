# call B: the sparse forward / backward / FP8 GPU files, then memcheck of the session-42 targets (cache .tlc/B.tar.xz)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
bash scripts/gpu_cache.sh unpack .tlc/B.tar.xz .tlc/M.tar.xz
SECONDS=0
timeout 420 python -m pytest -m gpu -q -n 14 -p no:cacheprovider --timeout 300 tests/sparse_mla > $OUT/testsB.log 2>&1
echo "rc=$? in $SECONDS s"; grep -E "passed|failed" $OUT/testsB.log | tail -2; grep -E "^(FAILED|ERROR)" $OUT/testsB.log | head -40
for t in sparse_bf16_extras sparse_bf16_512 sparse_bf16_h48 sparse_cache656_extras sparse_fp8_extras indexer_prefill decode_pair; do
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/memcheck_small.py $t 2>&1 | tail -1; done
bash scripts/gpu_cache.sh report $OUT/tlc_new_B.tar.xz
