"""Where a CTA of ``kernel_fwd_mma656`` spends its time: per-step clock64 timestamps of its timestamp build.

The build ``mma_a64`` (``ablate`` bit 64, H 16) writes, per token, the clock64 deltas from CTA entry of: warp 0's
first copies issued, Q' stored, the prologue's barrier, each warp's wait of step ``it`` done and its exchange
barrier passed, each warp's loop end, the merge's parts and the end (word layout: the kernel's ABL comment) into
``out`` instead of the output.  Add bits to time other builds (``mma_a112`` = + no QK / PV products).

Usage (GPU host): ``source .gpu/env.sh && python scripts/mma656_timestamps.py mma_a64[,mma_a112]``; decode shape
B 128, topk 2048 over 32768 rows per token (the suite's); medians over CTAs in us (clock64 cycles over the
globaltimer's rate); JSON to ``$OUT/stamps2.json``; ``$FLASHDSA_L2_FLUSH=read``: L2 flushed by a read, as the
harness.  Session 34 (docs/PERFORMANCE.md): the prologue ~6.5 us (the first index / Q loads), ~1.9 us per 16-key
step with products against 1.44 without, the merge 4.1 -> 1.0 us.
"""

import json
import os
import sys

import numpy as np
import torch

from flashdsa.bench.harness import time_fn
from flashdsa.sparse import kernel_fwd_fp8cache as fc
from flashdsa.sparse.kernel_fwd_narrow656 import variant_inputs


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "mma_a64").split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tok = 128
    q, kv8, idx = variant_inputs(n_tok, 32768, True, gen)  # the --variants decode_B128 inputs
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    res = {}
    for name in names:
        def fn(_=None, name=name):
            return fc.run_sparse_mla_fwd(q, kv8, idx, sm_scale=576 ** -0.5, d_v=512, narrow=name)

        t = time_fn(fn, [None], q.device, reps=30)
        runs = []
        for rep in range(3):
            if os.environ.get("FLASHDSA_L2_FLUSH", "write") == "read":  # as the harness
                flush.sum()
            else:
                flush.fill_(rep + 1)
            torch.cuda.synchronize()
            o = fn()[0]
            torch.cuda.synchronize()
            w = o.view(torch.int32).view(n_tok, 4096).cpu().numpy().astype(np.int64) & 0xffffffff
            gt0 = w[:, 0] | (w[:, 1] << 32)
            ghz = float(np.median(w[:, 4] / ((w[:, 5] - (gt0 & 0xffffffff)) & 0xffffffff)))

            def us(x):
                return np.median(x, axis=0) / ghz / 1e3

            wait = w[:, 64:320].reshape(n_tok, 8, 32)
            xch = w[:, 320:576].reshape(n_tok, 8, 32)
            runs.append({"ghz": ghz, "issued": float(us(w[:, 6])), "qstored": float(us(w[:, 7])),
                         "prologue": float(us(w[:, 2])), "merge_start": float(us(w[:, 3])),
                         "merge_parts": [float(us(w[:, k])) for k in (8, 9, 10)], "end": float(us(w[:, 4])),
                         "loop_end_w": us(w[:, 832:840]).round(2).tolist(),
                         "wait_w0": us(wait[:, 0]).round(2).tolist(), "xch_w0": us(xch[:, 0]).round(2).tolist(),
                         "wait_w1": us(wait[:, 1]).round(2).tolist()})
        res[name] = {"event_ms": t.ms_median, "runs": runs}
        d = runs[-1]
        steps = np.diff(d["wait_w0"])
        print(f"{name}: event {t.ms_median * 1e3:.1f} us, {ghz:.3f} GHz; copies issued {d['issued']:.2f}, prologue "
              f"{d['prologue']:.2f}, first wait {d['wait_w0'][0]:.2f}, last wait {d['wait_w0'][-1]:.2f} "
              f"({steps.mean():.2f} per step), merge {d['merge_start']:.2f} -> end {d['end']:.2f}", flush=True)
    tag = "_read" if os.environ.get("FLASHDSA_L2_FLUSH") == "read" else ""
    with open(os.path.join(os.environ.get("OUT", "."), f"stamps2{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
