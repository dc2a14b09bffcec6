"""Split-KV against one row per token for sparse decode at small batch: CUDA-graph replay medians over B (GPU).

    python scripts/split_sweep.py [--forms bf16:16,fp8:32,fp8:16] [--batches 4,8,12,16,24,32] [--json F]

Each form (cache kind : H) runs ``mla_decode`` on the decode suite's inputs (topk 2048, cache 32768, s_q 1) with
``$FLASHDSA_DECODE_SPLIT`` unset (the dispatch's rule) and "0" (never split), graph replay with the L2 flushed
(``bench_overhead.graph_ms``).  It tells where ``kernel_split.split_fill``'s rule should put each form's crossover.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import graph_ms  # noqa: E402

from flashdsa.bench import suites  # noqa: E402
from flashdsa.decode import kernel_split  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="bf16:16,fp8:32,fp8:16")
    ap.add_argument("--batches", default="4,8,12,16,24,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for form in a.forms.split(","):
        kind, H = form.split(":")
        H, fp8 = int(H), kind == "fp8"
        for B in (int(x) for x in a.batches.split(",")):
            case = suites._decode(f"sweep_{kind}_B{B}_H{H}", B, H, 1, 32768, "", sparse=True, fp8=fp8, topk=2048)
            gen = torch.Generator(device=dev).manual_seed(B * 131 + H)
            inputs = case.build(dev, gen)
            row = dict(form=kind, H=H, B=B, plan=kernel_split.split_plan(B, H, 2048, sms,
                                                                         kernel_split.split_fill(H, fp8)))
            for tag, val in (("rule", None), ("unsplit", "0"), ("split", "1")):
                if val is None:
                    os.environ.pop(kernel_split.SPLIT_ENV, None)
                else:  # "1": minimum chunk of one block pair, i.e. split wherever the CTAs leave SMs idle
                    os.environ[kernel_split.SPLIT_ENV] = val if val == "0" else "2"
                if tag == "split":
                    n, _ = kernel_split.split_plan(B, H, 2048, sms, 1)
                    if n == 1:
                        continue
                    # force the split at any fill: the fill argument is the dispatch's; bypass it for the sweep
                    orig = kernel_split.split_fill
                    kernel_split.split_fill = lambda h, f: 1
                try:
                    row[tag + "_ms"] = round(graph_ms(lambda: case.run(inputs, "auto"), a.reps, flush), 4)
                finally:
                    if tag == "split":
                        kernel_split.split_fill = orig
            os.environ.pop(kernel_split.SPLIT_ENV, None)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), commit=os.environ.get("FLASHDSA_COMMIT", ""),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
