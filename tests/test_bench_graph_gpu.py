"""GPU: ``flashdsa bench --graph``'s timing (``bench.harness.time_graph``) and its error entry.

* a captured op's replay times are positive, ordered (p10 <= median <= p90) and scale with the work replayed
  (a matmul of 64 times the FLOPs takes longer), and the op's result inside the graph is its eager result;
* a function that synchronises with the host is not captured: ``_graph_entry`` returns ``{"error": ...}`` after
  a run in PyTorch's sync debug mode, and the process is left as it was (default stream current, the sync debug
  mode restored, the allocator usable, a later capture works).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flashdsa.bench import harness  # noqa: E402


def test_time_graph_times_the_replayed_work():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(1024, 1024, device=dev, generator=g)
    b = torch.randn(4096, 4096, device=dev, generator=g)
    small = harness.time_graph(lambda: a @ a, dev, reps=10)
    large = harness.time_graph(lambda: b @ b, dev, reps=10)
    for t in (small, large):
        assert t.reps == 10 and 0 < t.ms_p10 <= t.ms_median <= t.ms_p90
    assert large.ms_median > small.ms_median
    graph, out = harness.capture_graph(lambda: a @ a)
    out.fill_(float("nan"))  # poisoned: the replay must write it
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a @ a)


def test_graph_entry_reports_an_uncapturable_call():
    dev = torch.device("cuda")
    x = torch.randn(256, device=dev)
    logs = []
    mode = torch.cuda.get_sync_debug_mode()
    entry = harness._graph_entry(lambda: x * float(x.sum().item()), dev, 10, logs.append)
    assert set(entry) == {"error"} and "synchronises" in entry["error"]
    assert logs  # the traceback went to the log
    assert torch.cuda.get_sync_debug_mode() == mode
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.cuda.empty_cache()
    ok = harness._graph_entry(lambda: x * 2, dev, 10, logs.append)
    assert set(ok) == {"ms_median", "ms_p10", "ms_p90", "reps"} and ok["ms_median"] > 0
