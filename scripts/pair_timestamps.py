"""Where a CTA of the 656-byte-cache pair kernel spends its time in decode: per-CTA clock64 timestamps (GPU host).

    python scripts/pair_timestamps.py [--rows h64_topk2048,...] [--gates off,al,off,al] [--reps 20] [--json F]

``decode_cost_model.py`` fits each sparse FP8 decode row's graph time as fixed + per 64-key block, and finds 12-15%
fixed (session 48, H100).  This runs the rows' kernel (``kernel_fwd_pair_cache``, B 128, 32768 slots per sequence,
random unique slots) in its timestamp build (``stamps``: one thread of each role writes clock64 at the points of
``_pair_parts.STAMPS``) after an L2 flush, and prints per CTA (medians over CTAs, us from WG0's entry): Q loaded,
the first half tile ready, the first QK retired, each pair's start, the loop's end, the epilogue; the producer's
and converter's entry / end; and over the grid: CTA entry times (globaltimer) against the first, the span from
the first entry to the last end, the graph-replay time of each ``--gates`` build (``q_gate``: "off", "al", "ar",
"auto"; a value may repeat, for A / B / A / B) and of its timestamp build (both must give bitwise the outputs of
the ungated build), and on an SM running several CTAs in turn the gap between one's end and the next one's entry.
"""

import argparse
import json
import pathlib
import sys

import numpy as np
import torch

try:
    import flashdsa
except ImportError:  # run from a checkout without an install: use its src/
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    import flashdsa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_overhead import graph_ms  # noqa: E402

from flashdsa.sparse import _pair_parts as pp  # noqa: E402
from flashdsa.sparse import kernel_fwd_pair_cache as pc  # noqa: E402

# name: (B, s_q, H, topk)
ROWS = {"h64_topk2048": (128, 1, 64, 2048), "h64_topk128": (128, 1, 64, 128),
        "h128_sq2_topk2048": (128, 2, 128, 2048), "h128_sq2_topk128": (128, 2, 128, 128)}
SLOTS = 32768


def _inputs(B, s_q, H, topk, gen):
    """q [B s_q, H, 576] bf16, the 656-byte cache of B * SLOTS rows, indices [B s_q, topk] (unique per token)."""
    q = (torch.randn(B * s_q, H, 576, generator=gen, device="cuda") * 0.1).bfloat16()
    cache = torch.empty(B * SLOTS, 656, dtype=torch.uint8, device="cuda")
    step = 1 << 18
    for r in range(0, B * SLOTS, step):  # quantized in pieces: the fp32 randn of the whole cache is 9.7 GB
        cache[r:r + step] = flashdsa.quantize_kv_fp8(
            (torch.randn(min(step, B * SLOTS - r), 576, generator=gen, device="cuda") * 0.1).bfloat16())
    base = (torch.arange(B, device="cuda") * SLOTS).repeat_interleave(s_q).view(-1, 1)
    idx = torch.argsort(torch.rand(B * s_q, SLOTS, generator=gen, device="cuda"), dim=1)[:, :topk]
    return q, cache, (idx + base).int().contiguous()


