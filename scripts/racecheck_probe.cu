// What compute-sanitizer racecheck takes as synchronisation, on the shared-memory patterns our kernels use
// (session 56: racecheck reports hazards in every pair / mma kernel across barriers that order the accesses).
// Each case writes shared memory in some threads, synchronises, then reads it in others; every case is ordered
// correctly, so any hazard racecheck reports for it is a limit of the tool's model, not a race.
//   nvcc -arch=sm_90a -o /tmp/rc_probe scripts/racecheck_probe.cu
//   compute-sanitizer --tool racecheck --racecheck-report analysis /tmp/rc_probe CASE
//   compute-sanitizer --tool synccheck /tmp/rc_probe CASE
// CASE: syncthreads (one __syncthreads), named_same (bar.sync 1, 256 at one site), named_split (bar.sync 1, 256
// from each warpgroup's own branch: the pair kernels' BAR_BOTH before session 56), unaligned_split (the same with
// barrier.sync, session 56's form), ldmatrix (ldmatrix reads, __syncthreads, then other threads write the rows).
#include <cstdio>
#include <cstring>

__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_sync_b(int id, int n) {  // the same, as a second asm text: never merged
  asm volatile("bar.sync %0, %1; // warpgroup 1" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_sync_unaligned(int id, int n) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_sync_unaligned_b(int id, int n) {
  asm volatile("barrier.sync %0, %1; // warpgroup 1" ::"r"(id), "r"(n) : "memory");
}

__global__ void probe(int mode, float *out) {
  __shared__ __align__(16) float s[1024];
  const int t = threadIdx.x;
  float v = 0.f;
  if (mode == 4) {  // ldmatrix reads of s by warp 0, then every thread rewrites s after __syncthreads
    for (int i = t; i < 1024; i += 256) s[i] = i;
    __syncthreads();
    if (t < 32) {
      unsigned r[4];
      unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(s + (t % 16) * 8));
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
      v = __int_as_float(r[0] ^ r[1] ^ r[2] ^ r[3]);
    }
    __syncthreads();
    for (int i = t; i < 1024; i += 256) s[(i + 512) % 1024] = -i;
    __syncthreads();
    out[t] = v + s[t];
    return;
  }
  if (t < 128) {
    s[t] = t;  // warpgroup 0 writes
    if (mode == 2) bar_sync(1, 256);
    if (mode == 3) bar_sync_unaligned(1, 256);
  } else {
    if (mode == 2) bar_sync_b(1, 256);
    if (mode == 3) bar_sync_unaligned_b(1, 256);
  }
  if (mode == 0) __syncthreads();
  if (mode == 1) bar_sync(1, 256);
  if (t >= 128) v = s[t - 128];  // warpgroup 1 reads what warpgroup 0 wrote
  out[t] = v;
}

int main(int argc, char **argv) {
  const char *names[] = {"syncthreads", "named_same", "named_split", "unaligned_split", "ldmatrix"};
  int mode = -1;
  for (int i = 0; i < 5; ++i)
    if (argc > 1 && !strcmp(argv[1], names[i])) mode = i;
  if (mode < 0) {
    fprintf(stderr, "usage: %s syncthreads|named_same|named_split|unaligned_split|ldmatrix\n", argv[0]);
    return 2;
  }
  float *out;
  cudaMalloc(&out, 256 * sizeof(float));
  probe<<<1, 256>>>(mode, out);
  cudaError_t e = cudaDeviceSynchronize();
  printf("%s: %s\n", names[mode], cudaGetErrorString(e));
  return e != cudaSuccess;
}
