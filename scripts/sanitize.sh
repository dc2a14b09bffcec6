#!/bin/bash
# compute-sanitizer's racecheck, synccheck and initcheck over scripts/memcheck_small.py's targets (memcheck itself:
# that script's docstring).  Run on the GPU host from the repo root with $OUT set:
#
#   bash scripts/sanitize.sh BUDGET_S "TOOL[:GROUPS] ..." TARGET...
#   e.g. bash scripts/sanitize.sh 300 "plain:2 racecheck:3 synccheck:2 initcheck" sparse_bf16 decode_pair
#
# "plain" runs the targets without a sanitizer (first: it compiles what the sanitized runs then load).
# The tools run one after another; a tool runs the targets in GROUPS processes (default 1) at once on the one GPU
# (synccheck ends a process at its first error: give it one process per target), each tool inside BUDGET_S;
# logs in $OUT/sanitize_<tool>_<i>.log, one summary line per log at the end.
# - racecheck: shared-memory hazards (RAW / WAR / WAW) between a kernel's threads; PyTorch's own kernels (names
#   with "native") are left out, they share no shared memory with ours.
# - synccheck: invalid barrier use (divergent bar.sync, mbarrier misuse).
# - initcheck: global reads of memory nothing wrote; every kernel is tracked (PyTorch's writes initialise inputs).
#   With PYTORCH_NO_CUDA_MEMORY_CACHING=1 in the environment every allocation is fresh, so a read of an unwritten
#   torch.empty shows every run (with the caching allocator only when its block was never written before).
#   Several initcheck runs also vary the roles' relative timing: how session 57's race showed (racecheck: 0).
# A target also compares its kernel with the reference (exit 1 on a mismatch, as under memcheck).
set -u
budget=$1; tools=$2; shift 2
targets=("$@")
source .gpu/env.sh
cs=$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -1)
"$cs" --version | tail -1
for spec in $tools; do
  tool=${spec%%:*}; groups=1
  [ "$tool" != "$spec" ] && groups=${spec#*:}
  case $tool in
    racecheck) opts=(--racecheck-report all --kernel-name-exclude kns=native) ;;
    synccheck) opts=(--kernel-name-exclude kns=native) ;;
    *) opts=() ;;
  esac
  for ((g = 0; g < groups; g++)); do
    part=()
    for ((i = g; i < ${#targets[@]}; i += groups)); do part+=("${targets[i]}"); done
    [ ${#part[@]} -eq 0 ] && continue
    run=("$cs" --tool "$tool" "${opts[@]}" --error-exitcode 3 --print-limit 50)
    [ "$tool" = plain ] && run=()  # no sanitizer: compiles the kernels for the tools after it, plain results
    { echo "targets: ${part[*]}"
      timeout -s KILL "$budget" "${run[@]}" python scripts/memcheck_small.py "${part[@]}"
      echo "rc=$?"; } > "$OUT/sanitize_${tool}_$g.log" 2>&1 &  # rc 137: past the budget
  done
  wait
done
# per log: targets that passed / mismatched (the target lines, not the per-case ones), exit status, tool summary
for f in "$OUT"/sanitize_*.log; do
  ok=$(grep -cE '^[a-z0-9_]+ OK$' "$f"); bad=$(grep -cE '^[a-z0-9_]+ MISMATCH$' "$f")
  echo "$(basename "$f") [$(head -1 "$f" | cut -c10-)]: $ok OK, $bad mismatch, $(grep -E '^rc=' "$f");" \
    "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tr '\n' ' ')"
done
# the distinct places the errors point at (kernel frame, source line), per log with errors or hazards
for f in "$OUT"/sanitize_*.log; do
  grep -qE 'ERROR SUMMARY: [1-9]|\([1-9][0-9]* (errors|warnings)|hazard detected|Race reported|error detected|'\
'Uninitialized|Invalid __' "$f" || continue
  echo "== $(basename "$f"):"
  grep -E '^=========[[:space:]]+(Device Frame|Read Thread|Write Thread|at |and (Read|Write) access|Error: Race)' \
    "$f" | sed -E 's/ +/ /g; s/\([0-9, ]+\)//g; s/\+0x[0-9a-f]+//g; s/ \[[0-9]+ hazards\]//' | cut -c1-230 \
    | sort | uniq -c | sort -rn | head -8
done
