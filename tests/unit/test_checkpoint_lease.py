"""Staging-buffer leases: each save's buffer is handed back exactly once, whoever ends the lease; the CUDA
page-locking of a mapping is undone before the mapping goes away, and a refused one is logged.

CPU only: the pinning bookkeeping runs against `RecordingPinner`, which stands in for the CUDA runtime's
cudaHostRegister/cudaHostUnregister (the real calls are exercised by tests/integration/test_checkpoint_gpu.py).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from dcs_tasks.checkpoint.save.cuda import DeviceStager
from dcs_tasks.checkpoint.save.staging import StagingPool
from dcs_tasks.errors import StagingError


class RecordingPinner:
    """A HostPinner that records the registered ranges (and refuses when told to)."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, ptr: int, size: int) -> str | None:
        self.calls.append(("register", ptr))
        if self.refuse is not None:
            return self.refuse
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = size
        return None

    def unregister(self, ptr: int) -> str | None:
        self.calls.append(("unregister", ptr))
        assert self.registered.pop(ptr, None) is not None, "unregistered a range that was not registered"
        return None


def test_a_stale_release_cannot_free_the_buffer_another_save_holds(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 1, "t")
    first = pool.lease(4096)
    assert first is not None and first.release() and first.released
    second = pool.lease(4096)  # the same (only) buffer, now held by the next save
    assert second is not None and second.buffer is first.buffer
    assert not first.release()  # e.g. the dispatcher and the pending save both ending the first lease
    assert pool.in_flight() == 1 and pool.lease(1) is None  # still held: no third save can overwrite it
    assert not second.released
    pool.close()


def test_a_lease_ends_exactly_once_when_ended_from_many_threads(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 1, "t")
    lease = pool.lease(4096)
    assert lease is not None
    barrier = threading.Barrier(8)
    wins: list[bool] = []

    def end() -> None:
        barrier.wait(10)
        wins.append(lease.release())

    threads = [threading.Thread(target=end) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(wins) == [False] * 7 + [True]
    assert pool.in_flight() == 0
    pool.close()


def test_an_exception_inside_the_lease_hands_the_buffer_back_and_success_keeps_it(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 1, "t")
    lease = pool.lease(4096)
    assert lease is not None
    with pytest.raises(RuntimeError), lease:
        raise RuntimeError("staging failed")
    assert lease.released and pool.in_flight() == 0
    kept = pool.lease(4096)
    assert kept is not None
    with kept:
        pass  # handed over to the persist tasks: still held
    assert not kept.released and pool.in_flight() == 1
    pool.close()


def test_a_buffer_that_cannot_grow_is_not_left_in_flight(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 1, "t")
    with pytest.raises(StagingError, match="cannot reserve"):
        pool.lease(1 << 62)
    assert pool.in_flight() == 0 and pool.lease(4096) is not None
    pool.close()


def test_close_ends_every_lease_and_keeps_the_files_of_those_in_flight(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 2, "t")
    done, in_flight = pool.lease(4096), pool.lease(4096)
    assert done is not None and in_flight is not None
    done.release()
    pool.close(keep_in_flight=True)
    assert in_flight.released and not in_flight.release()  # a late end after close is a no-op
    assert sorted(tmp_path.iterdir()) == [in_flight.buffer.path]  # a worker may still read it
    with pytest.raises(StagingError, match="closed"):
        pool.lease(1)


def test_pinning_is_undone_when_the_buffer_grows_and_when_it_closes(tmp_path: Path) -> None:
    pinner = RecordingPinner()
    pool = StagingPool(tmp_path, 1, "t")
    lease = pool.lease(4096)
    assert lease is not None
    buf = lease.buffer
    assert buf.pin(pinner) and buf.pin(pinner) and buf.pinned  # registered once per mapping
    assert buf.view is not None
    small = buf.view.data_ptr()
    assert pinner.registered == {small: buf.capacity}
    lease.release()
    grown = pool.lease(64 * 4096)  # a bigger layout: a new mapping, the old one unpinned first
    assert grown is not None and grown.buffer is buf and not buf.pinned
    assert pinner.registered == {} and pinner.calls == [("register", small), ("unregister", small)]
    assert buf.pin(pinner) and buf.view is not None
    big = buf.view.data_ptr()
    pool.close(keep_in_flight=True)
    assert pinner.registered == {} and pinner.calls[-1] == ("unregister", big)


def test_a_refused_pin_is_logged_with_the_reason_and_not_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pinner = RecordingPinner(refuse="cudaError 2 (cudaErrorMemoryAllocation)")
    pool = StagingPool(tmp_path, 1, "t")
    lease = pool.lease(4096)
    assert lease is not None
    with caplog.at_level(logging.WARNING, logger="dcs_tasks.checkpoint.save.pinning"):
        assert not lease.buffer.pin(pinner)
        assert not lease.buffer.pin(pinner)  # the next save does not ask (and log) again
    assert not lease.buffer.pinned and len(pinner.calls) == 1
    (record,) = caplog.records
    assert "cudaErrorMemoryAllocation" in record.getMessage() and "pageable" in record.getMessage()
    pool.close()  # nothing registered, nothing to undo
    assert len(pinner.calls) == 1


def test_a_pin_without_a_cuda_runtime_falls_back_instead_of_raising(tmp_path: Path) -> None:
    pool = StagingPool(tmp_path, 1, "t")
    lease = pool.lease(4096)
    assert lease is not None
    stager = DeviceStager()  # the real cudart pinner
    if torch.cuda.is_available():
        pytest.skip("a CUDA runtime is present: the GPU test covers the real registration")
    assert not lease.buffer.pin(stager.pinner)
    pool.close()


def test_one_side_stream_per_device_is_reused_across_saves() -> None:
    made: list[torch.device] = []

    def new_stream(device: torch.device) -> object:
        made.append(device)
        return object()

    stager = DeviceStager(RecordingPinner(), new_stream=new_stream)
    first = stager.stream(torch.device("cuda", 0))
    assert all(stager.stream(torch.device("cuda", 0)) is first for _ in range(5))
    assert stager.stream(torch.device("cuda")) is first  # "cuda" is device 0
    assert stager.stream(torch.device("cuda", 1)) is not first
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
