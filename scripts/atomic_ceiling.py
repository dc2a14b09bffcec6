"""How fast can fp32 reductions into an L2-resident buffer go on this GPU?  (The backward's dkv atomics, issue #3.)

The sparse MLA backward adds every (token, slot) contribution to ``dkv[row, :Dqk]`` (fp32, [Tkv, Dqk], 18.9 MB at
Tkv 8192 / Dqk 576: L2-resident) with ``red.global.add``.  At H 64 its main kernel takes 11.0 ms, 5.4 ms without
the reductions (19.3 GB of them).  This script measures what reductions alone can reach, so the next design knows
whether the bytes (L2's reduction rate) or their coupling to the tensor work is what binds.

Each CTA (256 threads, no other work) adds the value 1.0 to a 64-row x ``ncols`` block of ``dkv`` at 64 random rows
(as one top-k block of the backward), in the pattern named by the mode:

  * ``frag2``: the wgmma accumulator fragment of the backward's fast path, ``red.global.add.v2.f32``: warp w of a
    warpgroup holds rows 16 (w % 4) + lane / 4 (+ 8), columns 2 (lane % 4) + 8 j of its 32-column half of a
    64-column chunk;
  * ``row4``: 16 lanes per row, ``red.global.add.v4.f32`` (a 256-byte contiguous run per row and chunk);
  * ``row1``: a warp covers 32 contiguous floats of one row, ``red.global.add.f32``;
  * ``store4``: the ``row4`` pattern as plain 16-byte stores (the write ceiling for comparison);
  * the ``frag2`` fragment rearranged by shuffles into 16-byte reductions (``oct4`` is what ``kernel_bwd``
    dispatches, ``red = "oct4"``): ``pair4`` 16 rows x 32 bytes per warp instruction (session 5's lane-pair shuffle), ``quad4`` 8 rows x
    64 bytes (each quad one row's 16 columns), ``oct4`` 4 rows x 128 bytes (each 8-lane group one row's 32
    columns).

``--occupancy 1`` makes each CTA hold 200 KiB of shared memory (one CTA per SM with 8 warps, as the backward);
else as many CTAs as fit.  Checked: with 1.0 added everywhere the buffer's sum equals the count of reductions
(exact in fp32: every element receives an integer count far below 2^24).

Usage (GPU host): ``source .gpu/env.sh && python scripts/atomic_ceiling.py [--modes frag2,row4,row1,store4]
[--blocks 16384] [--tkv 8192] [--ncols 576] [--json out.json]``
"""

import argparse
import json
import statistics

import torch

PRELUDE = r"""
template <int MODE>
__device__ __forceinline__ void fdsa_red_block(float *dkv, const int *rows, float *pad, int ld, int nchunk, int t) {
  if (pad) pad[t] = 1.0f;  // keeps the occupancy build's shared memory allocated
  const int lane = t & 31, w = (t >> 5) & 3, wg = t >> 7;
  for (int c = 0; c < nchunk; ++c) {
    if (MODE == 0) {  // frag2
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          float *p = dkv + (long)rows[16 * w + (lane >> 2) + 8 * rh] * ld + c * 64 + wg * 32 + 8 * j + 2 * (lane & 3);
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(1.0f), "f"(1.0f) : "memory");
        }
    } else if (MODE == 1 || MODE == 3) {  // row4 / store4
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float *p = dkv + (long)rows[(t >> 4) + 16 * k] * ld + c * 64 + 4 * (t & 15);
        if (MODE == 1)
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(1.0f), "f"(1.0f), "f"(1.0f),
                       "f"(1.0f) : "memory");
        else
          asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(1.0f), "f"(1.0f), "f"(1.0f),
                       "f"(1.0f) : "memory");
      }
    } else if (MODE == 4 || MODE == 5 || MODE == 6) {  // pair4 / quad4 / oct4 (addresses only, values 1.0)
      const int q = lane & 3, odd = q & 1, r0 = 16 * w + (lane >> 2), up = (lane >> 2) & 1;
      const int c4 = c * 64 + wg * 32 + (odd ? 6 + 2 * q : 2 * q);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int row, col;
        if (MODE == 4) {
          row = r0 + (odd ? 8 : 0);
          col = c * 64 + wg * 32 + 2 * (q & 2) + 8 * i;
        } else if (MODE == 5) {
          row = r0 + 8 * (i >> 1);
          col = c4 + 16 * (i & 1);
        } else {
          row = (up ? r0 - 1 : r0) + (i & 1) + 8 * (i >> 1);
          col = c4 + 16 * up;
        }
        float *p = dkv + (long)rows[row] * ld + col;
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(1.0f), "f"(1.0f), "f"(1.0f),
                     "f"(1.0f) : "memory");
      }
    } else {  // row1
#pragma unroll
      for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float *p = dkv + (long)rows[(t >> 5) + 8 * k] * ld + c * 64 + 32 * h + lane;
          asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(1.0f) : "memory");
        }
    }
  }
}
"""
MODES = {"frag2": 0, "row4": 1, "row1": 2, "store4": 3, "pair4": 4, "quad4": 5, "oct4": 6}


