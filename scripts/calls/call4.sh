# the whole benchmark suite at this commit (README table), kernels from .tlc/M.tar.xz; JSON under $OUT
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
bash scripts/gpu_cache.sh unpack .tlc/M.tar.xz
for op in indexer topk sparse_mla_fwd sparse_mla_fwd_fp8 sparse_mla_bwd decode; do
  timeout 150 python -m flashdsa bench --op $op --results-dir $OUT 2>&1 | tail -n 25; done
bash scripts/gpu_cache.sh report $OUT/tlc_new_4.tar.xz
