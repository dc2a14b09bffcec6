# call A: the whole non-sparse GPU suite under poisoned allocations, kernels from the CPU-built cache (.tlc/A.tar.xz)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
bash scripts/gpu_cache.sh unpack .tlc/A.tar.xz
SECONDS=0
timeout 500 python -m pytest -m gpu -q -n 14 -p no:cacheprovider --timeout 300 tests/decode tests/indexer \
  tests/topk tests/test_cache.py tests/test_reference_gpu.py tests/test_host_path_gpu.py > $OUT/testsA.log 2>&1
echo "rc=$? in $SECONDS s"; grep -E "passed|failed" $OUT/testsA.log | tail -2; grep -E "^(FAILED|ERROR)" $OUT/testsA.log | head -40
bash scripts/gpu_cache.sh report $OUT/tlc_new_A.tar.xz
