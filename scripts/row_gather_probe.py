"""How fast can random cache rows (656-byte FP8 rows, or 1152-byte bf16 rows with ``--row 1152``) move into shared
memory, with nothing else in the way?
(Issue #6's sparse FP8 decode at H 16: 3.0 TB/s of cache bytes asked; kernel_fwd_mma656's copy-and-softmax skeleton
reaches 2.6 TB/s at B 128, 3.25 at B 512 -- session 33.)

One CTA per token, ``--warps`` warps; warp w takes the 16-row chunks w, w + W, ... of the token's top-k through its
own ring of ``--stages`` 16-row stages (mbarrier per stage) and does nothing with a landed chunk but add one 32-bit
word of each row into a checksum (so the copies have a consumer), then refills the stage with the chunk
``stages`` ahead.  Row numbers come one step ahead in registers.  Modes:

  * ``bulk``: lanes 0-15 issue one ``cp.async.bulk`` of 656 bytes per row (as kernel_fwd_mma656);
  * ``lsu``: the warp's 32 lanes copy the 16 rows as 16-byte ``cp.async`` pieces (656 per chunk) with ``noinc``
    arrivals (the LSU path).

Placements of a bulk-copied row (``--place``): ``packed`` (stage rows ``ROW`` bytes apart, as the kernels), ``parity``
(packed, each warp's 16 rows placed so that a row's slot and its source agree in address bit 4 where the 8 + 8
slots allow: ``kernel_fwd_mma656``'s ``mma_par``), ``co128`` (768-byte slots, each row at its source's offset within
128 bytes; the offsets go through shared memory to the reader).  Session 40's ``scripts/bulk_issue_probe.py``: a
copy 16 bytes off its source modulo 32 is the slow case.

Checked: the checksums equal torch's sum of the same words (int64 wrap-around sums compared mod 2^32).

Usage (GPU host): ``source .gpu/env.sh && python scripts/row_gather_probe.py [--modes bulk,lsu] [--warps 4,8]
[--stages 2,4] [--row 656|1152] [--shapes decode|prefill] [--place packed,parity,co128] [--json out.json]``; decode
shapes: B 128 tokens x 32768 rows each and B 512 x 8192 (2.75 GB of rows at 656 B), topk 2048 sorted unique per
token (the decode suite's and ``kernel_fwd_narrow656 --variants``' pattern); prefill: S 4096 tokens x topk 2048
sorted unique rows of one shared SKV 8192 (L2-resident; #8's suite shape: 9.66 GB of 1152-byte rows).  A config whose
stages leave room runs several CTAs per SM.
"""

import argparse
import functools
import json

import torch

import tilelang
import tilelang.language as T

from flashdsa.sparse._mma656_parts import PARITY_SLOT_SRC

