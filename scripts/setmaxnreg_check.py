"""Does ptxas give a ``setmaxnreg.inc`` branch more registers than the launch bound allows?  (CPU only: nvcc.)

A producer-warpgroup form of ``sparse/kernel_fwd_mma.py`` (docs/ROADMAP.md, session 38) needs consumer warps at
~232-240 registers in a 384-thread CTA whose ``__launch_bounds__(384, 1)`` caps the kernel at 168.  This compiles a
kernel with 200 live fp32 accumulators once plainly under that bound and once behind ``setmaxnreg.inc 232`` (the
producer warpgroup at ``setmaxnreg.dec 40``) and prints ptxas' register / spill report for both.  Session 38: the
plain kernel spills 492 bytes at 168 registers, the ``setmaxnreg`` one reports 168 registers and no spills.

Usage: ``python scripts/setmaxnreg_check.py``.
"""

import os
import subprocess
import tempfile

SRC = r"""
template <int N>
__device__ __forceinline__ void consumer(float *out, const float *in, int iters) {
  float acc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = in[threadIdx.x * N + i];
  for (int it = 0; it < iters; ++it) {
    const float x = in[it];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = fmaf(acc[i], x, acc[(i + 1) % N]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[threadIdx.x * N + i] = acc[i];
}
__global__ void __launch_bounds__(384, 1) with_setmaxnreg(float *out, const float *in, int iters) {
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    out[threadIdx.x] = in[threadIdx.x] * 2.f;
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    consumer<200>(out + 4096, in, iters);
  }
}
__global__ void __launch_bounds__(384, 1) plain(float *out, const float *in, int iters) {
  consumer<200>(out + 4096, in, iters);
}
"""


def main():
    with tempfile.TemporaryDirectory() as d:
        cu = os.path.join(d, "k.cu")
        with open(cu, "w") as f:
            f.write(SRC)
        r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-Xptxas", "-v", cu, "-o", os.path.join(d, "k")],
                           capture_output=True, text=True, check=True)
    for line in r.stderr.splitlines():
        if "Function properties" in line or "registers" in line or "spill" in line:
            print(line.strip())


if __name__ == "__main__":
    main()
