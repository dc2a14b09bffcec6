"""A torch.cuda.synchronize() that cannot hang, for the warp-specialised kernels' GPU tests (a producer /
consumer protocol bug hangs the kernel, and a hung kernel cannot be interrupted)."""

import os
import sys
import time

import torch


def sync_or_die(kernel: str, what: str, timeout_s: float) -> None:
    """Poll the current stream; if ``kernel`` has not finished within ``timeout_s`` s, report ``what`` and hard-exit
    the process (every later CUDA call would block behind the hung kernel)."""
    stream = torch.cuda.current_stream()
    deadline = time.monotonic() + timeout_s
    while not stream.query():
        if time.monotonic() > deadline:
            msg = f"\nHANG: {kernel} did not finish within {timeout_s:.0f} s ({what}); aborting the run\n"
            sys.stdout.write(msg)
            sys.stderr.write(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        time.sleep(0.002)
    torch.cuda.synchronize()


def assert_same_as_default(kernel: str, run, variant: dict, what: str, timeout_s: float):
    """``run(**variant)`` (a timing or alternative build) and ``run()`` (the default build) give bitwise equal
    (out, lse, max_logits); each launch is hang-guarded.  Returns the variant's outputs."""
    got = run(**variant)
    sync_or_die(kernel, f"{variant} {what}", timeout_s)
    base = run()
    sync_or_die(kernel, f"default build {what}", timeout_s)
    for name, a, b in zip(("out", "lse", "max_logits"), got, base):
        assert torch.equal(a, b), f"{name}: {variant} differs from the default build"
    return got
