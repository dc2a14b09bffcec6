"""How much of a decode row is a fixed cost per CTA and how much is per 64-key block (run on the GPU host).

    python scripts/decode_cost_model.py [--rows sparse_fp8_h64,...] [--json out.json]
    python scripts/decode_cost_model.py --ab FLASHDSA_DECODE_PAIR_QTMA=0,1 [--rounds 3] [--rows ...] [--json F]

#6's B 128 rows run one wave of CTAs (or a few): each CTA pays a fixed part (Q load, barrier set-up, the first
gather's latency, the epilogue's stores) and a part per 64-key block. This times each row's own call in CUDA-graph
replay (events, L2 flushed, medians) over a range of key counts with everything else fixed, and fits
``t = fixed + per_block * blocks`` by least squares; with the row's own key count the fit says what share the fixed
part takes, i.e. what overlapping it (more CTAs per SM, a persistent prologue under the previous item) could give.
Rows: the sparse FP8 decode rows (topk 128..2048 of a 32768-slot cache; random unique slots per token) and the
dense bf16 rows (cache lengths 1024..8192, block 64, s_q 1 / 2 causal).

``--ab VAR=v1,v2,...``: instead of the fit, an A / B of an environment switch (one the row's kernel choice reads
at each call or keys its plans on, e.g. ``$FLASHDSA_CACHE656_QGATE``, ``$FLASHDSA_DECODE_PAIR_QTMA``; a switch
neither does would time one kernel under every value): each row at its largest key
count, the values in turn for ``--rounds`` rounds on the same inputs (each value's call captured in its own graph),
and whether every value gives bitwise the first value's outputs.
"""

import argparse
import json
import os
import sys

import torch

try:
    import flashdsa
except ImportError:  # run from a checkout without an install: use its src/
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    import flashdsa

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from bench_overhead import graph_ms  # noqa: E402

# name: (sparse, B, s_q, H, key counts); sparse rows: topk values; dense rows: cache lengths
ROWS = {
    "sparse_fp8_h64": (True, 128, 1, 64, (128, 256, 512, 1024, 2048)),
    "sparse_fp8_h128_sq2": (True, 128, 2, 128, (128, 256, 512, 1024, 2048)),
    "sparse_fp8_h16": (True, 128, 1, 16, (128, 256, 512, 1024, 2048)),
    "dense_bf16_h128": (False, 128, 1, 128, (1024, 2048, 4096, 8192)),
    "dense_bf16_h128_sq2": (False, 128, 2, 128, (1024, 2048, 4096, 8192)),
}


def _call(sparse, B, s_q, H, keys, gen):
    """The row's ``mla_decode`` call at ``keys`` keys per query token, as a closure over fresh random inputs."""
    bs = 64
    q = (torch.randn(B, s_q, H, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    if sparse:
        slots = 32768
        nb = B * slots // bs
        kv = (torch.randn(nb, bs, 576, generator=gen, device="cuda") * 0.1).bfloat16()
        cache = flashdsa.quantize_kv_fp8(kv)
        base = (torch.arange(B, device="cuda") * slots).view(B, 1, 1)
        idx = torch.argsort(torch.rand(B * s_q, slots, generator=gen, device="cuda"), dim=1)[:, :keys]
        idx = (idx.view(B, s_q, keys) + base).int().contiguous()
        return lambda: flashdsa.mla_decode(q, cache, None, None, indices=idx)
    nb = B * keys // bs
    kv = (torch.randn(nb, bs, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    table = torch.randperm(nb, generator=gen, device="cuda").int().view(B, keys // bs)
    lens = torch.full((B,), keys, dtype=torch.int32, device="cuda")
    return lambda: flashdsa.mla_decode(q, kv, table, lens, causal=True)


def fit(blocks, ms):
    """(fixed ms, ms per block) of the least-squares line through (blocks, ms)."""
    n = len(blocks)
    mx, my = sum(blocks) / n, sum(ms) / n
    sxx = sum((x - mx) ** 2 for x in blocks)
    slope = sum((x - mx) * (y - my) for x, y in zip(blocks, ms)) / sxx
    return my - slope * mx, slope


def ab(name, var, values, rounds, reps, flush):
    """The row at its largest key count with ``$var`` set to each of ``values`` in turn, ``rounds`` times."""
    sparse, B, s_q, H, counts = ROWS[name]
    call = _call(sparse, B, s_q, H, counts[-1], torch.Generator(device="cuda").manual_seed(0))
    ms = {v: [] for v in values}
    first, same = None, {}
    old = os.environ.get(var)
    try:
        for _ in range(rounds):
            for v in values:
                os.environ[var] = v
                out = call()
                out = out if isinstance(out, tuple) else (out,)
                first = first or [t.clone() for t in out]
                same[v] = same.get(v, True) and all(torch.equal(a, b) for a, b in zip(out, first))
                ms[v].append(round(graph_ms(call, reps, flush), 5))
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    return {"row": name, "B": B, "s_q": s_q, "H": H, "keys": counts[-1], "var": var, "graph_ms": ms,
            "bitwise_equal_to_first": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ab", default=None, help="VAR=v1,v2,...: an A / B of an environment switch (see above)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.ab:
        var, _, values = args.ab.partition("=")
        values = values.split(",")
        if not var or not all(values) or len(set(values)) != len(values):
            ap.error(f"--ab {args.ab!r}: expected VAR=v1,v2,... with distinct, non-empty values")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    out = []
    for name in args.rows.split(","):
        if args.ab:
            row = ab(name, var, values, args.rounds, args.reps, flush)
            print(json.dumps(row), flush=True)
            out.append(row)
            torch.cuda.empty_cache()
            continue
        sparse, B, s_q, H, counts = ROWS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        ms = []
        for keys in counts:
            ms.append(graph_ms(_call(sparse, B, s_q, H, keys, gen), args.reps, flush))
            torch.cuda.empty_cache()
        blocks = [k / 64 for k in counts]
        fixed, per_block = fit(blocks, ms)
        row = {"row": name, "B": B, "s_q": s_q, "H": H, "keys": list(counts), "graph_ms": [round(t, 5) for t in ms],
               "fixed_ms": round(fixed, 5), "ms_per_block": round(per_block, 6),
               "fixed_share_at_max": round(fixed / ms[-1], 3)}
        print(json.dumps(row), flush=True)
        out.append(row)
    if args.json:
        from flashdsa.bench.harness import environment

        with open(args.json, "w") as f:  # environment(): GPU, versions, commit, date, FLASHDSA_* switches
            json.dump(dict(environment(torch.device("cuda")), results=out), f, indent=1)


if __name__ == "__main__":
    main()