def build(mode: str, ncols: int, occupancy1: bool):
    import tilelang.language as T

    assert ncols % 64 == 0
    nb, tkv = T.dynamic("NB"), T.dynamic("TKV")
    code = MODES[mode]
    f32, i32 = "float32", "int32"

    @T.prim_func
    def red_ceiling(DKV: T.Tensor([tkv, ncols], f32), Rows: T.Tensor([nb, 64], i32)):
        with T.Kernel(nb, threads=256, prelude=PRELUDE) as bx:
            tx = T.get_thread_binding()
            if occupancy1:
                pad = T.alloc_shared([51200], "float32")
                T.call_extern("handle", f"fdsa_red_block<{code}>", T.address_of(DKV[0, 0]),
                              T.address_of(Rows[bx, 0]), T.address_of(pad[0]), ncols, ncols // 64, tx)
            else:
                T.call_extern("handle", f"fdsa_red_block<{code}>", T.address_of(DKV[0, 0]),
                              T.address_of(Rows[bx, 0]), 0, ncols, ncols // 64, tx)

    return red_ceiling


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="frag2,pair4,quad4,oct4,row4,row1,store4")
    ap.add_argument("--occupancy", default="1,max", help="comma list of 1 / max")
    ap.add_argument("--blocks", type=int, default=16384)
    ap.add_argument("--tkv", type=int, default=8192)
    ap.add_argument("--ncols", type=int, default=576)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import tilelang

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randint(0, a.tkv, (a.blocks, 64), device=dev, generator=g, dtype=torch.int32)
    dkv = torch.zeros((a.tkv, a.ncols), device=dev, dtype=torch.float32)
    n_red = a.blocks * 64 * a.ncols
    out = []
    for occ in a.occupancy.split(","):
        for mode in a.modes.split(","):
            kern = tilelang.compile(build(mode, a.ncols, occ == "1"), target="cuda")
            dkv.zero_()
            kern(dkv, rows)
            torch.cuda.synchronize()
            total = float(dkv.double().sum())
            ok = total == n_red if mode != "store4" else True
            ms = []
            for _ in range(a.reps):
                dkv.zero_()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                kern(dkv, rows)
                e1.record()
                torch.cuda.synchronize()
                ms.append(e0.elapsed_time(e1))
            med = statistics.median(ms)
            tbs = n_red * 4 / med / 1e9
            row = dict(mode=mode, occupancy=occ, blocks=a.blocks, tkv=a.tkv, ncols=a.ncols, ms=round(med, 4),
                       p10=round(sorted(ms)[len(ms) // 10], 4), tb_s=round(tbs, 3), sum_ok=ok)
            out.append(row)
            print(f"{mode:7s} occ {occ:3s}: {med:.4f} ms  {tbs:.2f} TB/s of fp32 adds  sum {'ok' if ok else 'WRONG'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
