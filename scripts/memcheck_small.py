"""Small launches of chosen kernels for ``compute-sanitizer --tool memcheck`` (run on the GPU host):

    compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/memcheck_small.py topk_regs paged_pipelined

Each target runs its kernel on a small input with edge cases (ranges, short rows, NaN/-inf, invalid block ids)
and compares with the reference, so a wrong result also fails (exit 1).  Targets: topk_regs, topk_single,
paged_pipelined.
"""

import sys

import torch


def topk(impl):
    from flashdsa.topk import kernel_radix as kr
    from flashdsa.topk.reference import topk_indices_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(37, 8191, device="cuda", generator=g)
    x[3, :] = float("-inf")
    x[4, ::3] = float("nan")
    x[5] = torch.round(x[5])
    st = torch.randint(0, 4000, (37,), device="cuda", generator=g, dtype=torch.int32)
    en = torch.clamp(st + torch.randint(0, 8192, (37,), device="cuda", generator=g, dtype=torch.int32), max=8191)
    en[6] = st[6]  # empty row
    ok = True
    for k in (1, 100, 2048, 9000):
        for s_, e_ in ((None, None), (st, en)):
            got = kr.run_topk_indices(x, k, s_, e_, "index", impl=impl)
            ok &= bool(torch.equal(got.cpu(), topk_indices_reference(x.cpu(), k, None if s_ is None else s_.cpu(),
                                                                     None if e_ is None else e_.cpu())))
    return ok


def paged(variant):
    sys.path.insert(0, "scripts")
    from bench_paged_indexer import build_inputs, rel_err

    from flashdsa.indexer import kernel_paged as kp
    from flashdsa.indexer.reference import indexer_logits_paged_reference

    ok = True
    for nn, bs in ((2, 16), (3, 64), (2, 128)):
        inp = build_inputs(B=5, next_n=nn, ctx=700, H=64, D=128, bs=bs, ragged=True)
        out = kp.run_indexer_logits_paged(inp["q"], inp["k_cache"], inp["weights"], inp["context_lens"],
                                          inp["block_table"], inp["k_scale_cache"], inp["max_context"], variant=variant)
        ref = indexer_logits_paged_reference(inp["q"], inp["k_cache"], inp["weights"], inp["context_lens"],
                                             inp["block_table"], inp["k_scale_cache"], inp["max_context"]).float()
        good, msg = rel_err(out, ref)
        print(f"  paged {variant} next_n {nn} bs {bs}: {msg}")
        ok &= good
    return ok


TARGETS = {"topk_regs": lambda: topk("regs"), "topk_single": lambda: topk("single"),
           "paged_pipelined": lambda: paged("pipelined")}


def main():
    ok = True
    for name in sys.argv[1:]:
        good = TARGETS[name]()
        torch.cuda.synchronize()
        print(name, "OK" if good else "MISMATCH", flush=True)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
