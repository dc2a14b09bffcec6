# session 41's prepared call: #6 H 16 FP8 decode builds mma / mma_par / mma_ws / mma_ws_par (cache .tlc/M.tar.xz)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc FLASHDSA_COMMIT=$(cat .commit)
bash scripts/gpu_cache.sh unpack .tlc/M.tar.xz .tlc/B.tar.xz
for f in mma mma_par mma_ws mma_ws_par; do python -m flashdsa.sparse.kernel_fwd_narrow656 --variants --compile-only $f > /tmp/compile_$f.log 2>&1 & done; wait
tail -n 2 /tmp/compile_*.log
timeout 300 python -m pytest -m gpu -q -x -n 14 -p no:cacheprovider tests/sparse_mla/test_kernel_narrow656_gpu.py -k mma 2>&1 | tail -15
compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/memcheck_small.py sparse_cache656_mma_par sparse_cache656_mma_ws_par 2>&1 | tail -5
python -m flashdsa.sparse.kernel_fwd_narrow656 --variants mma mma_par mma_ws mma_ws_par 2>&1 | tail -20
python scripts/row_gather_probe.py --modes bulk --warps 4,8 --stages 2,4 --place packed,parity,co128 --json $OUT/row_gather.json 2>&1 | tail -30
(cd scripts && timeout 90 python bulk_issue_probe.py 2>&1 | tail -20)
bash scripts/gpu_cache.sh report $OUT/tlc_new_3.tar.xz
