set -u
export FLASHDSA_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
source .gpu/env.sh; export TILELANG_CACHE_DIR=/tmp/tlc
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
cd scripts
timeout -s KILL 560 python sweep_env.py FLASHDSA_L2_ROWS 0,1,3 \
  sparse_mla_fwd:V4_sparse_attn_decode_b128_m1_n8192_h64_d512_topk640_sink \
  decode:sparse_fp8_B128_H64_sq1_topk2048_cache32768 \
  decode:sparse_fp8_B128_H128_sq2_topk2048_cache32768 \
  decode:dense_bf16_B128_H128_sq1_cache8192 \
  sparse_mla_fwd:V32_S4096_SKV131072_H128_topk2048 \
  sparse_mla_fwd:V32_S4096_SKV8192_H128_topk2048 \
  decode:dense_bf16_B128_H128_sq2_cache32768_causal \
  --warm --json $OUT/sweep_l2_rows.json 2>&1 | grep -v "TileLang\|Warning\|warn"
