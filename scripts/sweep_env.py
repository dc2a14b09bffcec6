"""Time chosen benchmark-suite cases under several values of one environment variable (a build experiment such as
``$FLASHDSA_L2_ROWS``), every value's outputs compared bitwise with the first value's.

    python scripts/sweep_env.py FLASHDSA_L2_ROWS 0,2,4 sparse_mla_fwd:V32_S4096_SKV131072_H128_topk2048 \\
        decode:sparse_fp8_B128_H64_sq1_topk2048_cache32768 [--warm] [--json out.json]

``--warm``: first compile, one process per (case, value), all at once (``warm_cache.run_parallel``), then time in
this process.  Timing as ``flashdsa bench`` (``bench.harness.time_fn``: CUDA events, L2 flushed before each call,
median), one input set per case (the suite's seed 0), backend "auto".  Run on the GPU host after
``source .gpu/env.sh``.
"""

import json
import os
import sys


def _case(spec: str):
    import torch

    from flashdsa.bench import get_cases

    suite, name = spec.split(":")
    for case in get_cases(suite, torch.device("cuda"))[0]:
        if case.name == name:
            return case
    raise SystemExit(f"no case {name!r} in suite {suite!r}")


def _flat(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def _inputs(case):
    import torch

    dev = torch.device("cuda")
    return case.build(dev, torch.Generator(device=dev).manual_seed(0))


def sweep(var: str, values: list[str], specs: list[str]) -> list[dict]:
    import torch

    from flashdsa.bench.harness import time_fn

    rows = []
    for spec in specs:
        case = _case(spec)
        inputs = _inputs(case)
        counts = case.counts(inputs)
        first = None
        for v in values:
            os.environ[var] = v
            out = [t.clone() for t in _flat(case.run(inputs, "auto"))]
            same = "-" if first is None else all(torch.equal(a, b) for a, b in zip(out, first))
            first = out if first is None else first
            t = time_fn(lambda i: case.run(i, "auto"), [inputs], torch.device("cuda"), reps=case.reps,
                        max_seconds=case.max_seconds)
            row = dict(case=spec, var=var, value=v, ms=t.ms_median, p10_ms=t.ms_p10,
                       tflops=counts["flops"] / t.ms_median / 1e9, tbps=counts["bytes"] / t.ms_median / 1e9,
                       bitwise_equal_to_first=same)
            rows.append(row)
            print(f"{spec} {var}={v}: {t.ms_median:.4f} ms (p10 {t.ms_p10:.4f}), {row['tflops']:.0f} TFLOP/s, "
                  f"{row['tbps']:.2f} TB/s, bitwise equal to {var}={values[0]}: {same}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--once"]:  # one (case, value) run: the --warm jobs
        os.environ[argv[1]] = argv[2]
        import torch

        case = _case(argv[3])
        case.run(_inputs(case), "auto")
        torch.cuda.synchronize()
        return 0
    out_json = argv[argv.index("--json") + 1] if "--json" in argv else None
    args = [a for i, a in enumerate(argv) if a not in ("--warm", "--json") and (i == 0 or argv[i - 1] != "--json")]
    var, values, specs = args[0], args[1].split(","), args[2:]
    if "--warm" in argv:
        from warm_cache import run_parallel  # this script's folder is on sys.path

        run_parallel([(f"{s} {var}={v}", [sys.executable, __file__, "--once", var, v, s]) for s in specs
                      for v in values], " (case, value) builds")
    rows = sweep(var, values, specs)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
