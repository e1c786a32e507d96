"""FP8, unsigned, complex and bool tensors through the real weight-sync path over gloo, bit-exact: a
`BucketSender` in one process, a `WeightReceiver` in another, flattened and one broadcast per tensor; then the
original design's point-to-point send/recv, fused and one message per tensor (`tensor_fusion_threshold`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.sync_dtypes_node import PAIR, digests, payload
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module

pytestmark = pytest.mark.distributed


def test_every_table_dtype_syncs_bit_exact_over_gloo(tmp_path: Path) -> None:
    out = tmp_path / "rank1.json"
    ports = [str(free_port()), str(free_port())]
    procs = [
        python_module("tests.distributed.sync_dtypes_node", str(rank), *ports, str(out), log=tmp_path / f"{rank}.log")
        for rank in range(2)
    ]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], [p.output() for p in procs]
    seen = json.loads(out.read_text())

    state = payload()
    expected = digests(state)
    for version in (1, 2):
        update = seen[f"v{version}"]
        assert update["version"] == version
        assert update["buckets"] >= 2  # the 36 KB uint32 tensor travels alone
        assert update["sums"] == expected, version
    assert seen["p2p_fused"]["sums"] == expected
    assert seen["p2p_fused"]["dtypes"] == {n: str(t.dtype) for n, t in state.items()}
    assert seen["p2p_each"]["sums"] == {n: expected[n] for n in PAIR}
