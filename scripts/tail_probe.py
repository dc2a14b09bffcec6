"""How much of a prefill forward is its last, partial round of CTAs: the suite's shapes timed at token counts
around S 4096 (H 64: 4096 items = 31 rounds of 132 CTAs + 4).

    python scripts/tail_probe.py [--passes N] [--shape V32_H64_topk2048] [--more 4100,4180] [--json out.json]

Times ``S`` in ``TOKENS`` (whole rounds 3960 / 4092 / 4224 and the suite's 4096; ``--more``: others) in
``--passes`` interleaved passes (default 2), with ``bench.harness.time_fn`` (events, L2 flushed, median; 30 reps),
and prints us per token (= per item here), then per shape each pass's differences (their spread is the probe's
noise) and those of the faster pass per count: 4096's excess over 4092 next to a whole extra round (4224 - 4092)
and a smeared one (4 / 132 of a round).  H 64 topk 2048 runs the one-CTA-per-item grid, whose scheduler hands out
CTAs as SMs free up: if 4096 costs about 4092 plus the smeared part, splitting the last items (ROADMAP idea) would
gain little; if it costs about 4224, the 4 items run alone for a whole item's time (session 53: the latter).  The
V4 row (topk 640) runs the persistent grid, where CTA b takes items b, b + 132, ...: its last 4 items run alone by
construction, so that row is the control (a whole item's time expected).

``--ab``: the counts ``AB_TOKENS`` (and ``--more``) each timed unsplit (``$FLASHDSA_PAIR_TAIL`` "0") and with the
last round split (``AB_MODES``: "1", chunks beside the main grid; "serial", after it; ``sparse/_tail_split.py``)
call by call (A B C A B C ..., 40 calls each, L2 flushed before each: ``harness._timed_calls`` over the settings),
so clock drift between passes cancels (session 54's first A / B, pass against pass, drifted up to 6.3% on a
count where both settings run the same launch); per pass the medians and the median of the 40 paired differences
against unsplit, then over passes the median gain.  At 4092 nothing is split: the control (differences about 0).
"""

import argparse
import json
import sys
import time

TOKENS = (3960, 4092, 4096, 4224)
AB_TOKENS = (4092, 4096, 4100)  # whole rounds (nothing to split), + 4 items, + 8 items at H 64
SHAPES = ("V32_H64_topk2048", "V4_h64_topk640_sink", "V32_H128_topk2048")
TAIL_ENV = "FLASHDSA_PAIR_TAIL"


def _cases(tokens):
    from flashdsa.bench import suites

    for s in tokens:
        yield SHAPES[0], s, suites._mla_fwd(f"S{s}", s, 8192, 64, 2048, "")
    for s in tokens:
        yield SHAPES[1], s, suites._v4_fwd(f"m{s}", 1, s, 8192, 64, 640, "")
    for s in tokens:
        yield SHAPES[2], s, suites._mla_fwd(f"S{s}", s, 8192, 128, 2048, "")


def _differences(t: dict, more=()) -> str:
    """One shape's differences (ms) from its times per token count: 4096's excess over 4092, a whole extra round
    (4224 - 4092), the mean round ((4224 - 3960) / 2) and each ``more`` count's excess over 4092."""
    return (f"4096 - 4092 = {t[4096] - t[4092]:+.4f} ms, 4224 - 4092 = {t[4224] - t[4092]:+.4f}, "
            f"(4224 - 3960) / 2 = {(t[4224] - t[3960]) / 2:+.4f}"
            + "".join(f", {m} - 4092 = {t[m] - t[4092]:+.4f}" for m in more))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--shape", choices=SHAPES, help="time this shape only")
    ap.add_argument("--more", type=lambda v: tuple(int(x) for x in v.split(",")), default=(),
                    help="token counts timed besides TOKENS, e.g. 4100,4180 (31 rounds + 8 / + 88 items)")
    ap.add_argument("--json", help="write the environment and every row here, after each row")
    ap.add_argument("--ab", action="store_true", help="each count with the last round split and unsplit")
    ap.add_argument("--profile", action="store_true",
                    help="after the timing, each shape's kernels at S 4096 split (torch.profiler, 5 calls)")
    args = ap.parse_args(argv)

    import torch

    from flashdsa.bench.harness import environment, time_fn

    dev = torch.device("cuda")
    env = environment(dev)
    base = AB_TOKENS if args.ab else TOKENS
    more = tuple(m for m in args.more if m not in base)
    tokens = tuple(sorted(base + more))
    cases = [c for c in _cases(tokens) if args.shape in (None, c[0])]
    rows = []
    for r in range(args.passes):
        for shape, s, case in cases:
            inputs = case.build(dev, torch.Generator(device=dev).manual_seed(0))
            if args.ab:
                rows.append(_paired(case, inputs, dev, shape, s, r))
            else:
                t = time_fn(lambda i: case.run(i, "auto"), [inputs], dev, reps=30, max_seconds=10)
                rows.append({"shape": shape, "tokens": s, "pass": r, "ms": t.ms_median, "p10_ms": t.ms_p10})
                print(f"{shape} S {s} pass {r}: {t.ms_median:.4f} ms (p10 {t.ms_p10:.4f}), "
                      f"{1000 * t.ms_median / s:.2f} us per token", flush=True)
            del inputs
            if args.json:  # after every row: a run killed by its time limit keeps what it measured
                with open(args.json, "w") as f:  # environment(): GPU, versions, commit, date, FLASHDSA_* switches
                    json.dump(dict(env, tokens=tokens, results=rows), f, indent=1)
    if args.ab:
        _print_ab(rows, tokens)
    if args.profile:
        _profile([c for c in cases if c[1] == 4096], dev)
    if args.ab:
        return 0
    for shape in dict.fromkeys(row["shape"] for row in rows):
        for r in range(args.passes):
            print(f"{shape} pass {r}: "
                  + _differences({x["tokens"]: x["ms"] for x in rows if x["shape"] == shape and x["pass"] == r}, more))
        best = {s: min(x["ms"] for x in rows if x["shape"] == shape and x["tokens"] == s) for s in tokens}
        per_round = (best[4224] - best[3960]) / 2
        print(f"{shape}, the faster pass per count: {_differences(best, more)}; a smeared last round would be "
              f"{per_round * 4 / 132:+.4f}")
    return 0


