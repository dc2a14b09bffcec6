"""Compile TileLang kernels in parallel processes so that a later run finds them in ``TILELANG_CACHE_DIR``.

    python scripts/warm_cache.py "flashdsa.sparse.kernel_bwd._compiled(64, 576, 512, 32, 576**-0.5, False, False)" ...

Each argument is ``module.function(args)``; each runs in its own Python process (all at once), which imports the
module and evaluates the call.  Prints the seconds taken and any failure.  Run on the GPU host after
``source .gpu/env.sh``.
"""

import subprocess
import sys
import time


def run_parallel(jobs: list[tuple[str, list[str]]], what: str = "") -> int:
    """Run each (name, argv) job as its own process, all at once; print the failures and the seconds taken;
    return the number of failed jobs."""
    t0 = time.time()
    procs = [(name, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
             for name, argv in jobs]
    bad = 0
    for name, p in procs:
        err = p.communicate()[1]
        if p.returncode != 0:
            bad += 1
            print(f"FAILED {name}: {err.strip().splitlines()[-1] if err.strip() else p.returncode}", flush=True)
    print(f"warmed {len(jobs) - bad} of {len(jobs)}{what} in {time.time() - t0:.0f} s", flush=True)
    return bad


def main(calls: list[str]) -> int:
    jobs = []
    for call in calls:
        module = call.partition("(")[0].rpartition(".")[0]
        code = f"import importlib; m = importlib.import_module({module!r}); m.{call[len(module) + 1:]}"
        jobs.append((call, [sys.executable, "-c", code]))
    return 1 if run_parallel(jobs) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
