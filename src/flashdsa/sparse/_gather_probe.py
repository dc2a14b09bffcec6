"""Gather probe for issue #8: one TMA load per (row, 128-byte column tile) vs the cp.async gather.  Not dispatched.

Why: every sparse forward here moves its top-k KV rows from L2 into shared memory at 2.2-2.4 TB/s and is bound by
it (docs/PERFORMANCE.md); 72 16-byte cp.async per 1152-byte row is the suspected limit.  On sm_90 TMA has no row
gather, but a 2-D tensor map over KV ``[Tkv, Dqk]`` bf16 with a ``1 x 64`` box and the 128-byte swizzle writes one
row's 128-byte column tile, swizzled by the destination address bits, exactly where TileLang's 128B-swizzled wgmma
layout of a ``[64, Dqk]`` tile keeps it (column tile ``j`` of row ``r`` at byte ``8192 j + 128 r``; the 16-byte
chunks XOR ``r & 7``, the same function of the address).  Rows outside ``[0, Tkv)`` (``-1``, ``INT_MIN``, ``Tkv``,
...) are out of bounds for the tensor map: TMA zero-fills them and reads nothing, and their bytes still count
toward the mbarrier's transaction total.  So a block of 64 rows is ``64 x 9`` TMA instructions (issued by 64
threads) instead of ``64 x 72`` cp.async.

The probe kernel (both modes): grid ``(T,)``, 256 threads; per token a ``Q [64, Dqk]`` tile and ``NB`` blocks of 64
slot indices; each block is gathered into one of two KV buffers (block i+1 in flight while block i is used) and
``acc += Q K^T`` (wgmma).  Output ``O[t] = acc`` (``[64, 64]`` fp32).  The two modes run the same wgmmas on the same
tiles, so their outputs must be bitwise equal; a torch check gives ``sum_b Q K_b^T`` with invalid rows as zeros.
``python -m flashdsa.sparse._gather_probe`` (GPU) checks both and times them (gathered bytes / time).

Measured (H200, session 6; GPU test ``tests/sparse_mla/test_gather_probe.py``: 2 passed, outputs bitwise equal):
S 4096 x 32 blocks x 64 rows x 1152 B = 9.66 GB, L2-resident KV: cp.async **2.01 ms = 4.81 TB/s**, TMA **9.88 ms =
0.98 TB/s**.  One tensor-map load per 128 bytes costs far more than 16-byte cp.async: no lever for the forwards,
whose 2.2-2.4 TB/s come from their per-block chain (docs/PERFORMANCE.md, "Sparse MLA forward").
"""

import functools

import torch

import tilelang
import tilelang.language as T

from . import _tl_common as tc

BI = 64  # rows per block
BH = 64  # Q rows
TILE = 64  # bf16 columns per 128-byte TMA box
_DT_BF16 = 9  # CUtensorMapDataType of bfloat16 in TileLang's descriptor encoding
_SWIZZLE_128B = 3

# TileLang addresses a swizzled shared buffer only element-wise; the TMA destination is the 128-byte line start,
# computed from the tile's base pointer (the prelude comes before TileLang's includes: plain C++ only).
_PRELUDE = "__device__ __forceinline__ void* fdsa_byte_ptr(void* p, int off) { return (char*)p + off; }\n"


