"""Where the V4 decode-shaped forward's time goes (run on the GPU host): kernel times of the pair forward at
b 128, m 1, h 64, d 512, topk 640 (the suite's ``V4_sparse_attn_decode_*`` case, flat form) under builds and
index pools that separate its parts.

    python scripts/v4_decode_probe.py [--short] [--json FILE]   (--short: the rows up to ``read_flush_no_hint``)

Rows (kernel only, ``bench.harness.time_fn`` median, L2 flushed):
  * ``dispatched``: the dispatched build (persistent grid + row gather with the L2 evict_first policy: each KV
    row is read about once), each token's rows in its own 8192-row batch (1 GiB of KV: the gathered rows come
    from DRAM), as in the suite;
  * ``l2_pool``: the build without the policy, every token's rows drawn from one 16384-row pool (16 MiB,
    L2-resident after the first touch): the DRAM latency's share;
  * ``no_gather``: the ``ablate="no_gather"`` timing build (protocol kept, no copies): the products' and the
    softmax's share;
  * ``per_item_topk{320,640,1280}``: one CTA per token at three topk (fixed per-CTA cost vs per-block cost);
  * ``l2_prefetch_{C}`` (dispatched build): a separate launch first issues one ``cp.async.bulk.prefetch.L2`` per selected row of
    each token's first C top-k columns, then the dispatched forward (both inside the timed call): whether DRAM
    requests kept in flight outside the forward's pipeline shorten it;
  * ``no_hint`` / ``dispatched_again`` (alternating, twice): the gather without / with the evict_first policy
    (with it the streamed KV rows replace each other in L2 instead of the flush's dirty lines: fewer write-backs
    inside the timed kernel; session 31: 40.5-40.8 vs 37.3-37.6 us);
  * ``read_flush_no_hint``: the build without the policy timed after a read flush (``$FLASHDSA_L2_FLUSH=read``,
    diagnostic): what the write-back of the suite's write flush costs this DRAM-bound shape (35.4 us).
Outputs of the first two rows are checked against the reference on a few tokens (they must be correct builds).
"""

import json
import sys

import torch

import os

import tilelang
import tilelang.language as T

from flashdsa import _dispatch
from flashdsa.bench.harness import time_fn
from flashdsa.sparse import kernel_fwd, kernel_fwd_pair
from flashdsa.sparse.reference import sparse_mla_fwd_reference

B, H, D, NKV = 128, 64, 512, 8192
_I32, _BF16 = "int32", "bfloat16"


_PF_SRC = r"""
__device__ __forceinline__ void fdsa_prefetch_row(const void *p, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
"""


def _build_prefetch(cols):
    """prim_func (Idx [n_rows, k] i32, KV [n_kv, D] bf16): bulk L2 prefetch of the rows of columns < cols."""
    n_rows, k, n_kv = T.dynamic("n_rows"), T.dynamic("k"), T.dynamic("n_kv")

    @T.prim_func
    def prefetch_rows(Idx: T.Tensor([n_rows, k], _I32), KV: T.Tensor([n_kv, D], _BF16)):
        # x = token (dispatched first): every token's first 128 columns are requested before any token's next
        with T.Kernel(n_rows, T.ceildiv(cols, 128), threads=128, prelude=_PF_SRC) as (row, chunk):
            c = chunk * 128 + T.get_thread_binding()
            if c < k:
                v = Idx[row, c]
                if v >= 0:
                    if v < n_kv:
                        T.call_extern("handle", "fdsa_prefetch_row", T.address_of(KV[v, 0]), D * 2)

    return tilelang.compile(prefetch_rows, target="cuda")


def _indices(gen, topk, pool=None):
    """[B, topk] flat rows: token b's unique rows in batch b's range, or (pool) in [0, pool)."""
    span = NKV if pool is None else pool
    keys = torch.rand(B, span, generator=gen, device="cuda")
    idx = torch.argsort(keys, dim=1)[:, :topk].int()
    if pool is None:
        idx += (torch.arange(B, device="cuda", dtype=torch.int32) * NKV).view(B, 1)
    return idx.contiguous()


def main(json_path=None):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, D, generator=gen, device=dev).bfloat16()
    kv = torch.randn(B * NKV, D, generator=gen, device=dev).bfloat16()
    sink = torch.randn(H, generator=gen, device=dev)
    scale = D ** -0.5
    n_sm = _dispatch.sm_count(0)
    rows = []

    def run(label, build_kw, idx, check=False, prefetch=None):
        fn = (lambda *a: kernel_fwd_pair._compiled(*a, build_kw))

        def call(_):
            if prefetch is not None:
                prefetch(idx, kv)
            return kernel_fwd.launch(fn, q, kv, idx, sm_scale=scale, d_v=D, attn_sink=sink)

        out = call(None)
        if check:
            sel = torch.arange(0, B, 17, device=dev)
            ref, _, _ = sparse_mla_fwd_reference(q[sel].float(), kv.float(), idx[sel], sm_scale=scale, d_v=D,
                                                 attn_sink=sink)
            err = (out[0][sel].float() - ref).abs().max().item()
            assert err < 2e-2, (label, err)
        ms = time_fn(call, [None], dev, reps=40).ms_median
        rows.append(dict(label=label, topk=idx.shape[1], us=round(ms * 1e3, 2)))
        print(f"{label}: {ms * 1e3:.1f} us", flush=True)

    idx640 = _indices(gen, 640)
    dispatched = kernel_fwd_pair.dispatched_kw(q, 10, kv.shape[0])
    assert ("evict_first", True) in dispatched
    run("dispatched", dispatched, idx640, check=True)
    run("l2_pool", kernel_fwd_pair._persistent_kw(10, n_sm), _indices(gen, 640, pool=16384), check=True)
    for rep in range(2):
        run("no_hint", kernel_fwd_pair._persistent_kw(10, n_sm), idx640, check=rep == 0)
        run("dispatched_again", dispatched, idx640)
    os.environ["FLASHDSA_L2_FLUSH"] = "read"
    run("read_flush_no_hint", kernel_fwd_pair._persistent_kw(10, n_sm), idx640)
    del os.environ["FLASHDSA_L2_FLUSH"]
    if "--short" in sys.argv:
        rows_out(rows, json_path)
        return
    for cols in (128, 256, 384, 640):
        run(f"l2_prefetch_{cols}", dispatched, idx640, check=cols == 256,
            prefetch=_build_prefetch(cols))
    run("no_gather", (("ablate", "no_gather"), ("persistent", n_sm)), idx640)
    for topk in (320, 640, 1280):
        run(f"per_item_topk{topk}", kernel_fwd_pair.ROW_GATHER_KW, idx640 if topk == 640 else _indices(gen, topk))
    rows_out(rows, json_path)


def rows_out(rows, json_path):
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), shape=dict(b=B, m=1, h=H, d=D, n=NKV), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[args.index("--json") + 1] if "--json" in args else None)
