"""SM clock and board power while one kernel runs back to back: is it held at the power cap?

    python scripts/power_probe.py [--seconds 3] [--cases gemm,pair,pair_no_gather,decode,SUITE:CASE] [--json F]

Each case runs for ``--seconds`` (events around the whole loop give its TFLOP/s) while ``nvidia-smi -lms 20`` samples
the SM clock, the instantaneous board power and the active clock-event reasons (0x4: software power cap); the
samples inside the loop's window are summarised (median clock, median / max power, share of samples power-capped).
Cases: ``gemm`` (torch.mm bf16 8192^3, the ceiling of docs/PERFORMANCE.md), ``pair`` (the dispatched sparse forward
pair kernel, S 4096 / SKV 8192 / H 128 / topk 2048), ``pair_no_gather`` (the same with ``ablate="no_gather"``:
no KV loads, wrong results), ``decode`` (the decode suite's dense B 128 H 128 s_q 1 case, backend auto), or any
benchmark-suite case as ``suite:case`` (its inputs and run, backend auto; the rate is TFLOP/s or TB/s as it counts).
Run on the GPU host after ``source .gpu/env.sh``.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _smi_fields():
    ok = subprocess.run(["nvidia-smi", "--query-gpu=power.draw.instant", "--format=csv"], capture_output=True)
    power = "power.draw.instant" if ok.returncode == 0 else "power.draw"
    return ["timestamp", "clocks.sm", power, "clocks_event_reasons.active"]


def _cases(names):
    import torch

    from flashdsa.bench import get_cases
    from flashdsa.bench.flops import sparse_fwd_flops
    from flashdsa.sparse import kernel_fwd, kernel_fwd_pair

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    if "gemm" in names:
        a, b = (torch.randn(8192, 8192, generator=gen, device="cuda").bfloat16() for _ in range(2))
        c = torch.empty_like(a)
        out["gemm"] = (lambda: torch.mm(a, b, out=c), 2 * 8192**3, None)
    if "pair" in names or "pair_no_gather" in names:
        q, kv, idx = kernel_fwd._prefill_inputs(gen, H=128)
        flops = sparse_fwd_flops(128, idx.numel(), 576, 512)
        scale = 576**-0.5
        out["pair"] = (lambda: kernel_fwd_pair.run_sparse_mla_fwd(q, kv, idx, sm_scale=scale, d_v=512), flops, None)
        key = (("ablate", "no_gather"),)
        out["pair_no_gather"] = (lambda: kernel_fwd.launch(lambda *a: kernel_fwd_pair._compiled(*a, key), q, kv, idx,
                                                           sm_scale=scale, d_v=512), flops, None)
    specs = [("decode", "dense_bf16_B128_H128_sq1_cache8192", "decode")] if "decode" in names else []
    specs += [(n.split(":")[0], n.split(":")[1], n) for n in names if ":" in n]
    for suite, case_name, key in specs:
        case = next(c for c in get_cases(suite, torch.device("cuda"))[0] if c.name == case_name)
        inputs = case.build(torch.device("cuda"), gen)
        counts = case.counts(inputs)
        out[key] = (lambda c=case, i=inputs: c.run(i, "auto"), counts["flops"], counts["bytes"])
    return {n: out[n] for n in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--cases", default="gemm,pair,pair_no_gather,decode")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import torch

    names = args.cases.split(",")
    cases = _cases(names)
    fields = _smi_fields()
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=log, stderr=subprocess.STDOUT)
    windows = {}
    try:
        for name, (fn, flops, nbytes) in cases.items():
            fn()  # compile / warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < 0.3:  # calibrate the loop length
                fn()
                n += 1
            torch.cuda.synchronize()
            reps = max(1, int(n * args.seconds / (time.perf_counter() - t0)))
            time.sleep(1.0)  # a cool gap between cases
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0 = datetime.datetime.now()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            w1 = datetime.datetime.now()
            ms = start.elapsed_time(end) / reps
            windows[name] = (w0, w1, ms, flops / ms / 1e9 if flops else None,
                             nbytes / ms / 1e9 if nbytes else None)
    finally:
        time.sleep(0.1)
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(log.name):
        parts = [s.strip() for s in line.split(",")]
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((ts, float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except (ValueError, IndexError):
            continue
    os.unlink(log.name)
    rows = []
    for name, (w0, w1, ms, tflops, tbps) in windows.items():
        # skip the first 0.5 s of the window (the clock settles)
        inside = [s for s in samples if w0 + datetime.timedelta(seconds=0.5) <= s[0] <= w1]
        if not inside:
            print(f"{name}: no samples in its window")
            continue
        clock = statistics.median(s[1] for s in inside)
        power = [s[2] for s in inside]
        capped = sum(1 for s in inside if s[3] & 0x4) / len(inside)
        row = dict(case=name, ms=ms, tflops=tflops, tbps=tbps, sm_clock_mhz_median=clock,
                   sm_clock_mhz_min=min(s[1] for s in inside), power_w_median=statistics.median(power),
                   power_w_max=max(power), power_capped_share=capped, samples=len(inside), power_field=fields[2])
        rows.append(row)
        rate = (f"{tflops:.0f} TFLOP/s" if tflops else "") + (f" {tbps:.2f} TB/s" if tbps else "")
        print(f"{name}: {ms:.3f} ms, {rate}, SM clock median {clock:.0f} MHz"
              f" (min {row['sm_clock_mhz_min']:.0f}), power median {row['power_w_median']:.0f} W"
              f" (max {row['power_w_max']:.0f}), power-capped in"
              f" {100 * capped:.0f}% of {len(inside)} samples", flush=True)
    if args.json:
        meta = dict(gpu=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(),
                    commit=os.environ.get("FLASHDSA_COMMIT", ""), tool="scripts/power_probe.py", seconds=args.seconds)
        json.dump(dict(meta, rows=rows), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
