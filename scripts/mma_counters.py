"""Where a step of ``kernel_fwd_mma`` spends its cycles: per-warp clock counters of its timing builds (ABL bit 64).

Each ``<form>_a64`` build (add 16 / 32 to drop the PV / QK products) writes, per token and warp, the cycles spent in
the steps' mbarrier waits, from a wait's end to the exchange barrier (QK + exchange store), in the exchange barriers,
in the refill issue, the loop's total and the step count (``kernel_fwd_mma``'s ABL comment) instead of the output.

Usage (GPU host): ``source .gpu/env.sh && python scripts/mma_counters.py mma_c4_a64,mma_c4_a112 [--shape prefill]``;
prefill: S 4096 over SKV 8192, H 16, topk 2048 (the suite's H 16 row); prints medians per step over tokens and warps
and the event time; JSON to ``$OUT/mma_counters.json``.  ``mma_ws_a64`` (+ 16 / 32): ``kernel_fwd_mma_ws``'s
counters (``ws_counters``).
"""

import functools
import json
import os
import sys

import numpy as np
import torch

from flashdsa.bench.harness import time_fn
from flashdsa.sparse import kernel_fwd, kernel_fwd_mma


def timed_words(name, q, kv, idx):
    """The event time of form ``name`` and, after one more launch, its ``out`` as unsigned 32-bit words (int64)."""
    compiled = functools.partial(kernel_fwd_mma._compiled, form=name)

    def fn(_=None):
        return kernel_fwd.launch(compiled, q, kv, idx, sm_scale=576 ** -0.5, d_v=512)

    t = time_fn(fn, [None], q.device, reps=20)
    o = fn()[0]
    torch.cuda.synchronize()
    return t, o.view(torch.int32).reshape(-1).cpu().numpy().astype(np.int64) & 0xffffffff


def main():
    names = sys.argv[1].split(",")
    shape = sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "prefill"
    S, SKV = {"prefill": (4096, 8192), "decode": (128, 65536)}[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kv, idx = kernel_fwd._prefill_inputs(gen, S=S, SKV=SKV, H=16, topk=2048)
    res = {}
    for name in names:
        if name.startswith("mma_ws"):
            res[name] = ws_counters(name, q, kv, idx, S)
            continue
        groups, _, _, tiles, _, _ = kernel_fwd_mma.form_shape(name)
        t, words = timed_words(name, q, kv, idx)
        w = words.reshape(S, 4096)
        warps = 2 * groups * tiles
        cnt = w[:, :8 * warps].reshape(S, warps, 8)
        steps = np.maximum(cnt[:, :, 4], 1)
        per = {k: float(np.median(cnt[:, :, i] / steps)) for k, i in
               (("wait", 0), ("qk", 5), ("bar", 1), ("issue", 2), ("loop", 3))}
        per["rest"] = per["loop"] - per["wait"] - per["qk"] - per["bar"] - per["issue"]
        res[name] = dict(event_ms=t.ms_median, cycles_per_step=per, steps=float(np.median(cnt[:, :, 4])))
        print(f"{name}: {t.ms_median:.4f} ms; cycles per step (median over tokens and warps): "
              + ", ".join(f"{k} {v:.0f}" for k, v in per.items()), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "mma_counters.json"), "w") as f:
        json.dump(dict(shape=shape, commit=os.environ.get("FLASHDSA_COMMIT", "unknown"), forms=res), f, indent=1)


def ws_counters(name, q, kv, idx, S):
    """``kernel_fwd_mma_ws``'s ``_a64`` builds: per CTA and warp, sums over the warp's tokens (consumer warps 0-7:
    wait, QK + exchange store, exchange barrier, rest, loop, steps; producer warps 8-11: empty wait, issue, -, -,
    loop, steps); medians over warps of the cycles per step."""
    t, words = timed_words(name, q, kv, idx)
    n_cta = min((S + 3) // 4, 132)
    cnt = words[:n_cta * 12 * 8].reshape(n_cta, 12, 8)
    steps = np.maximum(cnt[:, :, 5], 1)
    cons = {k: float(np.median(cnt[:, :8, i] / steps[:, :8])) for k, i in
            (("wait", 0), ("qk", 1), ("bar", 2), ("rest", 3), ("loop", 4))}
    prod = {k: float(np.median(cnt[:, 8:, i] / steps[:, 8:])) for k, i in (("wait", 0), ("issue", 1), ("loop", 4))}
    print(f"{name}: {t.ms_median:.4f} ms; consumer cycles per step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in cons.items()) + "; producer: "
          + ", ".join(f"{k} {v:.0f}" for k, v in prod.items()), flush=True)
    return dict(event_ms=t.ms_median, consumer_cycles_per_step=cons, producer_cycles_per_step=prod,
                steps=float(np.median(cnt[:, :, 5])))


if __name__ == "__main__":
    main()
