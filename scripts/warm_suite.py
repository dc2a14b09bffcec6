"""Compile the kernels of benchmark suites in parallel so that ``flashdsa bench`` after it finds them in
``TILELANG_CACHE_DIR`` (a cold GPU host otherwise compiles each case's kernels one after the other, in the timed
suite's process).

    python scripts/warm_suite.py sparse_mla_fwd sparse_mla_bwd ...

One process per case (all at once): it builds the case's inputs on the GPU and runs the case once (``backend``
"auto", no timing, no reference).  Prints the seconds taken and any failing case.  Run on the GPU host after
``source .gpu/env.sh``.
"""

import sys


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
    from warm_cache import run_parallel  # this script's folder is on sys.path

    jobs = [(f"{suite}/{case.name}", [sys.executable, __file__, "--case", suite, str(i)])
            for suite in argv for i, case in enumerate(get_cases(suite, torch.device("cuda"))[0])]
    return 1 if run_parallel(jobs, " cases") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
