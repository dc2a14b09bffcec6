"""CPU: which partial-kernel module each dense-decode variant runs for a given number of query rows."""

import pytest

pytest.importorskip("tilelang")

from flashdsa.decode import kernel_dense as kd  # noqa: E402
from flashdsa.decode import kernel_dense_narrow as narrow  # noqa: E402
from flashdsa.decode import kernel_dense_ws as ws  # noqa: E402


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 64, 512])
def test_variant_picks_module(rows):
    assert kd._ws_module("ws", rows) is ws
    assert kd._ws_module("narrow", rows) is (narrow if rows <= narrow.MAX_ROWS else ws)
    assert kd._ws_module("auto", rows) is (narrow if rows <= kd.AUTO_NARROW_ROWS else ws)


def test_narrow_row_tile():
    assert [narrow.rows_tile(r) for r in (1, 16, 17, 32)] == [16, 16, 32, 32]
    with pytest.raises(ValueError, match="s_q\\*H=33"):
        narrow.rows_tile(33)


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="variant 'wide'"):
        kd._variant("wide")