def _analyse(w):
    """Per-CTA times in us from the int32 stamps [n_ctas, STAMP_WORDS] (medians over CTAs), grid figures."""
    w = w.astype(np.int64) & 0xFFFFFFFF
    S = pp.STAMPS
    gt0 = w[:, 0] | (w[:, 1] << 32)
    gt1 = w[:, S["gt_end"]] | (w[:, S["gt_end"] + 1] << 32)
    clk0 = w[:, S["wg0_entry"]]
    ghz = float(np.median(((w[:, S["wg0_end"]] - clk0) & 0xFFFFFFFF) / np.maximum(gt1 - gt0, 1)))

    def us(word):  # us after WG0's entry, per CTA
        return ((w[:, word] - clk0) & 0xFFFFFFFF) / ghz / 1e3

    med = {}
    for name, word in S.items():
        if name in ("gt_entry", "gt_end", "smid", "wg0_entry"):
            continue
        if name in ("wg0_pair", "wg1_pair"):
            med[name] = [round(float(np.median(us(word + j))), 2) for j in range(pp.STAMP_PAIRS)]
        else:
            med[name] = round(float(np.median(us(word))), 2)
    end = np.max(np.stack([us(S[k]) for k in ("wg0_end", "wg1_finish", "prod_end", "conv_end")]), axis=0)
    entry = (gt0 - gt0.min()) / 1e3
    # the same SM's CTAs in turn: gap from one's last stamp to the next one's entry (globaltimer)
    sm = w[:, S["smid"]]
    end_gt = gt0 + end * 1e3
    gaps = []
    for s in np.unique(sm):
        order = np.argsort(gt0[sm == s])
        e0, e1 = gt0[sm == s][order], end_gt[sm == s][order]
        gaps += list((e0[1:] - e1[:-1]) / 1e3)
    pcts = (0, 10, 50, 90, 100)

    def spread(x):
        return [round(float(np.percentile(x, p)), 2) for p in pcts]

    n_p = min(pp.STAMP_PAIRS, int(np.sum(w[0, S["wg0_pair"]:S["wg0_pair"] + pp.STAMP_PAIRS] != 0xFFFFFFFF)))
    step = (us(S["wg0_pair"] + n_p - 1) - us(S["wg0_pair"])) / max(n_p - 1, 1)
    last = np.argsort(end_gt)[-8:]
    return {"ghz": round(ghz, 3), "cta_us": med, "cta_end_us_median": round(float(np.median(end)), 2),
            "pcts": pcts, "end_from_first_entry_us": spread((end_gt - gt0.min()) / 1e3), "cta_us_spread": spread(end),
            "qk0_us_spread": spread(us(S["wg0_qk0"])), "pair_step_us_spread": spread(step) if n_p > 1 else None,
            "tail_us_spread": spread(end - us(S["wg0_loop_end"])),
            "latest_ctas": [[int(i), int(sm[i]), round(float(end[i]), 2)] for i in last],
            "entry_us_pcts": [round(float(np.percentile(entry, p)), 2) for p in (0, 50, 90, 100)],
            "span_us": round(float((end_gt.max() - gt0.min()) / 1e3), 2), "ctas": int(w.shape[0]),
            "sms": int(len(np.unique(sm))), "turnaround_gap_us_median": round(float(np.median(gaps)), 2) if gaps
            else None}


def _row(name, reps, flush, gates):
    """One row's graph times, bitwise check and two stamped runs (``_analyse``) per ``q_gate`` value."""
    B, s_q, H, topk = ROWS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, cache, idx = _inputs(B, s_q, H, topk, gen)
    n_ctas = q.shape[0] * (H // 64)
    stamps = torch.full((n_ctas, pp.STAMP_WORDS), -1, dtype=torch.int32, device="cuda")
    sm = 576 ** -0.5
    ref = pc.run_sparse_mla_fwd(q, cache, idx, sm_scale=sm, d_v=512, q_gate="off")
    row = {"row": name, "B": B, "s_q": s_q, "H": H, "topk": topk}
    for i, gate in enumerate(gates):
        def plain(gate=gate):
            return pc.run_sparse_mla_fwd(q, cache, idx, sm_scale=sm, d_v=512, q_gate=gate)

        def stamped(gate=gate):
            return pc.run_sparse_mla_fwd(q, cache, idx, sm_scale=sm, d_v=512, stamps=stamps, q_gate=gate)

        res = {"bitwise_equal": all(torch.equal(a, b) for out in (plain(), stamped()) for a, b in zip(out, ref)),
               "graph_ms_plain": round(graph_ms(plain, reps, flush), 5),
               "graph_ms_stamps": round(graph_ms(stamped, reps, flush), 5), "runs": []}
        for rep in range(2):
            flush.fill_(rep + 1.0)
            stamps.fill_(-1)
            torch.cuda.synchronize()
            stamped()
            torch.cuda.synchronize()
            w = stamps.cpu().numpy()
            assert (w[:, pp.STAMPS["wg0_end"]] != -1).all(), "a CTA wrote no end stamp"
            res["runs"].append(_analyse(w))
        row[f"q_gate={gate}" + (f"#{i}" if gates.count(gate) > 1 else "")] = res  # (#i: a value run again)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gates", default="off", help="q_gate values (kernel_fwd_pair_cache.QGATES), comma-separated")
    args = ap.parse_args(argv)
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    out = []
    for name in args.rows.split(","):
        row = _row(name, args.reps, flush, args.gates.split(","))
        print(json.dumps(row), flush=True)
        out.append(row)
        torch.cuda.empty_cache()
    if args.json:
        from flashdsa.bench.harness import environment

        with open(args.json, "w") as f:
            json.dump(dict(environment(torch.device("cuda")), results=out), f, indent=1)


if __name__ == "__main__":
    main()
