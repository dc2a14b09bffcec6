#!/bin/bash
# The TileLang kernel cache a GPU call brings along (built on the CPU host by scripts/precompile.py).
#   bash scripts/gpu_cache.sh unpack .tlc/A.tar.xz       # into $TILELANG_CACHE_DIR; marks the time
#   bash scripts/gpu_cache.sh report [$OUT/tlc_new.tar.xz]  # kernels the host still compiled (cache misses),
#                                                           # packed into the tarball when one is named
set -u
dir="${TILELANG_CACHE_DIR:?set TILELANG_CACHE_DIR}"
mark="$dir/.unpacked"
case "${1:-}" in
  unpack)
    mkdir -p "$dir"
    n=0
    for t in "${@:2}"; do
      [ -f "$t" ] && tar -C "$dir" -xJf "$t" && n=$((n + 1))
    done
    touch "$mark"
    echo "gpu_cache: $n tarball(s), $(find "$dir" -name manifest.json | wc -l) kernels in $dir"
    ;;
  report)
    [ -f "$mark" ] || { echo "gpu_cache: nothing was unpacked"; exit 0; }
    new=$(cd "$dir" && find . -name manifest.json -newer "$mark" -printf '%h\n')
    echo "gpu_cache: $(echo -n "$new" | grep -c .) kernels compiled on this host (not in the tarball)"
    if [ -n "${2:-}" ] && [ -n "$new" ]; then
      (cd "$dir" && echo "$new" | tar -cJf "$2" -T -) && echo "gpu_cache: packed them into $2"
    fi
    ;;
  *) echo "usage: gpu_cache.sh unpack TARBALL... | report [OUT_TARBALL]" >&2; exit 2 ;;
esac
