"""Smoke check of the GPU host: tilelang compiles and runs a bf16 wgmma GEMM; prints versions and timings."""

import time

import torch
import tilelang
import tilelang.language as T


def gemm(M, N, K, bm=128, bn=128, bk=64):
    @T.prim_func
    def main(A: T.Tensor((M, K), "bfloat16"), B: T.Tensor((N, K), "bfloat16"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=128) as (bx, by):
            a = T.alloc_shared((bm, bk), "bfloat16")
            b = T.alloc_shared((bn, bk), "bfloat16")
            c = T.alloc_fragment((bm, bn), "float32")
            T.clear(c)
            for k in T.Pipelined(T.ceildiv(K, bk), num_stages=3):
                T.copy(A[by * bm, k * bk], a)
                T.copy(B[bx * bn, k * bk], b)
                T.gemm(a, b, c, transpose_B=True)
            T.copy(c, C[by * bm, bx * bn])

    return main


if __name__ == "__main__":
    print("torch", torch.__version__, "tilelang", tilelang.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    t0 = time.time()
    k = tilelang.compile(gemm(1024, 1024, 1024), out_idx=[2], target="cuda")
    print(f"compile {time.time() - t0:.1f}s")
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    c = k(a, b)
    err = (c - a.float() @ b.float().T).abs().max().item()
    print("max err", err, "wgmma in source:", "wgmma" in k.get_kernel_source())