AB_MODES = ("0", "1", "serial")  # $FLASHDSA_PAIR_TAIL: unsplit (A), then each split form


def _paired(case, inputs, dev, shape, s, r, calls=40):
    """One pass of ``--ab`` at one count: unsplit and each split form call by call (module docstring); returns
    its row (per form: the median ms and the paired differences against unsplit)."""
    import os
    import statistics

    from flashdsa.bench.harness import _sync, _timed_calls

    def run(tail):
        os.environ[TAIL_ENV] = tail  # read per call (part of the eager plan's key)
        return case.run(inputs, "auto")

    for tail in AB_MODES * 2:  # compile, store the plans
        run(tail)
    _sync(dev)
    t_end = time.perf_counter() + 0.2  # clocks up from idle
    while time.perf_counter() < t_end:
        for tail in AB_MODES:
            run(tail)
        _sync(dev)
    n = len(AB_MODES)
    times = _timed_calls(run, AB_MODES, dev, n * calls, True)
    base = times[0::n]
    row = {"shape": shape, "tokens": s, "pass": r, "calls": calls, "ms_0": statistics.median(base)}
    text = f"{shape} S {s} pass {r}: unsplit {row['ms_0']:.4f} ms"
    for k, mode in enumerate(AB_MODES[1:], 1):
        mine = times[k::n]
        diff = sorted(y - x for x, y in zip(base, mine))
        p10, p90 = diff[len(diff) // 10], diff[(9 * len(diff)) // 10]
        row.update({f"ms_{mode}": statistics.median(mine), f"diff_ms_{mode}": statistics.median(diff),
                    f"diff_ms_{mode}_p10_p90": (p10, p90)})
        text += (f"; {mode} {row[f'ms_{mode}']:.4f} ms, - unsplit {row[f'diff_ms_{mode}']:+.4f} "
                 f"(p10 {p10:+.4f}, p90 {p90:+.4f})")
    print(text, flush=True)
    return row


def _profile(cases, dev):
    """Each case's CUDA kernels (name, calls, mean us) over 5 split calls: the main grid, the chunks, the merge."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    os.environ[TAIL_ENV] = "1"  # the chunks beside the main grid
    for shape, s, case in cases:
        inputs = case.build(dev, torch.Generator(device=dev).manual_seed(0))
        case.run(inputs, "auto")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                case.run(inputs, "auto")
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if str(ev.device_type).endswith("CUDA") and ev.count:
                t = getattr(ev, "device_time_total", None) or ev.cuda_time_total
                print(f"profile {shape} S {s}: {ev.key[:60]} x{ev.count}: {t / ev.count:.1f} us", flush=True)
        del inputs


def _print_ab(rows, tokens):
    """Per shape, count and split form: over passes, the medians of the paired differences and the gain."""
    import statistics

    for shape in dict.fromkeys(row["shape"] for row in rows):
        for s in tokens:
            sel = [x for x in rows if (x["shape"], x["tokens"]) == (shape, s)]
            a = statistics.median(x["ms_0"] for x in sel)
            for mode in AB_MODES[1:]:
                d = statistics.median(x[f"diff_ms_{mode}"] for x in sel)
                print(f"{shape} S {s} {mode}: unsplit {a:.4f} ms, split - unsplit {d:+.4f} ms (passes: "
                      + ", ".join(f"{x[f'diff_ms_{mode}']:+.4f}" for x in sel) + f"), gain {-100 * d / a:+.2f}%")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
