"""Destroying a group closes its connections at once, even while the trainer still holds handles of its
broadcasts (a failed update's traceback does): an engine blocked in a receive (SGLang waits up to its 30-min
default timeout) is released immediately instead of when the trainer process exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ports import free_port
from tests.helpers.procs import REPO

pytestmark = pytest.mark.distributed

NODE = """
import json, sys, time, torch
from dcs_tasks.backends.base import GroupSpec
from dcs_tasks.backends.device_direct import DeviceDirectBackend
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
backend = DeviceDirectBackend(timeout_seconds=60.0, group_init_timeout_seconds=30.0)
backend.create_group(GroupSpec("g", "127.0.0.1", port, 2, rank))
if rank == 0:
    held = backend.broadcast_async(torch.ones(4096), 0, "g")  # kept, as a failed update's traceback keeps it
    held.wait()
    time.sleep(1.0)
    backend.destroy_group("g")
    time.sleep(25.0)  # still alive: only the destroy may release the peer
    json.dump({"held": held.is_complete}, open(out, "w"))
else:
    buffer = torch.zeros(4096)
    backend.broadcast(buffer, 0, "g")
    started = time.monotonic()
    try:
        backend.broadcast(buffer, 0, "g")  # never sent: blocked until the trainer's side closes
        error = None
    except Exception as exc:
        error = type(exc).__name__
    backend.destroy_group("g")  # a receiver whose group broke drops it (as WeightReceiver does)
    json.dump({"error": error, "seconds": time.monotonic() - started}, open(out, "w"))
"""


def test_a_destroyed_group_releases_a_peer_blocked_in_a_receive(tmp_path: Path) -> None:
    port = free_port()
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", NODE, str(r), str(port), str(outs[r])], cwd=REPO) for r in range(2)
    ]
    assert procs[1].wait(timeout=90) == 0
    released = json.loads(outs[1].read_text())
    procs[0].kill()
    procs[0].wait(10)
    assert released["error"] == "WeightSyncError"
    assert released["seconds"] < 10.0  # the destroy came after ~1 s; the trainer lived on for 25 s more
