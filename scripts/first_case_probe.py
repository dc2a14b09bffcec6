"""Is the first timed case of a process slower than the same case timed again?  (Session 28 saw a fresh
process's first sparse FP8 decode case at up to 2x its later median.)

    python scripts/first_case_probe.py WARM_SECONDS SUITE:CASE [SUITE:CASE ...]

For each case in order: its inputs (the suite's seed 0), then ``time_fn`` three times in a row with
``warm_seconds=WARM_SECONDS`` (median, p10 per run).  Run on the GPU host after ``source .gpu/env.sh``.
"""

import sys

import torch

from flashdsa.bench import get_cases
from flashdsa.bench.harness import time_fn


def main(warm: float, specs: list[str]) -> None:
    dev = torch.device("cuda")
    for spec in specs:
        suite, name = spec.split(":")
        case = next(c for c in get_cases(suite, dev)[0] if c.name == name)
        inputs = case.build(dev, torch.Generator(device=dev).manual_seed(0))
        runs = [time_fn(lambda i: case.run(i, "auto"), [inputs], dev, warm_seconds=warm) for _ in range(3)]
        print(f"{spec} warm {warm} s: " + ", ".join(f"{t.ms_median * 1e3:.1f} (p10 {t.ms_p10 * 1e3:.1f}) us"
                                                   for t in runs), flush=True)
        del inputs


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2:])
