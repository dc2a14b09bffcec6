"""Host time of each stage of a small public-API call (run on the GPU host; complements bench_overhead.py).

    python scripts/host_stages.py [--json out.json]

Each stage is called back to back N times without synchronising (the GPU work of these calls is shorter than the
queue, so launches do not block) and reported as microseconds per call (median of 5 rounds).  Stages nest: the
public call, the custom op's implementation, the kernel launcher, and the pieces of the launcher on their own
(argument check, buffer allocations, each TileLang kernel call on pre-built arguments), plus references: an empty
torch launch (``x.add_(1)`` on 1 element) and a TileLang call of the tiny plan kernel.
"""

import argparse
import json
import statistics
import sys
import time

import torch

try:
    import flashdsa
except ImportError:  # run from a checkout without an install: use its src/
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    import flashdsa
from flashdsa._tilelang import direct_launcher  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from bench_overhead import dense_mem_inputs, v4_decode_inputs  # noqa: E402


def _us(fn, n=200, rounds=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(res), 2)


def dense_stages(gen):
    from flashdsa.decode import api as dapi, kernel_dense as kd

    q, kv, bt, sl = dense_mem_inputs(gen)
    B, _, H, _ = q.shape
    bs = kv.shape[1]
    scale = 576 ** -0.5
    ws = kd._ws_module("auto", H)
    n_sm = kd._num_sms(0) * ws.ctas_per_sm(H)
    plan_kw = dict(max_blocks=bt.shape[1], block_size=bs, n_mt=1, num_sms=n_sm, tile=ws.BLOCK_N,
                   overhead=ws._OVERHEAD_TILES, min_chunk=ws._MIN_CHUNK_TILES)
    plan, seq_plan = kd._plan_device(sl, **plan_kw)
    n_items = plan.shape[1]
    out = torch.empty((B, H, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((B, H), dtype=torch.float32, device="cuda")
    o_part = torch.empty((n_items, H, 512), dtype=torch.float32, device="cuda")
    lse_part = torch.empty((n_items, H), dtype=torch.float32, device="cuda")
    sink = torch.zeros(1, dtype=torch.float32, device="cuda")
    qf = q.reshape(B, H, 576)
    part = ws.compiled_partial(H, 1, bs, True, scale, False)
    comb = kd._compiled_combine(H, 1, False)
    from flashdsa.decode._plan_kernel import compiled_plan

    plan_k = compiled_plan(ws.BLOCK_N, 1, n_sm, ws._OVERHEAD_TILES, ws._MIN_CHUNK_TILES)

    def allocs():
        torch.empty((B, H, 512), dtype=torch.bfloat16, device="cuda")
        torch.empty((B, H), dtype=torch.float32, device="cuda")
        torch.empty((n_items, H, 512), dtype=torch.float32, device="cuda")
        torch.empty((n_items, H), dtype=torch.float32, device="cuda")
        torch.empty((4, n_items), dtype=torch.int32, device="cuda")
        torch.empty((2, B), dtype=torch.int32, device="cuda")
        torch.zeros(1, dtype=torch.float32, device="cuda")

    stages = {
        "mla_decode": lambda: flashdsa.mla_decode(q, kv, bt, sl, causal=True),
        "_decode_op.impl": lambda: dapi._decode_op.impl(q, kv, bt, sl, scale, 512, True, None, None, None, "auto"),
        "run_mla_decode_dense": lambda: kd.run_mla_decode_dense(q, kv, bt, sl, sm_scale=scale, d_v=512, causal=True),
        "kernel_unsupported": lambda: kd.kernel_unsupported(q, kv, bt, sl, d_v=512, causal=True),
        "resolve_backend": lambda: flashdsa._dispatch.resolve_backend(
            "mla_decode", "auto", q.device, lambda: kd.kernel_unsupported(q, kv, bt, sl, d_v=512, causal=True)),
        "allocs(7)": allocs,
        "_plan_device": lambda: kd._plan_device(sl, **plan_kw),
        "plan kernel call": lambda: plan_k(sl, plan, seq_plan, bt.shape[1] * bs),
        "partial kernel call": lambda: part(qf, kv, bt, sl, plan, sink, out, lse, o_part, lse_part),
        "partial kernel call (direct_launcher)": lambda: direct_launcher(part)(qf, kv, bt, sl, plan, sink, out, lse,
                                                                               o_part, lse_part),
        "_workspace": lambda: kd._workspace(B, H, n_items, q.device),
        "combine kernel call": lambda: comb(seq_plan, sink, o_part, lse_part, out, lse),
        "lookup compiled_partial": lambda: ws.compiled_partial(H, 1, bs, True, scale, False),
        "torch add_ (1 elem)": lambda: sink.add_(0),
    }
    try:  # the same partial kernel behind TileLang's cython adapter instead of tvm_ffi
        import tilelang

        func = ws.build_partial_kernel(heads=H, s_q=1, block_size=bs, causal=True, sm_scale=scale, has_sink=False)
        part_cy = tilelang.compile(func, target="cuda", pass_configs=ws._pass_configs(None, bs),
                                   execution_backend="cython")
        stages["partial kernel call (cython)"] = lambda: part_cy(qf, kv, bt, sl, plan, sink, out, lse, o_part,
                                                                 lse_part)
    except Exception as e:  # noqa: BLE001 - report, keep going
        print(f"cython backend: {type(e).__name__}: {e}"[:300], flush=True)
    return stages


def v4_stages(gen):
    from flashdsa.sparse import _tl_common as tc, api as sapi, kernel_fwd as kf

    q, kv, sink, idx = v4_decode_inputs(gen)
    n, h, d = kv.shape[1], q.shape[2], q.shape[3]
    qf, kvf, idxf, tl, scale, lead = sapi._flatten(q, kv, idx, None, None, d, sink, dqk_allowed=None,
                                                   names=("q", "kv", "topk_idxs"))
    (out, lse, mx), _ = tc.fwd_outputs(qf, kvf, sm_scale=scale, d_v=d)
    has_sink, has_tl, tl_arg, sink_arg, n_blocks = tc.optional_args(idxf, None, sink, qf.device)
    kernel = kf._compiled(h, d, d, n_blocks, float(scale), True, False)
    return {
        "sparse_attn": lambda: flashdsa.sparse_attn(q, kv, sink, idx),
        "_flatten": lambda: sapi._flatten(q, kv, idx, None, None, d, sink, dqk_allowed=None,
                                          names=("q", "kv", "topk_idxs")),
        "_fwd_op.impl": lambda: sapi._fwd_op.impl(qf, kvf, idxf, scale, d, sink, None, False, "auto"),
        "run_sparse_mla_fwd": lambda: kf.run_sparse_mla_fwd(qf, kvf, idxf, sm_scale=scale, d_v=d, attn_sink=sink),
        "kernel_unsupported": lambda: kf.kernel_unsupported(qf, kvf, idxf, d_v=d, attn_sink=sink),
        "fwd_outputs+optional_args": lambda: (tc.fwd_outputs(qf, kvf, sm_scale=scale, d_v=d),
                                              tc.optional_args(idxf, None, sink, qf.device)),
        "lookup _compiled": lambda: kf._compiled(h, d, d, n_blocks, float(scale), True, False),
        "kernel call": lambda: kernel(qf, kvf, idxf, tl_arg, sink_arg, out, lse, mx),
        "kernel call (direct_launcher)": lambda: direct_launcher(kernel)(qf, kvf, idxf, tl_arg, sink_arg, out, lse, mx),
        "_offset_batched_indices": lambda: sapi._offset_batched_indices(idx, n),
        "_offset_batched_indices (torch)": lambda: sapi._offset_batched_indices(idx, n, "reference"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for case, make in (("dense_decode_B64_H16_cache8192", dense_stages), ("v4_sparse_attn_decode", v4_stages)):
        stages = make(gen)
        res[case] = {name: _us(fn) for name, fn in stages.items()}
        print(json.dumps({"case": case, "us_per_call": res[case]}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), results=res), f, indent=1)


if __name__ == "__main__":
    main()
