"""How much of a prefill forward is its last, partial round of CTAs: the suite's shapes timed at token counts
around S 4096 (H 64: 4096 items = 31 rounds of 132 CTAs + 4).

    python scripts/tail_probe.py [--passes N] [--shape V32_H64_topk2048] [--more 4100,4180] [--json out.json]

Times ``S`` in ``TOKENS`` (whole rounds 3960 / 4092 / 4224 and the suite's 4096) in two interleaved passes, with
``bench.harness.time_fn`` (events, L2 flushed, median; 30 reps), and prints us per token (= per item here), then
per shape the faster pass's one-round time ((t 4224 - t 3960) / 2) and 4096's excess over 4092 next to a whole
extra round and a smeared one (4 / 132 of a round).  H 64 topk 2048 runs the one-CTA-per-item grid, whose
scheduler hands out CTAs as SMs free up: if 4096 costs about 4092 plus the smeared part, splitting the last items
(ROADMAP idea) would gain little; if it costs about 4224, the 4 items run alone for a whole item's time.  The V4
row (topk 640) runs the persistent grid, where CTA b takes items b, b + 132, ...: its last 4 items run alone by
construction, so that row is the control (a whole item's time expected).
"""

import json
import sys

TOKENS = (3960, 4092, 4096, 4224)
PASSES = 2


def _cases(tokens=TOKENS):
    from flashdsa.bench import suites

    for s in tokens:
        yield "V32_H64_topk2048", s, suites._mla_fwd(f"S{s}", s, 8192, 64, 2048, "")
    for s in tokens:
        yield "V4_h64_topk640_sink", s, suites._v4_fwd(f"m{s}", 1, s, 8192, 64, 640, "")


def _write(argv: list[str], env: dict, rows: list[dict], tokens=TOKENS) -> None:
    if "--json" in argv:  # environment(): GPU, versions, commit, date, FLASHDSA_* switches
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(dict(env, tokens=tokens, results=rows), f, indent=1)


def main(argv: list[str]) -> int:
    import torch

    from flashdsa.bench.harness import environment, time_fn

    dev = torch.device("cuda")
    env = environment(dev)
    passes = int(argv[argv.index("--passes") + 1]) if "--passes" in argv else PASSES
    only = argv[argv.index("--shape") + 1] if "--shape" in argv else None
    # --more 4100,4180: token counts timed besides TOKENS (e.g. 31 rounds + 8 or + 88 items: a step at 4093?)
    more = tuple(int(x) for x in argv[argv.index("--more") + 1].split(",")) if "--more" in argv else ()
    tokens = tuple(sorted(set(TOKENS + more)))
    cases = [c for c in _cases(tokens) if only is None or c[0] == only]
    rows = []
    for r in range(passes):
        for shape, s, case in cases:
            inputs = case.build(dev, torch.Generator(device=dev).manual_seed(0))
            t = time_fn(lambda i: case.run(i, "auto"), [inputs], dev, reps=30, max_seconds=10)
            rows.append({"shape": shape, "tokens": s, "pass": r, "ms": t.ms_median, "p10_ms": t.ms_p10})
            print(f"{shape} S {s} pass {r}: {t.ms_median:.4f} ms (p10 {t.ms_p10:.4f}), "
                  f"{1000 * t.ms_median / s:.2f} us per token", flush=True)
            del inputs
            _write(argv, env, rows, tokens)  # after every row: a run killed by its time limit keeps what it measured
    for shape in dict.fromkeys(row["shape"] for row in rows):
        for r in range(passes):  # each pass's own differences: their spread is the probe's noise
            t = {x["tokens"]: x["ms"] for x in rows if x["shape"] == shape and x["pass"] == r}
            print(f"{shape} pass {r}: 4096 - 4092 = {t[4096] - t[4092]:+.4f} ms, 4224 - 4092 = "
                  f"{t[4224] - t[4092]:+.4f}, (4224 - 3960) / 2 = {(t[4224] - t[3960]) / 2:+.4f}"
                  + "".join(f", {m} - 4092 = {t[m] - t[4092]:+.4f}" for m in more))
        best = {s: min(x["ms"] for x in rows if x["shape"] == shape and x["tokens"] == s) for s in TOKENS}
        per_round = (best[4224] - best[3960]) / 2
        print(f"{shape}: one round {per_round:.4f} ms; 4096 - 4092 = {best[4096] - best[4092]:+.4f} ms "
              f"(a whole extra round would be {best[4224] - best[4092]:+.4f}, "
              f"a smeared one {per_round * 4 / 132:+.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
