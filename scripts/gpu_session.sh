#!/bin/bash
# One device call: GPU tests in parallel, then benchmark suites, all inside a wall-clock budget.
#
#   scripts/gpu_session.sh BUDGET_S TEST_TIMEOUT_S "PYTEST ARGS" SUITE...
#
# Run from the repo root on the GPU host with $OUT set (the device tool does); FLASHDSA_COMMIT names the commit.
# Logs: $OUT/tests.log, $OUT/bench_<suite>.log; benchmark JSON lands in $OUT (copy to benchmarks/results/).
# Each suite gets at most the time left; a killed suite leaves its log (JSON is written only at the end).
# Kernels built on the CPU host (scripts/precompile.py) come along as carried .tlc/*.tar.xz: unpacked first; the
# last line counts the kernels still compiled here (and packs them into $OUT/tlc_new.tar.xz for the next call).
set -u
budget=$1; test_timeout=$2; pytest_args=$3; shift 3
start=$(date +%s)
source .gpu/env.sh
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlc}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
bash scripts/gpu_cache.sh unpack .tlc/*.tar.xz
if [ "$test_timeout" -gt 0 ]; then
  # -v with -rfE: one line per finished test, so a run killed at its limit still says which tests never finished
  timeout -s KILL "$test_timeout" python -m pytest -m gpu -v -rfE -p no:cacheprovider -p no:benchmark $pytest_args \
    > "$OUT/tests.log" 2>&1
  rc=$?
  echo "tests rc=$rc" | tee -a "$OUT/tests.log"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
  if [ "$rc" -ne 0 ]; then
    # the collected ids (xdist's -n N dropped) that have no result line in the log
    python -m pytest -m gpu --collect-only -q -p no:cacheprovider $(echo "$pytest_args" | sed -E 's/-n [0-9]+//') \
      2>/dev/null | grep "::" | sort > "$OUT/tests_collected.txt"
    res="PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"  # "[gw3] [ 5%] PASSED id" under xdist, "id PASSED [ 5%]" without
    { grep -oE "($res) [^ ]+::[^ ]+" "$OUT/tests.log" | awk '{print $2}'
      grep -oE "^[^ ]+::[^ ]+ ($res)" "$OUT/tests.log" | awk '{print $1}'; } | sort -u \
      | comm -23 "$OUT/tests_collected.txt" - > "$OUT/tests_unfinished.txt"
    echo "tests unfinished: $(wc -l < "$OUT/tests_unfinished.txt") of $(wc -l < "$OUT/tests_collected.txt")"
    head -20 "$OUT/tests_unfinished.txt"
  fi
fi
for suite in "$@"; do
  left=$(( budget - ($(date +%s) - start) - 5 ))
  if [ "$left" -lt 20 ]; then echo "no time left for $suite"; continue; fi
  graph=; case $suite in indexer|sparse_mla_fwd|decode) graph=--graph;; esac  # the README's "graph ms" column
  timeout -s KILL "$left" python -m flashdsa bench --op "$suite" $graph --results-dir "$OUT" > "$OUT/bench_$suite.log" 2>&1
  echo "bench $suite rc=$? ($(( $(date +%s) - start )) s)"
  grep -vE "TileLang|^\s*$|Warning|warn" "$OUT/bench_$suite.log" | tail -14
done
bash scripts/gpu_cache.sh report "$OUT/tlc_new.tar.xz"
echo "total $(( $(date +%s) - start )) s"
