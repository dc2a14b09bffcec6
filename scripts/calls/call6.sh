# the other suites for the README table (cache .tlc/M.tar.xz)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
bash scripts/gpu_cache.sh unpack .tlc/M.tar.xz
for op in "$@"; do timeout 150 python -m flashdsa bench --op $op --results-dir $OUT 2>&1 | tail -n 22; done
bash scripts/gpu_cache.sh report
