"""One launch target per name, for ``ncu`` (run on the GPU host): a warm-up call, then ``--reps`` calls.

    ncu -k regex:NAME --launch-skip 1 --launch-count 1 python scripts/ncu_targets.py TARGET

Targets: topk_4096x8192 / topk_64x32768 (one-CTA radix kernel, smem key cache), topk_4096x8192_regs (keys in
registers, ``kernel_radix_regs``),
paged_nn2 / paged_nn1 (pipelined paged indexer, B 128, ctx 32768, H 64, D 128, block 64), decode_mem (dense bf16
decode B 64, H 16, s_q 1, cache 8192: the issue's memory-bound case), sparse_pair / sparse_pair_cache (the pair
forward on bf16 rows / the 656-byte FP8 cache: S 1056 = 8 waves, H 128, SKV 8192, topk 2048), sparse_pair_fp8 (the
FP8-compute pair forward, same shape), sparse_pair_hop (the bf16 pair kernel through the converter warpgroup's
hop: ``kernel_fwd_pair`` ``hop=True``), sparse_pair_cache_no_convert (the 656-byte cache kernel without the
conversion, wrong results), sparse_pair_cache_contig_no_convert (the same with the raw bytes landing contiguously),
decode_sparse_fp8_h16 (sparse decode over the 656-byte cache, B 128, H 16,
s_q 1, topk 2048, cache 32768: the issue's 3.0 TB/s case), sparse_mma_ws_h16 (``kernel_fwd_mma_ws``, S 4096 over
SKV 8192, H 16, topk 2048: #8's H 16 row).
"""

import sys

import torch


def main():
    name = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    dev = torch.device("cuda")
    if name.startswith("topk"):
        from flashdsa.topk import kernel_radix as kr

        M, N = (int(v) for v in name.split("_")[1].split("x"))
        x = torch.randn(M, N, device=dev)
        impl = "regs" if name.endswith("regs") else "single"
        fn = lambda: kr.run_topk_indices(x, 2048, impl=impl)  # noqa: E731
    elif name == "decode_mem":
        sys.path.insert(0, "scripts")
        from bench_decode import make_inputs

        from flashdsa.decode import kernel_dense as kd

        q, kv, table, lens = make_inputs(64, 16, 1, 8192)
        fn = lambda: kd.run_mla_decode_dense(q, kv, table, lens, sm_scale=576**-0.5, d_v=512, causal=True)  # noqa
    elif name == "decode_sparse_fp8_h16":
        from flashdsa import mla_decode
        from flashdsa.bench import suites

        g = torch.Generator(device=dev).manual_seed(0)
        case = [c for c in suites.decode_cases(True) if c.name.startswith("sparse_fp8_B128_H16")][0]
        inp = case.build(dev, g)
        fn = lambda: mla_decode(inp["q"], inp["kv_cache"], None, None, indices=inp["indices"])  # noqa: E731
    elif name == "sparse_mma_ws_h16":
        from flashdsa.sparse import kernel_fwd, kernel_fwd_mma_ws

        g = torch.Generator(device=dev).manual_seed(0)
        q, kv, idx = kernel_fwd._prefill_inputs(g, S=4096, SKV=8192, H=16, topk=2048)
        fn = lambda: kernel_fwd.launch(kernel_fwd_mma_ws._compiled, q, kv, idx, sm_scale=576**-0.5, d_v=512)  # noqa
    elif name == "sparse_pair_fp8":
        from flashdsa.quant import quantize_fp8
        from flashdsa.sparse import kernel_fwd_pair_fp8

        g = torch.Generator(device=dev).manual_seed(0)
        q8, qs = quantize_fp8(torch.randn(1056, 128, 576, generator=g, device=dev) * 0.1, block=576)
        kv8, ks = quantize_fp8(torch.randn(8192, 576, generator=g, device=dev) * 0.1, block=576)
        idx = torch.argsort(torch.rand(1056, 8192, generator=g, device=dev), dim=1)[:, :2048].to(torch.int32)
        fn = lambda: kernel_fwd_pair_fp8.run_sparse_mla_fwd_fp8(q8, kv8, idx, q_scale=qs[..., 0], kv_scale=ks[..., 0],  # noqa
                                                                 sm_scale=576**-0.5, d_v=512)
    elif name in ("sparse_pair", "sparse_pair_cache", "sparse_pair_hop", "sparse_pair_cache_no_convert",
                  "sparse_pair_cache_contig_no_convert"):
        from flashdsa.quant import dequantize_kv_fp8, quantize_kv_fp8
        from flashdsa.sparse import kernel_fwd_pair, kernel_fwd_pair_cache

        g = torch.Generator(device=dev).manual_seed(0)
        n_tok, tkv = 1056, 8192
        q = (torch.randn(n_tok, 128, 576, generator=g, device=dev) * 0.1).to(torch.bfloat16)
        kv8 = quantize_kv_fp8((torch.randn(tkv, 576, generator=g, device=dev) * 0.1).to(torch.bfloat16))
        idx = torch.argsort(torch.rand(n_tok, tkv, generator=g, device=dev), dim=1)[:, :2048].to(torch.int32)
        kw = dict(sm_scale=576**-0.5, d_v=512)
        if name == "sparse_pair":
            kv = dequantize_kv_fp8(kv8)
            fn = lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv, idx, **kw)  # noqa: E731
        elif name == "sparse_pair_hop":
            from flashdsa.sparse import kernel_fwd

            kv = dequantize_kv_fp8(kv8)
            build = lambda *a: kernel_fwd_pair._compiled(*a, (("hop", True), ("row_gather", True)))  # noqa: E731
            fn = lambda: kernel_fwd.launch(build, q, kv, idx, **kw)  # noqa: E731
        else:
            ablate = name[len("sparse_pair_cache_"):]
            fn = lambda: kernel_fwd_pair_cache.run_sparse_mla_fwd(q, kv8, idx, ablate=ablate, **kw)  # noqa: E731
    else:
        sys.path.insert(0, "scripts")
        from bench_paged_indexer import SHAPES, build_inputs

        from flashdsa.indexer import kernel_paged as kp

        inp = build_inputs(**SHAPES[name.split("_")[1]])
        fn = lambda: kp.run_indexer_logits_paged(inp["q"], inp["k_cache"], inp["weights"], inp["context_lens"],  # noqa
                                                 inp["block_table"], inp["k_scale_cache"], inp["max_context"])
    for _ in range(1 + reps):
        fn()
    torch.cuda.synchronize()
    print("done", name)


if __name__ == "__main__":
    main()
