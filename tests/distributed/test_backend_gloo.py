"""DeviceDirectBackend across real processes (gloo): two groups per process, bit-exact fused buckets,
point-to-point send/recv, and a dead peer that fails the broadcast within the timeout instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.backend_node import digests, payload
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module

pytestmark = pytest.mark.distributed


def test_groups_buckets_p2p_and_dead_peer(tmp_path: Path) -> None:
    ports = [str(free_port()), str(free_port())]
    outs = [tmp_path / f"rank{r}.json" for r in range(3)]
    procs = [
        python_module("tests.distributed.backend_node", str(r), *ports, str(outs[r]), log=tmp_path / f"rank{r}.log")
        for r in range(3)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0, 0], [p.output(2000) for p in procs]
    seen = [json.loads(o.read_text()) for o in outs]

    assert all(s["a"] == digests(payload(1)) for s in seen)
    assert seen[0]["b"] == seen[1]["b"] == digests(payload(2))
    assert seen[1]["p2p"] == digests(payload(3))
    dead = seen[0]["dead_peer"]
    assert dead["error"] is not None and dead["seconds"] < 5.0 + 2.0
    assert "node_2" in dead["error"]  # the registered peers are named
