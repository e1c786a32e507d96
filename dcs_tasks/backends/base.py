"""The communication backend interface (the original design's `backends/base.py`).

Call order, per process: `create_group(spec)` (every member, concurrently; rank 0 hosts the store) ->
`register_peer(...)` (optional, names members in errors) -> any number of `broadcast`/`broadcast_async`/
`send`/`recv` on that group, in the same order on every member -> `destroy_group(name)`. A process may hold
several named groups at once (a trainer talks to its rollout group and its actor_fwd/reference group).
Every wait is bounded by the backend's `timeout_seconds`; failures raise `WeightSyncError` (or its
`GroupInitError` subclass for rendezvous), never hang.
"""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dcs_tasks.config import BackendType, RoleInfo

# Table dtypes (dcs_tasks/tensors.py) a transport cannot broadcast as themselves: torch raises "Invalid scalar
# type" (gloo, torch 2.13, measured) or has no NCCL type for them (torch's NCCL type table has no unsigned type
# wider than 8 bits; not run: no GPU here). They travel as their bytes: a broadcast moves bytes, the receiver
# views them the same way, and fused buckets are uint8 anyway. tests/distributed/test_sync_dtypes.py sends each
# of them one broadcast per tensor over gloo; the loopback backend applies the same rule.
_AS_BYTES: dict[BackendType, frozenset[torch.dtype]] = {
    BackendType.GLOO: frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64}),
    BackendType.NCCL: frozenset({torch.uint16, torch.uint32, torch.uint64}),
}


def transport_view(tensor: torch.Tensor, backend: BackendType) -> torch.Tensor:
    """`tensor` as `backend` broadcasts it: a contiguous tensor of a dtype it lacks as a uint8 view of the same
    memory (so a receive still lands in place), any other tensor as it is."""
    if tensor.dtype in _AS_BYTES.get(backend, frozenset()) and tensor.is_contiguous():
        return tensor.reshape(-1).view(torch.uint8)
    return tensor


@dataclass(frozen=True)
class GroupSpec:
    """How one member joins a named group: rendezvous at tcp://master_address:master_port as `rank`."""

    group_name: str
    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: BackendType = BackendType.GLOO


@dataclass(frozen=True)
class SendRequest:
    """The original design's point-to-point send of a tensor dict to `dst_rank` of `group_name`: one fused message
    or one per tensor, as `TensorFusion.should_fuse` decides (`DeviceDirectBackend.send`). Weight updates do not
    use it (they broadcast); it is kept, and tested, for code written against the original."""

    tensor_dict: Mapping[str, torch.Tensor]
    dst_rank: int
    group_name: str | None = None
    async_op: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RecvRequest:
    """The original design's point-to-point receive from `src_rank`; `metadata["specs"]` lists the expected
    `dcs_tasks.tensors.TensorSpec`s in send order (the receiver learns the dtypes and shapes from it)."""

    src_rank: int
    tensor_names: tuple[str, ...]
    group_name: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


class CommHandle:
    """Handle of an asynchronous operation: poll `is_complete`, block in `wait()`, or `await wait_async()`.

    `waiter` blocks until the operation ends (it must enforce its own timeout) and returns the result or
    raises; `poll` answers whether it already ended. `wait()` is idempotent.
    """

    def __init__(
        self, waiter: Callable[[], Any], poll: Callable[[], bool] | None = None, request_id: str | None = None
    ) -> None:
        self.request_id = request_id or uuid.uuid4().hex
        self._waiter = waiter
        self._poll = poll
        self._done = False
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def is_complete(self) -> bool:
        if not self._done and self._poll is not None and self._poll():
            return True
        return self._done

    def wait(self) -> Any:
        """Block until done; return the result or raise the operation's error."""
        if not self._done:
            try:
                self.result = self._waiter()
            except BaseException as exc:
                self.error = exc
            self._done = True
        if self.error is not None:
            raise self.error
        return self.result

    async def wait_async(self) -> Any:
        """`wait()` in a thread, so an event loop keeps running."""
        return await asyncio.to_thread(self.wait)

    @classmethod
    def completed(cls, result: Any = None) -> CommHandle:
        handle = cls(lambda: result)
        handle.wait()
        return handle


class CommBackend(abc.ABC):
    """A transport for tensor broadcasts between the members of named groups."""

    backend_type: BackendType  # the torch.distributed backend its groups use (gloo: CPU tensors, nccl: CUDA)
    device_id: int | None  # the CUDA device of an nccl backend (None: the current one)
    timeout_seconds: float

    def init_process_group(self, spec: GroupSpec) -> None:
        """Join (rank 0: host) the rendezvous of `spec`; bounded by the group-init timeout."""
        self.create_group(spec)

    @abc.abstractmethod
    def create_group(self, spec: GroupSpec) -> None:
        """Create the named group `spec.group_name` (same as `init_process_group`; replaces a same-named one)."""

    @abc.abstractmethod
    def destroy_group(self, group_name: str) -> None:
        """Tear the group down; idempotent."""

    @abc.abstractmethod
    def register_peer(self, group_name: str, group_rank: int, peer: RoleInfo) -> None:
        """Record which node holds `group_rank`, so that errors can name it."""

    def broadcast(self, tensor: torch.Tensor, src: int, group_name: str) -> None:
        """Blocking broadcast of `tensor` (in place on receivers) from group rank `src`."""
        self.broadcast_async(tensor, src, group_name).wait()

    @abc.abstractmethod
    def broadcast_async(self, tensor: torch.Tensor, src: int, group_name: str) -> CommHandle:
        """Start a broadcast; the handle's `wait()` enforces `timeout_seconds`."""

    @abc.abstractmethod
    def send(self, request: SendRequest) -> CommHandle:
        """Send `request.tensor_dict` to one rank (the original design's point-to-point API)."""

    @abc.abstractmethod
    def recv(self, request: RecvRequest) -> dict[str, torch.Tensor]:
        """Receive the tensors a matching `send` sent."""

    @abc.abstractmethod
    def has_group(self, group_name: str) -> bool:
        """Whether this process currently holds the named group."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy every group this backend holds."""
