#!/bin/bash
# The first device call planned for session 8 (docs/ROADMAP.md, "First commands"): every GPU test, memcheck of the
# forward after session 7's row binding / batched reductions, then the host stages, eager / graph / kernel times of
# the two small calls (incl. the suite's own V4 decode and dense decode cases) on this one machine, then the forward's
# opt-in softmax-reduction schedules against the default (~12 min in all on a cold host).
# Run from the repo root on the GPU host: FLASHDSA_COMMIT=<sha> bash scripts/next_session_gpu.sh
# Everything goes to $OUT (logs, JSON); each step has its own time limit.
set -u
source .gpu/env.sh
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlc}
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

step "all GPU tests"
timeout -s KILL 300 python -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark -n 14 --timeout 280 tests \
  > "$OUT/tests.log" 2>&1
echo "rc=$?"; grep -E "passed|failed" "$OUT/tests.log" | tail -1; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20

step "memcheck sparse_bf16"
timeout -s KILL 80 compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/memcheck_small.py sparse_bf16 \
  > "$OUT/memcheck_sparse_bf16.log" 2>&1
echo "rc=$?"; grep -E "ERROR SUMMARY|ok|MISMATCH" "$OUT/memcheck_sparse_bf16.log" | head -4

step "host stages"
timeout -s KILL 90 python scripts/host_stages.py --json "$OUT/host_stages.json" 2>&1 | grep -E "^\{"

step "eager / host / graph / kernels of the small calls"
timeout -s KILL 90 python scripts/bench_overhead.py --json "$OUT/overhead.json" 2>&1 | grep -E "^\{"

step "forward reduction schedules (kernel_fwd --variants: batch 1 / default / (2, 1) / (2, 0))"
timeout -s KILL 300 python -m flashdsa.sparse.kernel_fwd --variants 2>&1 | grep -E "^variant|Error" \
  | tee "$OUT/fwd_variants.txt"

step "done"
