"""Time the dense bf16 paged MLA decode kernel variants ("auto", "ws", "narrow", "pipelined", "narrow_fused") on one
GPU.

Usage (repo root, GPU machine):
    python scripts/bench_decode.py [--variants ws,narrow,narrow@128x1xcpasync,pipelined] [--cases all|mem,h32]
                                   [--reps 20]
                                   [--json out.json]

The ``partial`` field of each row names the kernel module that ran.

Per case and variant: a correctness check against ``mla_decode_reference`` on the first ``--check-b`` sequences
(inputs N(0, 0.01): q, kv = 0.1 * randn; tolerance of tests/decode: abs 1e-3 or rel 2/128), then CUDA-event
medians (L2 flushed by writing a 256 MB buffer before each run, outside the events) of
  * ``e2e``: ``run_mla_decode_dense`` as called eagerly (GPU split plan + partial + combine + host overhead),
  * ``graph``: the same step captured in a CUDA graph and replayed (no host overhead: what a decode loop sees),
  * ``kernels``: partial + combine launches only (plan precomputed); where the fused kernel runs ("auto" /
    "narrow_fused" for s_q * H <= 32) its one launch.
Counts as ``flashdsa.bench``'s decode suite: bytes = cache rows x 1152 + q + out (+ lse), FLOPs =
2 * H * (576 + 512) per attended (query row, key) pair.
"""

import argparse
import json
import math
import statistics
import sys

import torch

try:
    import flashdsa  # noqa: F401
except ImportError:  # run from a checkout without an install: use its src/
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

CASES = {
    # name: (B, H, s_q, cache, causal, target)
    "mem": (64, 16, 1, 8192, True, ">= 3.8 TB/s"),
    "mem66": (66, 16, 1, 8192, True, "-"),  # 132 splits of 64 tiles: every SM busy (a load-balance probe)
    "h32": (64, 32, 1, 8192, True, "-"),  # the narrow kernel's widest row tile
    "h64": (64, 64, 1, 8192, True, "-"),
    "compute": (128, 128, 1, 8192, True, ">= 690 TFLOP/s"),
    "causal2": (128, 128, 2, 32768, True, ">= 780 TFLOP/s"),
}
BLOCK_SIZE = 64


