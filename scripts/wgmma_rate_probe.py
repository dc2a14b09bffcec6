"""The per-SM issue cost of one ``wgmma.mma_async`` m64nNk16 bf16 (fp32 accumulators) against N, for A from shared
memory (SS) and from registers (RS), with 1 or 2 warpgroups per SM and 1 or 2 independent accumulators each.

Why: the transposed designs put the heads on N (session 39's ``kernel_fwd_rs656``: N = 32 per warpgroup, ~74 cycles
per m64n32k16 per SM in its timings; session 36's narrow kernel: N = 16, ~65 cycles); at full rate an m64nNk16 takes
N / 2 cycles per SM, so is a small N itself the bound? (Session 39: no -- two interleaved chains reach the full rate
from N 32 with A in registers; docs/PERFORMANCE.md "Session 39".) Each warpgroup issues ``iters`` rounds of NACC
wgmmas (one commit group per round, at most 2 rounds in flight), operands from a 1024-aligned shared buffer (contents
irrelevant to the rate); one CTA per SM, 132 CTAs. Prints cycles per wgmma per SM and TFLOP/s.

Usage (GPU host): ``python scripts/wgmma_rate_probe.py``; JSON to ``$OUT/wgmma_rate_probe.json``.
"""

from cuda_probe import run_json_probe


def _kernel(n, rs, nacc):
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    a_ops = "{%" + f"{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}" + "}" if rs else f"%{regs}"
    desc_b = f"%{regs + 4}" if rs else f"%{regs + 1}"
    tail = ", p, 1, 1, 0" if rs else ", p, 1, 1, 0, 0"
    outs = ", ".join(f'"+f"(c[{i}])' for i in range(regs))
    ins = ('"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(it)' if rs else '"l"(da), "l"(db), "r"(it)')
    name = f"k_{n}_{int(rs)}_{nacc}"
    return name, f"""
__global__ void __launch_bounds__(256, 1) {name}(float *out, int iters, long long *cyc) {{
  extern __shared__ __align__(1024) unsigned char smraw[];
  unsigned char *sm = reinterpret_cast<unsigned char *>((reinterpret_cast<size_t>(smraw) + 1023) & ~size_t(1023));
  for (int i = threadIdx.x; i < (8192 + 32768) / 4; i += blockDim.x)
    reinterpret_cast<unsigned *>(sm)[i] = 0x3c003c00u ^ (i & 0x00ff00ffu);
  __syncthreads();
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(sm));
  const unsigned long long da = desc(base), db = desc(base + 8192);
  unsigned a[4] = {{0x3f803f80u ^ threadIdx.x, 0x3f803f81u, 0x3f803f82u, 0x3f803f83u}};
  float acc[{nacc}][{regs}];  // first round: scale-d 0 (the registers' initial values are ignored)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {{
#pragma unroll
    for (int j = 0; j < {nacc}; ++j) {{
      float *c = acc[j];
      asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5 if rs else regs + 2}, 0;\\n"
                   "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {a_ops}, {desc_b}{tail};\\n}}\\n"
                   : {outs} : {ins});
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  }}
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  long long t1 = clock64();
  float s = 0.f;
  for (int j = 0; j < {nacc}; ++j) for (int i = 0; i < {regs}; ++i) s += acc[j][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}}
"""


def main():
    cases = [(n, rs, nacc) for n in (16, 32, 64, 128, 256) for rs in (0, 1) for nacc in (1, 2) if n * nacc <= 256]
    kernels = [_kernel(*c) for c in cases]
    runs = "\n".join(
        f"  for (int wg = 1; wg <= 2; ++wg) run({name}, {n}, {rs}, {nacc}, wg, out, cyc);"
        for (name, _), (n, rs, nacc) in zip(kernels, cases))
    src = r"""
#include <cstdio>
#include <cuda_runtime.h>
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
""" + "".join(k for _, k in kernels) + r"""
template <typename K>
void run(K kern, int n, int rs, int nacc, int wgs, float *out, long long *cyc) {
  const int iters = 4096, smem = 1024 + 8192 + 32768;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float ms = probe_ms([&] { kern<<<132, 128 * wgs, smem>>>(out, iters, cyc); });
  long long c0;
  cudaMemcpy(&c0, cyc, sizeof(c0), cudaMemcpyDeviceToHost);
  const double n_mma = (double)iters * nacc * wgs;  // per SM
  const double flops = 2.0 * 64 * n * 16 * n_mma * 132;
  printf("{\"n\": %d, \"a_from\": \"%s\", \"nacc\": %d, \"warpgroups_per_sm\": %d, \"ms\": %.4f, \"tflops\": %.1f, "
         "\"ghz\": %.3f, \"cycles_per_wgmma_per_sm\": %.2f, \"full_rate_cycles\": %.1f, \"err\": \"%s\"}\n",
         n, rs ? "registers" : "shared", nacc, wgs, ms, flops / ms / 1e9, c0 / (ms * 1e6), c0 / n_mma, n / 2.0,
         cudaGetErrorString(cudaGetLastError()));
}
int main() {
  float *out;
  long long *cyc;
  cudaMalloc(&out, 132 * 256 * sizeof(float));
  cudaMalloc(&cyc, 132 * sizeof(long long));
""" + runs + r"""
  return 0;
}
"""
    run_json_probe(src, "wgmma_rate_probe")


if __name__ == "__main__":
    main()
