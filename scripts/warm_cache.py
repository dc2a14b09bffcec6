"""Compile TileLang kernels in parallel processes so that a later run finds them in ``TILELANG_CACHE_DIR``.

    python scripts/warm_cache.py "flashdsa.sparse.kernel_bwd._compiled(64, 576, 512, 32, 576**-0.5, False, False)" ...

Each argument is ``module.function(args)``; each runs in its own Python process (all at once), which imports the
module and evaluates the call.  Prints the seconds taken and any failure.  Run on the GPU host after
``source .gpu/env.sh``.
"""

import subprocess
import sys
import time


def main(calls: list[str]) -> int:
    t0 = time.time()
    procs = []
    for call in calls:
        module = call.partition("(")[0].rpartition(".")[0]
        code = f"import importlib; m = importlib.import_module({module!r}); m.{call[len(module) + 1:]}"
        procs.append((call, subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True)))
    bad = 0
    for call, p in procs:
        err = p.communicate()[1]
        if p.returncode != 0:
            bad += 1
            print(f"FAILED {call}: {err.strip().splitlines()[-1] if err.strip() else p.returncode}", flush=True)
    print(f"warmed {len(calls) - bad} of {len(calls)} in {time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