_SRC = PARITY_SLOT_SRC + r"""
// PLACE 0 packed, 1 parity, 2 co128 (module notes); RS: the stage row stride
template <int W, int NS, int LSU, int ROW, int PLACE>
__device__ __forceinline__ void fdsa_probe_rows(const void *kv_v, int rs16, const int *idx, int topk,
                                                void *stage_v, int *offs, void *bars_v, int *out, int tok) {
  constexpr int RS = PLACE == 2 ? (ROW + 112 + 127) / 128 * 128 : ROW;
  const unsigned char *kv = static_cast<const unsigned char *>(kv_v);
  unsigned char *stage = static_cast<unsigned char *>(stage_v);
  const long long rs = static_cast<long long>(rs16) * 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned stage_s = static_cast<unsigned>(__cvta_generic_to_shared(stage));
  const unsigned bars = static_cast<unsigned>(__cvta_generic_to_shared(bars_v));
  const int nc = (topk + 15) >> 4;
  const int nsteps = nc > warp ? (nc - warp + W - 1) / W : 0;
  auto row_of = [&](int step) -> int {  // lane l (< 16): row l of this warp's chunk of step `step`
    const int slot = (warp + W * step) * 16 + (lane & 15);
    return step < nsteps && slot < topk ? idx[static_cast<long long>(tok) * topk + slot] : -1;
  };
  auto issue = [&](int step, int row) {
    const int st = warp * NS + step % NS;
    const unsigned bar = bars + st * 8;
    if (!LSU) {
      const unsigned char *src = kv + (row >= 0 ? row : 0) * rs;
      const unsigned sa = static_cast<unsigned>(reinterpret_cast<size_t>(src));
      int k = lane & 15;
      if (PLACE == 1) k = fdsa_m656_parity_slot<16>((sa >> 4) & 1, lane, ((stage_s + st * 16 * RS) >> 4) & 1);
      const unsigned co = PLACE == 2 ? ((sa - stage_s) & 112u) : 0u;  // slots are 128-byte multiples apart
      if (lane < 16) {
        const unsigned dst = stage_s + (st * 16 + k) * RS + co;
        if (PLACE == 2) offs[st * 16 + k] = static_cast<int>(co);
        if (row >= 0) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(ROW) : "memory");
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       :: "r"(dst), "l"(src), "r"(ROW), "r"(bar) : "memory");
        } else {
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < (ROW + 31) / 32; ++i) {  // pieces lane + 32 i of the chunk's 16 x ROW / 16
        const int k = lane + 32 * i, kk = k < ROW ? k : ROW - 1;  // every lane takes part in the shuffle
        const int rr = kk / (ROW / 16), pc = kk - rr * (ROW / 16);
        const int rw = __shfl_sync(0xffffffffu, row, rr);
        const int n = rw >= 0 ? 16 : 0;
        if (k < ROW)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                       :: "r"(stage_s + (st * 16 + rr) * ROW + 16 * pc), "l"(kv + (n ? rw : 0) * rs + 16 * pc), "r"(n)
                       : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
    }
  };
  for (int s = 0; s < NS && s < nsteps; ++s) issue(s, row_of(s));
  int next = row_of(NS);
  unsigned sum = 0;
  for (int it = 0; it < nsteps; ++it) {
    const int st = warp * NS + it % NS;
    const unsigned bar = bars + st * 8;
    asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra WAIT;\n\t}\n"
                 :: "r"(bar), "r"((it / NS) & 1) : "memory");
    if (lane < 16 && (warp + W * it) * 16 + lane < topk)
      sum += *reinterpret_cast<const unsigned *>(stage + (st * 16 + lane) * RS + (PLACE == 2 ? offs[st * 16 + lane] : 0)
                                                 + 4 * (it & 127));
    __syncwarp();
    if (it + NS < nsteps) {
      const int row = next;
      next = row_of(it + NS + 1);
      issue(it + NS, row);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) out[tok * W + warp] = static_cast<int>(sum);
}
"""


PLACES = ("packed", "parity", "co128")


def slot_bytes(row: int, place: str) -> int:
    """The stage row stride of a placement."""
    return (row + 112 + 127) // 128 * 128 if place == "co128" else row


def build(n_warps: int, stages: int, lsu: bool, row: int = 656, place: str = "packed"):
    from flashdsa.sparse import _tl_common as tc

    assert place == "packed" or not lsu, "the placements are for bulk copies"
    n_tok, n_ch, topk, n_out = tc.dynamic_dims("n_tok", "n_ch", "topk", "n_out")
    arrivals = 32 if lsu else 16
    u8, i32 = "uint8", "int32"
    fn = f"fdsa_probe_rows<{n_warps}, {stages}, {int(lsu)}, {row}, {PLACES.index(place)}>"

    @T.prim_func
    def row_gather_probe(KV: T.Tensor([n_ch, 16], u8), rs16: T.int32, Idx: T.Tensor([n_tok, topk], i32),
                         Out: T.Tensor([n_out], i32)):
        with T.Kernel(n_tok, threads=32 * n_warps, prelude=_SRC) as bx:
            Stage = T.alloc_shared([n_warps * stages * 16 * slot_bytes(row, place)], "uint8")
            Offs = T.alloc_shared([n_warps * stages * 16], i32)
            bars = T.alloc_barrier([arrivals] * (n_warps * stages))
            T.call_extern("handle", fn, T.address_of(KV[0, 0]), rs16, T.address_of(Idx[0, 0]), topk,
                          T.address_of(Stage[0]), T.address_of(Offs[0]), T.address_of(bars[0]),
                          T.address_of(Out[0]), bx)

    return row_gather_probe


