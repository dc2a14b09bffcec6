"""Compile the kernels of benchmark suites in parallel so that ``flashdsa bench`` after it finds them in
``TILELANG_CACHE_DIR`` (a cold GPU host otherwise compiles each case's kernels one after the other, in the timed
suite's process).

    python scripts/warm_suite.py sparse_mla_fwd sparse_mla_bwd ...

One process per case (all at once): it builds the case's inputs on the GPU and runs the case once (``backend``
"auto", no timing, no reference).  Prints the seconds taken and any failing case.  Run on the GPU host after
``source .gpu/env.sh``.
"""

import subprocess
import sys
import time


def _run_case(suite: str, index: int) -> None:
    import torch

    from flashdsa.bench import get_cases

    dev = torch.device("cuda")
    case = get_cases(suite, dev)[0][index]
    case.run(case.build(dev, torch.Generator(device=dev).manual_seed(0)), "auto")
    torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--case"]:
        _run_case(argv[1], int(argv[2]))
        return 0
    import torch

    from flashdsa.bench import get_cases

    t0 = time.time()
    procs = []
    for suite in argv:
        for i, case in enumerate(get_cases(suite, torch.device("cuda"))[0]):
            procs.append((f"{suite}/{case.name}", subprocess.Popen(
                [sys.executable, __file__, "--case", suite, str(i)], stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True)))
    bad = 0
    for name, p in procs:
        err = p.communicate()[1]
        if p.returncode != 0:
            bad += 1
            print(f"FAILED {name}: {err.strip().splitlines()[-1] if err.strip() else p.returncode}", flush=True)
    print(f"warmed {len(procs) - bad} of {len(procs)} cases in {time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
