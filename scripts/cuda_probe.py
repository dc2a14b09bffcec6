"""Build and run a standalone CUDA probe (a ``main`` that prints one JSON object per line) on the GPU host.

Used by ``scripts/mma_sync_ceiling.py``, ``scripts/bulk_issue_probe.py`` and ``scripts/wgmma_rate_probe.py``:
``run_json_probe(SRC, "name")`` compiles ``PROBE_PRELUDE + SRC`` with nvcc for sm_90a, runs it, prints each JSON
row and writes the list to ``$OUT/name.json``.
"""

import json
import os
import subprocess
import tempfile


# prepended to every probe: probe_ms(launch) times the second of two calls of launch() with CUDA events
PROBE_PRELUDE = r"""
#include <cuda_runtime.h>
template <typename Launch>
float probe_ms(Launch launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch();
  cudaEventRecord(e0);
  launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}
"""


def run_json_probe(src: str, name: str) -> list[dict]:
    """The JSON rows the probe program ``PROBE_PRELUDE + src`` prints (also printed, and written to
    ``$OUT/<name>.json``)."""
    with tempfile.TemporaryDirectory() as d:
        cu, exe = os.path.join(d, "probe.cu"), os.path.join(d, "probe")
        with open(cu, "w") as f:
            f.write(PROBE_PRELUDE + src)
        subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-o", exe, cu],
                       check=True)
        res = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in res.splitlines() if line.startswith("{")]
    for r in rows:
        print(r, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows
