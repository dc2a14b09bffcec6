"""How fast can one warp (or a few) issue ``cp.async.bulk`` row copies, with nothing else on the SM?

Why: in ``sparse/kernel_fwd_mma.py`` the consumer warps issue their own rows' copies and spend ~750-1000 cycles per
16-key step doing it (``scripts/mma_counters.py``): a producer warp would take that off their path only if one warp
can issue the SM's ~64 rows per step fast enough.  Here ``W`` warps per CTA (one CTA per SM, 132 CTAs) each copy
random 1152-byte rows of an L2-resident 8192-row table into their own ring of ``R`` 16-row stages (rows ``ROW +
PAD`` bytes apart, PAD 16 unless given; PAD -1: 128-byte slots, each row at its source's offset within 128 bytes;
PAD -2: packed rows, each placed in a slot whose address bit 4 matches its source's where the 8 + 8 slots allow, as
``kernel_fwd_mma656``'s PAR build; one mbarrier per stage), waiting on a stage's previous copies only when the ring
wraps; ``MODE`` 0: lanes 0-15 each copy one row (one ``arrive.expect_tx`` per row, as the kernel), 1: lane 0 arrives
once and copies the 16 rows in sequence.  (The ``.shared::cta`` destination form of PTX ISA 8.6 compiled but failed
at launch on the H200 host, session 38.)
Prints rows per microsecond and SM, and the cycles a warp spends issuing one 16-row stage.

Usage (GPU host, nvcc on PATH): ``python scripts/bulk_issue_probe.py``; JSON to ``$OUT/bulk_issue_probe.json``.
"""

from flashdsa.sparse._mma656_parts import PARITY_SLOT_SRC

