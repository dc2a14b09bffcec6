#!/bin/bash
# The first device call planned for session 7 (docs/ROADMAP.md, "First commands"): opt-in narrow FP8-cache kernel
# tests + memcheck, the forward ablations (H 64), the gather probe, the host-overhead profile.  If the opt-in passes,
# a second call: FLASHDSA_NARROW_CACHE656=1 python -m flashdsa bench --op decode --results-dir "$OUT/optin" (commit
# that JSON as a _variants_ document, not as the suite's).
# Run from the repo root on the GPU host: FLASHDSA_COMMIT=<sha> bash scripts/next_session_gpu.sh
# Everything goes to $OUT (logs, JSON); each step has its own time limit (~8 min in all on a cold host).
set -u
source .gpu/env.sh
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlc}
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

step "narrow cache656 tests (opt-in)"
FLASHDSA_NARROW_CACHE656=1 timeout -s KILL 150 python -m pytest -m gpu -q -p no:cacheprovider -n 14 --timeout 140 \
  tests/sparse_mla/test_kernel_fp8cache_gpu.py tests/decode/test_sparse_gpu.py > "$OUT/tests_c656.log" 2>&1
echo "rc=$?"; grep -E "passed|failed" "$OUT/tests_c656.log" | tail -1; grep -E "^(FAILED|ERROR)" "$OUT/tests_c656.log" | head

step "memcheck sparse_cache656 (opt-in)"
FLASHDSA_NARROW_CACHE656=1 timeout -s KILL 80 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python scripts/memcheck_small.py sparse_cache656 > "$OUT/memcheck_c656.log" 2>&1
echo "rc=$?"; grep -E "ERROR SUMMARY|ok|MISMATCH" "$OUT/memcheck_c656.log" | head -4

step "forward ablations"
timeout -s KILL 120 python -m flashdsa.sparse.kernel_fwd --ablate 2>&1 | grep -E "^ablate" | tee "$OUT/fwd_ablate.txt"

step "gather probe (cpasync, deep)"
timeout -s KILL 60 python -m flashdsa.sparse._gather_probe 2>&1 | grep -E "TB/s" | tee "$OUT/gather_probe.txt"

step "host overhead profile"
timeout -s KILL 60 python -m cProfile -s cumtime scripts/bench_overhead.py --json "$OUT/overhead.json" \
  > "$OUT/overhead_profile.txt" 2>&1
grep -E "^\{" "$OUT/overhead_profile.txt"

step "done"