@functools.lru_cache(maxsize=None)
def compiled(n_warps: int, stages: int, lsu: bool, row: int = 656, place: str = "packed"):
    from flashdsa._tilelang import plain_pass_configs

    return tilelang.compile(build(n_warps, stages, lsu, row, place), target="cuda",
                            pass_configs=plain_pass_configs())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="bulk,lsu")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--row", type=int, default=656, choices=(656, 1152))
    ap.add_argument("--shapes", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--place", default="packed", help=f"comma-separated, of {PLACES} (bulk copies)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ROW = a.row
    from flashdsa.bench.harness import time_fn

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    shapes = (("B128", 128, 32768), ("B512", 512, 8192)) if a.shapes == "decode" else (("S4096", 4096, 8192),)
    for label, n_tok, per_tok in shapes:
        topk = 2048
        shared = a.shapes == "prefill"  # every token selects from the same SKV rows
        kv = torch.randint(0, 256, ((1 if shared else n_tok) * per_tok, ROW), dtype=torch.uint8, device=dev,
                           generator=gen)
        idx = torch.argsort(torch.rand(n_tok, per_tok, generator=gen, device=dev), dim=1)[:, :topk]
        if not shared:
            idx = idx + torch.arange(n_tok, device=dev).unsqueeze(1) * per_tok
        idx = idx.sort(dim=1).values.to(torch.int32)
        chunks = kv.view(-1, 16)
        for mode, place in ((m, p) for m in a.modes.split(",") for p in a.place.split(",")
                            if m == "bulk" or p == "packed"):
            for w in (int(x) for x in a.warps.split(",")):
                for ns in (int(x) for x in a.stages.split(",")):
                    if w * ns * 16 * slot_bytes(ROW, place) > 227 * 1024 - w * ns * 16 * 4:
                        continue
                    k = compiled(w, ns, mode == "lsu", ROW, place)
                    out = torch.zeros(n_tok * w, dtype=torch.int32, device=dev)
                    k(chunks, ROW // 16, idx, out)
                    torch.cuda.synchronize()
                    # reference checksum: chunk c of token t goes to warp c % w; step it reads word (it & 127) of
                    # each of its 16 rows
                    c = torch.arange(topk, device=dev) // 16
                    step = c // w
                    words = kv.view(torch.int32).view(-1, ROW // 4)
                    ref = torch.zeros(n_tok, w, dtype=torch.int64, device=dev)
                    got_words = words[idx.long(), (step % 128).expand(n_tok, -1)].to(torch.int64) & 0xFFFFFFFF
                    ref.scatter_add_(1, (c % w).expand(n_tok, -1), got_words)
                    ok = torch.equal(ref % (1 << 32), out.view(n_tok, w).to(torch.int64) & 0xFFFFFFFF)
                    t = time_fn(lambda _: k(chunks, ROW // 16, idx, out), [None], dev, reps=30)
                    tb = n_tok * topk * ROW / t.ms_median / 1e9
                    rows_out.append(dict(shape=label, row_bytes=ROW, mode=mode, place=place, warps=w, stages=ns,
                                         ms=t.ms_median, ms_p10=t.ms_p10, tbps=tb, checksum_ok=ok))
                    print(f"{label} {mode} {place} warps {w} stages {ns}: {t.ms_median * 1e3:.1f} us (p10 "
                          f"{t.ms_p10 * 1e3:.1f}), {tb:.3f} TB/s of rows, checksum {'ok' if ok else 'MISMATCH'}",
                          flush=True)
        del kv
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