def build_gather_qk(*, dqk: int, n_blocks: int, mode: str):
    """Probe prim_func ``(Q[T, 64, dqk] bf16, KV[Tkv, dqk] bf16, Idx[T, 64 * n_blocks] i32, O[T, 64, 64] f32)``."""
    assert mode in ("tma", "cpasync"), mode
    assert dqk % TILE == 0
    NT = dqk // TILE
    tile_bytes = BI * dqk * 2
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv = tc.dynamic_dims("n_tok", "n_kv")

    @T.macro
    def gather_tma(KV, Idx, Q_s, KV_s, acc, bx):
        bar = T.alloc_barrier([1, 1])
        # global shape (dqk, Tkv), strides (2 B, 2 dqk B), box (64, 1), unit element strides, no interleave,
        # 128-byte swizzle, 256-byte L2 promotion, zero fill out of bounds
        desc = T.create_tma_descriptor(_DT_BF16, 2, KV.data, dqk, n_kv, 2, dqk * 2, TILE, 1, 1, 1, 0,
                                       _SWIZZLE_128B, 2, 0)
        tx = T.get_thread_binding()
        for it in T.serial(n_blocks + 1):
            # issue block it into buffer it % 2 (read by block it-2's wgmma, which every thread has finished:
            # the barrier at the end of the previous iteration)
            if it < n_blocks:
                if tx == 0:
                    T.mbarrier_expect_tx(bar[it % 2], tile_bytes)
                    T.barrier_arrive(bar[it % 2])
                if tx < BI:
                    for j in T.unroll(NT):
                        T.tma_load(desc, bar[it % 2],
                                   T.call_extern("handle", "fdsa_byte_ptr", T.access_ptr(KV_s[0, 0, 0], "w"),
                                                 (it % 2) * tile_bytes + j * (BI * 128) + tx * 128),
                                   j * TILE, Idx[bx, it * BI + tx], 0)
            # consume block it-1
            if it > 0:
                T.mbarrier_wait_parity(bar[(it - 1) % 2], ((it - 1) // 2) % 2)
                T.gemm(Q_s, KV_s[(it - 1) % 2, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.sync_threads()

    @T.macro
    def gather_cpasync(KV, Idx, Q_s, KV_s, acc, bx):
        for it in T.Pipelined(n_blocks, num_stages=2):
            for r, d in T.Parallel(BI, dqk):
                KV_s[r, d] = KV[Idx[bx, it * BI + r], d]  # safe-access predicate: zero fill out of range
            T.gemm(Q_s, KV_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    @T.prim_func
    def gather_qk(
        Q: T.Tensor([n_tok, BH, dqk], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Idx: T.Tensor([n_tok, BI * n_blocks], i32),
        O: T.Tensor([n_tok, BH, BI], f32),
    ):
        with T.Kernel(n_tok, threads=256, prelude=_PRELUDE if mode == "tma" else "") as bx:
            Q_s = T.alloc_shared([BH, dqk], bf16)
            # "tma": two explicit buffers; "cpasync": T.Pipelined multi-buffers the one tile itself
            KV_s = T.alloc_shared([2, BI, dqk] if mode == "tma" else [BI, dqk], bf16)
            acc = T.alloc_fragment([BH, BI], f32)
            T.copy(Q[bx, :, :], Q_s)
            T.clear(acc)
            if mode == "tma":
                gather_tma(KV, Idx, Q_s, KV_s, acc, bx)
            else:
                gather_cpasync(KV, Idx, Q_s, KV_s, acc, bx)
            T.copy(acc, O[bx, :, :])

    return gather_qk


def pass_configs(mode: str):
    # TMA lowering stays on for the "tma" mode (the descriptor is hoisted into the host code); no automatic warp
    # specialisation in either
    if mode == "tma":
        return {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return tc.plain_pass_configs()


@functools.lru_cache(maxsize=8)
def _compiled(dqk: int, n_blocks: int, mode: str):
    return tilelang.compile(build_gather_qk(dqk=dqk, n_blocks=n_blocks, mode=mode), target="cuda",
                            pass_configs=pass_configs(mode))


def run_gather_qk(q, kv, idx, mode: str):
    """``O[t] = sum_b Q[t] K_b^T`` with ``K_b`` the rows ``idx[t, 64 b : 64 b + 64]`` (zeros where out of range)."""
    n_tok, bh, dqk = q.shape
    assert bh == BH and idx.shape[1] % BI == 0
    out = torch.empty((n_tok, BH, BI), dtype=torch.float32, device=q.device)
    _compiled(dqk, idx.shape[1] // BI, mode)(q, kv, idx, out)
    return out


def reference_gather_qk(q, kv, idx):
    """fp32 torch version of the probe's output."""
    ok = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[idx.clamp(0, kv.shape[0] - 1).long()].float()  # [T, 64 NB, dqk]
    rows = torch.where(ok.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    k = rows.view(idx.shape[0], -1, BI, kv.shape[1])
    return torch.einsum("thd,tbrd->thr", q.float(), k)


def lowering_cases():
    return [(f"gather_qk_{m}_d576_nb4", build_gather_qk(dqk=576, n_blocks=4, mode=m), pass_configs(m))
            for m in ("tma", "cpasync")]


def _main():
    from ..bench.harness import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    S, SKV, dqk, nb = 4096, 8192, 576, 32
    q = (torch.randn(S, BH, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    kv = (torch.randn(SKV, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(S, SKV, generator=gen, device="cuda"), dim=1)[:, : BI * nb].int().contiguous()
    idx[::7, ::5] = -1
    idx[3, :] = torch.iinfo(torch.int32).min
    outs = {m: run_gather_qk(q, kv, idx, m) for m in ("cpasync", "tma")}
    ref = reference_gather_qk(q[:64], kv, idx[:64])
    err = (outs["tma"][:64] - ref).abs().max().item()
    print(f"tma vs cpasync bitwise equal: {torch.equal(outs['tma'], outs['cpasync'])}; tma vs torch max |diff| {err:.2e}")
    gathered = S * nb * BI * dqk * 2
    for m in ("cpasync", "tma"):
        ms = time_fn(lambda _, m=m: run_gather_qk(q, kv, idx, m), [None], q.device, reps=20).ms_median
        print(f"{m}: {ms:.3f} ms, gather {gathered / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    _main()