SRC = r"""
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
""" + PARITY_SLOT_SRC + r"""
constexpr int ROWMAX = 1152, NROWS = 8192;
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
               "@!p bra WAIT;\n\t}\n" :: "r"(bar), "r"(parity) : "memory");
}
template <int ROW>
__device__ __forceinline__ void copy_row(unsigned dst, const void *src, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(ROW), "r"(bar) : "memory");
}
__device__ __forceinline__ void arrive_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
template <int W, int R, int MODE, int ROW, int PAD>
__global__ void probe(const unsigned char *kv, const int *idx, int steps, long long *cyc, int *sink) {
  // PAD -1: each row's destination 16-byte offset within 128 bytes equal to its source's (rows in 128-aligned slots)
  constexpr int RS = PAD >= 0 ? ROW + PAD : PAD == -2 ? ROW : (ROW + 112 + 127) / 128 * 128;
  extern __shared__ __align__(1024) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[W * R];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x < W * R) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bars[threadIdx.x]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(b), "r"(MODE == 0 ? 16 : 1));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const unsigned st0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned b0 = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  long long issue = 0;
  const long long t0 = clock64();
  int acc = 0;
  for (int s = 0; s < steps; ++s) {
    const int slot = warp * R + s % R;
    const unsigned bar = b0 + slot * 8;
    if (s >= R) {
      wait_parity(bar, ((s / R) - 1) & 1);
      acc += *reinterpret_cast<const int *>(smem + (slot * 16 + (lane & 15)) * RS);
    }
    const int row = idx[((blockIdx.x * W + warp) * steps + s) * 16 % (1 << 20) + (lane & 15)];
    __syncwarp();
    const long long c0 = clock64();
    if (MODE == 0) {
      const unsigned char *src = kv + static_cast<long long>(row) * ROW;
      int k = lane & 15;
      if (PAD == -2)
        k = fdsa_m656_parity_slot<16>(static_cast<int>(reinterpret_cast<size_t>(src) >> 4) & 1, lane,
                                      static_cast<int>((st0 + slot * 16 * RS) >> 4) & 1);
      if (lane < 16) {
        arrive_expect(bar, ROW);
        const unsigned co = PAD != -1 ? 0u : static_cast<unsigned>((static_cast<long long>(row) * ROW) & 127);
        copy_row<ROW>(st0 + (slot * 16 + k) * RS + co, src, bar);
      }
    } else {
      int rk[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) rk[k] = __shfl_sync(0xffffffffu, row, k);
      if (lane == 0) {
        arrive_expect(bar, 16 * ROW);
#pragma unroll
        for (int k = 0; k < 16; ++k)
          copy_row<ROW>(st0 + (slot * 16 + k) * RS, kv + static_cast<long long>(rk[k]) * ROW, bar);
      }
    }
    __syncwarp();
    issue += clock64() - c0;
  }
  for (int s = steps; s < steps + R; ++s) {
    if (s >= R) wait_parity(b0 + (warp * R + s % R) * 8, ((s / R) - 1) & 1);
  }
  const long long t1 = clock64();
  if (lane == 0) {
    cyc[(blockIdx.x * W + warp) * 2] = t1 - t0;
    cyc[(blockIdx.x * W + warp) * 2 + 1] = issue;
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
template <int W, int R, int MODE, int ROW = 1152, int PAD = 16>
void run(const unsigned char *kv, const int *idx, long long *cyc, int *sink) {
  const int steps = 512;
  const size_t smem =
      static_cast<size_t>(W) * R * 16 * (PAD >= 0 ? ROW + PAD : PAD == -2 ? ROW : (ROW + 112 + 127) / 128 * 128);
  cudaFuncSetAttribute(probe<W, R, MODE, ROW, PAD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  const float ms = probe_ms([&] { probe<W, R, MODE, ROW, PAD><<<132, 32 * W, smem>>>(kv, idx, steps, cyc, sink); });
  long long h[2 * 132 * 8];
  cudaMemcpy(h, cyc, sizeof(long long) * 2 * 132 * W, cudaMemcpyDeviceToHost);
  double tot = 0, iss = 0;
  for (int i = 0; i < 132 * W; ++i) { tot += h[2 * i]; iss += h[2 * i + 1]; }
  tot /= 132 * W;
  iss /= 132 * W;
  const double rows = 16.0 * steps * W;  // per SM
  printf("{\"row\": %d, \"pad\": %d, \"warps\": %d, \"ring\": %d, \"mode\": %d, \"ms\": %.4f, "
         "\"rows_per_us_per_sm\": %.1f, \"tb_s\": %.2f, \"issue_cycles_per_stage\": %.0f, "
         "\"cycles_per_stage\": %.0f, \"ghz\": %.3f, \"err\": \"%s\"}\n", ROW, PAD, W, R, MODE,
         ms, rows / (ms * 1e3), rows * 132 * ROW / (ms * 1e9), iss / steps, tot / steps, tot / (ms * 1e6),
         cudaGetErrorString(cudaGetLastError()));
}
int main() {
  unsigned char *kv;
  int *idx, *sink;
  long long *cyc;
  cudaMalloc(&kv, static_cast<size_t>(NROWS) * ROWMAX);
  cudaMemset(kv, 1, static_cast<size_t>(NROWS) * ROWMAX);
  const int n = 1 << 20;
  int *h = static_cast<int *>(malloc(n * sizeof(int)));
  srand(1);
  for (int i = 0; i < n; ++i) h[i] = rand() % NROWS;
  cudaMalloc(&idx, n * sizeof(int));
  cudaMemcpy(idx, h, n * sizeof(int), cudaMemcpyHostToDevice);
  cudaMalloc(&cyc, 2 * 132 * 8 * sizeof(long long));
  cudaMalloc(&sink, 132 * 256 * sizeof(int));
  run<1, 8, 0>(kv, idx, cyc, sink);
  run<1, 8, 1>(kv, idx, cyc, sink);
  run<1, 12, 0>(kv, idx, cyc, sink);
  run<1, 12, 1>(kv, idx, cyc, sink);
  run<2, 6, 0>(kv, idx, cyc, sink);
  run<2, 6, 1>(kv, idx, cyc, sink);
  run<4, 3, 0>(kv, idx, cyc, sink);
  run<4, 3, 1>(kv, idx, cyc, sink);
  run<4, 2, 0>(kv, idx, cyc, sink);
  run<8, 1, 0>(kv, idx, cyc, sink);
  run<1, 12, 0, 576>(kv, idx, cyc, sink);
  run<4, 3, 0, 576>(kv, idx, cyc, sink);
  run<4, 6, 0, 576>(kv, idx, cyc, sink);
  // the destination's alignment (session 40): rows RS = ROW + PAD bytes apart
  run<4, 3, 0, 1152, 0>(kv, idx, cyc, sink);
  run<4, 3, 0, 1152, 32>(kv, idx, cyc, sink);
  run<4, 2, 0, 1152, 0>(kv, idx, cyc, sink);  // (three stages of 1216- / 1280-byte rows exceed shared memory)
  run<4, 2, 0, 1152, 64>(kv, idx, cyc, sink);
  run<4, 2, 0, 1152, 128>(kv, idx, cyc, sink);
  run<8, 1, 0, 1152, 0>(kv, idx, cyc, sink);
  run<4, 3, 0, 576, 0>(kv, idx, cyc, sink);
  // 656-byte rows (the FP8 cache): packed, 16-byte padded, each row co-aligned with its source (pad -1)
  run<4, 3, 0, 656, 0>(kv, idx, cyc, sink);
  run<4, 3, 0, 656, 16>(kv, idx, cyc, sink);
  run<4, 3, 0, 656, -1>(kv, idx, cyc, sink);
  // packed 656-byte rows placed by address bit 4 (pad -2, session 41), against packed and co-aligned again
  run<4, 3, 0, 656, -2>(kv, idx, cyc, sink);
  run<4, 3, 0, 656, 0>(kv, idx, cyc, sink);
  run<4, 3, 0, 656, -1>(kv, idx, cyc, sink);
  run<4, 4, 0, 656, -2>(kv, idx, cyc, sink);
  run<4, 4, 0, 656, 0>(kv, idx, cyc, sink);
  return 0;
}
"""


def main():
    from cuda_probe import run_json_probe  # this script's folder is on sys.path

    run_json_probe(SRC, "bulk_issue_probe")


if __name__ == "__main__":
    main()