def make_inputs(B, H, s_q, cache, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    nblk_seq = math.ceil(cache / BLOCK_SIZE)
    nblocks = B * nblk_seq
    perm = torch.randperm(nblocks, generator=g, device=device).int()
    table = perm.view(B, nblk_seq).contiguous()
    kv = (torch.randn(nblocks, BLOCK_SIZE, 576, generator=g, device=device) * 0.1).to(torch.bfloat16)
    q = (torch.randn(B, s_q, H, 576, generator=g, device=device) * 0.1).to(torch.bfloat16)
    lens = torch.full((B,), cache, dtype=torch.int32, device=device)
    return q, kv, table, lens


def check(kd, variant, q, kv, table, lens, causal, nb):
    from flashdsa.decode.reference import mla_decode_reference

    scale = 576 ** -0.5
    out, lse = kd.run_mla_decode_dense(q, kv, table, lens, sm_scale=scale, d_v=512, causal=causal, variant=variant)
    torch.cuda.synchronize()
    ro, rl = mla_decode_reference(q[:nb], kv, table[:nb], lens[:nb], sm_scale=scale, d_v=512, causal=causal)
    o, r = out[:nb].double(), ro.double()
    err = (o - r).abs()
    ok_o = bool(((err <= 1e-3) | (err <= (2 / 128) * r.abs())).all()) and not torch.isnan(out).any().item()
    lrel = ((lse[:nb].double() - rl.double()).abs() / rl.double().abs().clamp_min(1e-30)).max().item()
    ok_l = lrel <= 8 / 65536
    return dict(ok=ok_o and ok_l, out_max_abs_err=err.max().item(), lse_max_rel_err=lrel)


def time_events(fn, reps, flush):
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.fill_(i)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    t = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(t), min(t)


def bench_variant(kd, variant, q, kv, table, lens, causal, reps, flush):
    from flashdsa.bench.harness import capture_graph

    scale = 576 ** -0.5
    res = {}

    def e2e():
        return kd.run_mla_decode_dense(q, kv, table, lens, sm_scale=scale, d_v=512, causal=causal, variant=variant)

    res["e2e_ms"], res["e2e_min_ms"] = time_events(e2e, reps, flush)

    graph, _ = capture_graph(e2e)
    res["graph_ms"], res["graph_min_ms"] = time_events(graph.replay, reps, flush)

    # kernels only: the plan and buffers prepared once
    B, s_q, H, _ = q.shape
    M = s_q * H
    n_mt = (M + 63) // 64
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if variant != "pipelined":
        ws = kd._ws_module(variant, M)  # the module run_mla_decode_dense runs
        res["partial"] = ws.__name__.rsplit(".", 1)[-1]
        plan, seq_plan = kd._plan(lens, max_blocks=table.shape[1], block_size=BLOCK_SIZE, n_mt=n_mt,
                                  num_sms=num_sms * ws.ctas_per_sm(M), tile=ws.BLOCK_N,
                                  overhead=ws._OVERHEAD_TILES, min_chunk=ws._MIN_CHUNK_TILES)
        part = ws.compiled_partial(H, s_q, BLOCK_SIZE, causal, float(scale), False)
    else:
        res["partial"] = "kernel_dense"
        plan, seq_plan = kd._plan(lens, max_blocks=table.shape[1], block_size=BLOCK_SIZE, n_mt=n_mt,
                                  num_sms=num_sms)
        part = kd._compiled_partial(H, s_q, BLOCK_SIZE, causal, float(scale), False)
    comb = kd._compiled_combine(H, s_q, False)
    n_items = plan.shape[1]
    qf = q.reshape(B, M, 576).contiguous()
    sink = torch.zeros(1, dtype=torch.float32, device=q.device)
    out = torch.empty(B, M, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, M, dtype=torch.float32, device=q.device)
    o_part = torch.empty(n_items, M, 512, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(n_items, M, dtype=torch.float32, device=q.device)
    nsplit = seq_plan[1].cpu()
    res["splits_per_seq"] = sorted(set(int(x) for x in nsplit))
    res["ctas"] = int((plan[0] >= 0).sum()) * n_mt

    if kd._runs_fused(variant, M):  # "auto" / "narrow_fused" where the narrow kernel would run
        # the single launch replaces partial + combine (it derives the plan itself; same o_part / lse_part sizes)
        from flashdsa.decode import kernel_dense_fused as kf

        res["partial"] = "kernel_dense_fused"
        counters = kf.seq_counters(B, q.device)
        fused = kf._compiled(H, s_q, BLOCK_SIZE, causal, float(scale), False, num_sms * ws.ctas_per_sm(M),
                             kf._kn.THREADS, kf._kn.STAGES, kf._kn.LOADER)

        def kernels():
            fused(qf, kv, table, lens, sink, out, lse, o_part, lse_part, counters)
    else:
        def kernels():
            part(qf, kv, table, lens, plan, sink, out, lse, o_part, lse_part)
            comb(seq_plan, sink, o_part, lse_part, out, lse)

    res["kernels_ms"], res["kernels_min_ms"] = time_events(kernels, reps, flush)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="ws,pipelined")
    ap.add_argument("--cases", default="all")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check-b", type=int, default=4, help="sequences checked against the reference")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from flashdsa.bench import flops as F
    from flashdsa.decode import kernel_dense as kd

    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    variants = args.variants.split(",")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    results = []
    for name in names:
        B, H, s_q, cache, causal, target = CASES[name]
        q, kv, table, lens = make_inputs(B, H, s_q, cache)
        attended = F.causal_decode_keys(lens, s_q, causal)
        flop = F.decode_flops(H, attended)
        nbytes = F.decode_bytes(int(lens.long().sum()), F.KV_BF16_ROW_BYTES, B, s_q, H)
        for v_full in variants:
            # "narrow@128x1xtma": the narrow kernel built with 128 threads, 1 KV buffer, the TMA loader (module
            # defaults restored after)
            v, _, cfg = v_full.partition("@")
            row = dict(case=name, B=B, H=H, s_q=s_q, cache=cache, causal=causal, block_size=BLOCK_SIZE,
                       variant=v_full, target=target, flops=flop, bytes=nbytes)
            from flashdsa.decode import kernel_dense_narrow as kn

            saved = (kn.THREADS, kn.STAGES, kn.LOADER)
            if cfg:
                t, st, ld = (cfg.split("x") + ["tma"])[:3]
                kn.THREADS, kn.STAGES, kn.LOADER = int(t), int(st), ld
            try:
                row["check"] = check(kd, v, q, kv, table, lens, causal, min(args.check_b, B))
                row.update(bench_variant(kd, v, q, kv, table, lens, causal, args.reps, flush))
                for k in ("e2e", "graph", "kernels"):
                    ms = row[f"{k}_ms"]
                    row[f"{k}_tflops"] = flop / ms / 1e9
                    row[f"{k}_tbps"] = nbytes / ms / 1e9
            except Exception as e:  # keep timing the other variants / cases
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                kn.THREADS, kn.STAGES, kn.LOADER = saved
            results.append(row)
            msg = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()
                   if k in ("case", "variant", "partial", "check", "error", "ctas", "splits_per_seq") or k.endswith(
                       ("_ms", "_tflops", "_tbps"))}
            print(json.dumps(msg), flush=True)
        del q, kv, table, lens
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), results=results), f, indent=1)
    return 0 if all("error" not in r and r["check"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
