"""The per-SM rate of ``mma.sync`` bf16 products on this GPU (m16n8k16 and m16n8k8, fp32 accumulators).

Why: the few-head sparse forward (``sparse/kernel_fwd_mma.py``) runs its QK and PV on per-warp ``mma.sync`` chains,
so their rate bounds it.  Each warp runs ``NACC`` independent accumulators through ``ITER`` dependent products
(operands in registers, nothing loaded); grid 132 x ``blocks per SM`` CTAs of ``warps`` warps.  Prints TFLOP/s and
cycles per product per SM sub-partition (at the clock measured with clock64 over the run).

Usage (GPU host, nvcc on PATH): ``python scripts/mma_sync_ceiling.py``; JSON to ``$OUT/mma_sync_ceiling.json``.
"""

SRC = r"""
#include <cstdio>
#include <cuda_runtime.h>
template <int K, int NACC>
__global__ void mma_loop(float *out, int iters, long long *cyc) {
  float c[NACC][4];
  for (int i = 0; i < NACC; ++i) for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
  unsigned a0 = 0x3f803f80u ^ threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = 0x3c003c00u + threadIdx.x,
           b1 = b0 + 7;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      if (K == 16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};" : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                     "{%0,%1,%2,%3};" : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                     : "r"(a0), "r"(a1), "r"(b0));
    }
  }
  long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < NACC; ++i) for (int e = 0; e < 4; ++e) s += c[i][e];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int K, int NACC>
void run(int warps, int bps, float *out, long long *cyc) {
  const int iters = 4096, blocks = 132 * bps;
  const float ms = probe_ms([&] { mma_loop<K, NACC><<<blocks, 32 * warps>>>(out, iters, cyc); });
  long long c0;
  cudaMemcpy(&c0, cyc, sizeof(c0), cudaMemcpyDeviceToHost);
  const double flops = 2.0 * 16 * 8 * K * NACC * (double)iters * warps * blocks;
  const double ghz = c0 / (ms * 1e6);
  const double per_smsp = (double)c0 / ((double)iters * NACC * warps * bps / 4.0);  // cycles per product per SMSP
  printf("{\"k\": %d, \"nacc\": %d, \"warps_per_sm\": %d, \"ms\": %.4f, \"tflops\": %.1f, \"ghz\": %.3f, "
         "\"cycles_per_mma_per_smsp\": %.2f}\n", K, NACC, warps * bps, ms, flops / ms / 1e9, ghz, per_smsp);
}
int main() {
  float *out;
  long long *cyc;
  cudaMalloc(&out, 132 * 16 * 1024 * 4);
  cudaMalloc(&cyc, 132 * 16 * 8);
  for (int w : {4, 8, 16}) {
    run<16, 4>(w, 1, out, cyc);
    run<16, 8>(w, 1, out, cyc);
    run<8, 4>(w, 1, out, cyc);
    run<8, 8>(w, 1, out, cyc);
  }
  return 0;
}
"""


def main():
    from cuda_probe import run_json_probe  # this script's folder is on sys.path

    run_json_probe(SRC, "mma_sync_ceiling")


if __name__ == "__main__":
    main()
