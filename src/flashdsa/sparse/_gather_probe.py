"""Gather probe for issue #8: how fast can top-k KV rows move from L2 into shared memory?  Not dispatched.

Every sparse forward here gathers its top-k rows (1152 B each) from L2 into shared memory and moves 2.2-2.4 TB/s
(docs/PERFORMANCE.md).  The probe kernel: grid ``(T,)``, 256 threads; per token ``NB`` blocks of 64 slot indices,
each gathered with predicated zero-filling cp.async (``T.Pipelined``) and multiplied by a Q tile (wgmma),
``O[t] = sum_b Q K_b^T`` (``[64, 64]`` fp32; invalid rows are zeros).

  * mode "cpasync": the forward's shape -- two stages, ``Q [64, Dqk]``, QK over all Dqk dims.
  * mode "deep": three stages (three 72 KB tiles in flight), QK over the first 64 dims only (``Q [64, 64]``): the
    gather rate with the tensor work out of the way, i.e. what L2 can deliver to one CTA per SM.

Measured (H200, session 6; S 4096 x 32 blocks x 64 rows x 1152 B = 9.66 GB, L2-resident KV): "cpasync" 2.01 ms =
**4.81 TB/s**.  A per-row TMA gather (one 1 x 64 tensor-map box per row and 128-byte column tile) was measured in
the same run at 9.88 ms = 0.98 TB/s and removed.  "deep" not run yet: ``pytest -m gpu
tests/sparse_mla/test_gather_probe.py`` then ``python -m flashdsa.sparse._gather_probe``.
"""

import functools

import torch

import tilelang
import tilelang.language as T

from .._tilelang import plain_pass_configs
from . import _tl_common as tc

BI = 64  # rows per block
BH = 64  # Q rows
MODES = ("cpasync", "deep")


def q_cols(dqk: int, mode: str) -> int:
    """Q / K columns in the probe's QK product."""
    return dqk if mode == "cpasync" else 64


def build_gather_qk(*, dqk: int, n_blocks: int, mode: str, l2_prefetch: bool = False):
    """Probe prim_func ``(Q[T, 64, q_cols] bf16, KV[Tkv, dqk] bf16, Idx[T, 64 * n_blocks] i32, O[T, 64, 64] f32)``;
    ``l2_prefetch``: the gather's cp.async carry ``.L2::128B``."""
    assert mode in MODES, mode
    QC = q_cols(dqk, mode)
    stages = 2 if mode == "cpasync" else 3
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    n_tok, n_kv = tc.dynamic_dims("n_tok", "n_kv")

    @T.prim_func
    def gather_qk(
        Q: T.Tensor([n_tok, BH, QC], bf16),
        KV: T.Tensor([n_kv, dqk], bf16),
        Idx: T.Tensor([n_tok, BI * n_blocks], i32),
        O: T.Tensor([n_tok, BH, BI], f32),
    ):
        with T.Kernel(n_tok, threads=256, prelude=tc.L2_PREFETCH_PRELUDE if l2_prefetch else None) as bx:
            Q_s = T.alloc_shared([BH, QC], bf16)
            KV_s = T.alloc_shared([BI, dqk], bf16)
            acc = T.alloc_fragment([BH, BI], f32)
            T.copy(Q[bx, :, :], Q_s, disable_tma=True)
            T.clear(acc)
            for it in T.Pipelined(n_blocks, num_stages=stages):
                for r, d in T.Parallel(BI, dqk):
                    KV_s[r, d] = KV[Idx[bx, it * BI + r], d]  # safe-access predicate: zero fill out of range
                T.gemm(Q_s, KV_s[:, 0:QC], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, O[bx, :, :])

    return gather_qk


@functools.lru_cache(maxsize=8)
def _compiled(dqk: int, n_blocks: int, mode: str, l2_prefetch: bool = False):
    return tilelang.compile(build_gather_qk(dqk=dqk, n_blocks=n_blocks, mode=mode, l2_prefetch=l2_prefetch),
                            target="cuda", pass_configs=plain_pass_configs())


def run_gather_qk(q, kv, idx, mode: str, l2_prefetch: bool = False):
    """``O[t] = sum_b Q[t] K_b^T`` with ``K_b`` the rows ``idx[t, 64 b : 64 b + 64]`` (zeros where out of range),
    over the first ``q.shape[-1]`` columns."""
    n_tok, bh, qc = q.shape
    assert bh == BH and idx.shape[1] % BI == 0 and qc == q_cols(kv.shape[1], mode)
    out = torch.empty((n_tok, BH, BI), dtype=torch.float32, device=q.device)
    _compiled(kv.shape[1], idx.shape[1] // BI, mode, l2_prefetch)(q, kv, idx, out)
    return out


def reference_gather_qk(q, kv, idx):
    """fp32 torch version of the probe's output."""
    ok = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[idx.clamp(0, kv.shape[0] - 1).long()].float()  # [T, 64 NB, dqk]
    rows = torch.where(ok.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    k = rows.view(idx.shape[0], -1, BI, kv.shape[1])[..., : q.shape[-1]]
    return torch.einsum("thd,tbrd->thr", q.float(), k)


def lowering_cases():
    return [(f"gather_qk_{m}_d576_nb4", build_gather_qk(dqk=576, n_blocks=4, mode=m), plain_pass_configs())
            for m in MODES] + [
        ("gather_qk_deep_d576_nb4_l2pf", build_gather_qk(dqk=576, n_blocks=4, mode="deep", l2_prefetch=True),
         plain_pass_configs())]


def _main():
    from ..bench.harness import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    S, SKV, dqk, nb = 4096, 8192, 576, 32
    kv = (torch.randn(SKV, dqk, generator=gen, device="cuda") * 0.1).bfloat16()
    idx = torch.argsort(torch.rand(S, SKV, generator=gen, device="cuda"), dim=1)[:, : BI * nb].int().contiguous()
    idx[::7, ::5] = -1
    idx[3, :] = torch.iinfo(torch.int32).min
    gathered = S * nb * BI * dqk * 2
    for m in MODES:
        q = (torch.randn(S, BH, q_cols(dqk, m), generator=gen, device="cuda") * 0.1).bfloat16()
        for pf in (False, True):
            err = (run_gather_qk(q, kv, idx, m, pf)[:64] - reference_gather_qk(q[:64], kv, idx[:64])).abs().max().item()
            ms = time_fn(lambda _, m=m, q=q, pf=pf: run_gather_qk(q, kv, idx, m, pf), [None], q.device,
                         reps=20).ms_median
            print(f"{m}{' L2::128B' if pf else ''}: vs torch max |diff| {err:.2e}; {ms:.3f} ms, gather "
                  f"{gathered / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    _main()
