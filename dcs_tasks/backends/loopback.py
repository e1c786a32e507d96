"""`LoopbackBackend`: a `CommBackend` whose group lives in one process, for tests without processes or sockets.

A `LoopbackHub` stands in for the network: every `LoopbackBackend` built on it is one member (typically one per
thread: a `BucketSender` and N `WeightReceiver`s). It keeps the interface's rules as the torch.distributed
backend does, so code that passes here does not lean on leniency:

- `create_group` is a rendezvous: it returns once `world_size` members joined the name (bounded by
  `group_init_timeout_seconds`, then `GroupInitError` naming the ranks missing); so every member calls it
  concurrently, as with gloo. `GroupSpec.master_address` / `master_port` are not used.
- Collectives match by order: the k-th `broadcast_async` of each member on a group is one broadcast. A
  receiver's tensor must have the sender's dtype and element count (after `transport_view`: with
  `BackendType.GLOO`, FP8 and uint16/32/64 travel as uint8 views, as over gloo) and be contiguous, else both
  sides fail with `WeightSyncError` naming the rank, the dtypes and the sizes. Bytes are copied as soon as
  the sender's and a receiver's calls are both posted; the sender's handle completes once every receiver
  has its copy, so its buffer may be reused only after `wait()`, as with gloo.
- Every wait is bounded by `timeout_seconds` (`WeightSyncError` naming the members that never came); a member
  that destroys the group fails the others' pending and later operations at once.
- `send` / `recv` (point to point) carry a copy of the tensor dict; `recv` checks names, dtypes and shapes
  against `metadata["specs"]`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dcs_tasks.backends.base import CommBackend, CommHandle, GroupSpec, RecvRequest, SendRequest, transport_view
from dcs_tasks.config import BackendType, RoleInfo
from dcs_tasks.errors import GroupInitError, InvalidTensorSpec, WeightSyncError
from dcs_tasks.tensors import TensorSpec, dtype_name


@dataclass
class _Broadcast:
    """The k-th broadcast of a group: the sender's bytes, the receivers' tensors not yet filled, who has its copy."""

    src: int
    payload: torch.Tensor | None = None
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    error: str | None = None


@dataclass
class _Group:
    name: str
    world_size: int
    cond: threading.Condition
    members: dict[int, LoopbackBackend] = field(default_factory=dict)
    peers: dict[int, str] = field(default_factory=dict)
    posted: dict[int, int] = field(default_factory=dict)  # rank -> broadcasts it posted
    ops: dict[int, _Broadcast] = field(default_factory=dict)  # index -> broadcast, while in flight
    mail: dict[tuple[int, int], collections.deque[dict[str, torch.Tensor]]] = field(default_factory=dict)
    broken: str | None = None

    def describe(self, ranks: Iterable[int]) -> str:
        return ", ".join(self.peers.get(r, f"rank {r}") for r in sorted(ranks)) or "none"


class LoopbackHub:
    """The groups of one process's loopback backends, by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}

    def backends(self, count: int, timeout_seconds: float = 30.0) -> list[LoopbackBackend]:
        """`count` backends on this hub, each waiting at most `timeout_seconds` (group init included)."""
        return [LoopbackBackend(self, timeout_seconds, timeout_seconds) for _ in range(count)]

    def _join(self, spec: GroupSpec, member: LoopbackBackend, timeout: float) -> _Group:
        with self._lock:
            group = self._groups.get(spec.group_name)
            if group is None or group.broken is not None or len(group.members) == group.world_size:
                group = _Group(spec.group_name, spec.world_size, threading.Condition())
                self._groups[spec.group_name] = group
        with group.cond:
            fits = spec.world_size == group.world_size and 0 <= spec.rank < spec.world_size
            if not fits or spec.rank in group.members:
                raise GroupInitError(
                    f"group {spec.group_name!r}: rank {spec.rank} of world {spec.world_size} cannot join "
                    f"(world {group.world_size}, ranks joined: {sorted(group.members)})"
                )
            group.members[spec.rank] = member
            group.cond.notify_all()
            if not group.cond.wait_for(lambda: len(group.members) == group.world_size, timeout):
                del group.members[spec.rank]
                missing = set(range(group.world_size)) - set(group.members) - {spec.rank}
                raise GroupInitError(
                    f"group {spec.group_name!r} did not form within {timeout:g}s: ranks {sorted(missing)} never joined",
                    member=None,
                )
        return group


class LoopbackBackend(CommBackend):
    """One member of in-process groups on `hub`. Thread-safe; tensors stay on `device`."""

    def __init__(
        self,
        hub: LoopbackHub,
        timeout_seconds: float = 30.0,
        group_init_timeout_seconds: float = 30.0,
        backend_type: BackendType = BackendType.GLOO,
        device: torch.device | None = None,
    ) -> None:
        self.hub = hub
        self.timeout_seconds = timeout_seconds
        self.group_init_timeout_seconds = group_init_timeout_seconds
        self.backend_type = backend_type
        self.device = device or torch.device("cpu")
        self._groups: dict[str, tuple[_Group, int]] = {}  # name -> (group, my rank)
        self._lock = threading.Lock()

    # --- groups ---------------------------------------------------------------------------------
    def create_group(self, spec: GroupSpec) -> None:
        self.destroy_group(spec.group_name)
        group = self.hub._join(spec, self, self.group_init_timeout_seconds)
        with self._lock:
            self._groups[spec.group_name] = (group, spec.rank)

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            held = self._groups.pop(group_name, None)
        if held is not None:
            group, rank = held
            with group.cond:
                group.broken = group.broken or f"{group.describe([rank])} left the group"
                group.cond.notify_all()

    def has_group(self, group_name: str) -> bool:
        with self._lock:
            return group_name in self._groups

    def register_peer(self, group_name: str, group_rank: int, peer: RoleInfo) -> None:
        group, _ = self._held(group_name)
        with group.cond:
            group.peers[group_rank] = f"{peer.node_id} ({peer.address})"

    def close(self) -> None:
        with self._lock:
            names = list(self._groups)
        for name in names:
            self.destroy_group(name)

    def _held(self, group_name: str) -> tuple[_Group, int]:
        with self._lock:
            held = self._groups.get(group_name)
        if held is None:
            raise WeightSyncError(f"no loopback group named {group_name!r} in this backend; create it first")
        return held

    # --- collectives ----------------------------------------------------------------------------
    def broadcast_async(self, tensor: torch.Tensor, src: int, group_name: str) -> CommHandle:
        group, rank = self._held(group_name)
        wire = transport_view(tensor, self.backend_type)
        with group.cond:
            index = group.posted.get(rank, 0)
            group.posted[rank] = index + 1
            op = group.ops.setdefault(index, _Broadcast(src))
            if op.src != src:
                op.error = f"rank {rank} broadcasts from rank {src}, another member from rank {op.src}"
            elif not wire.is_contiguous():
                op.error = f"rank {rank} posted a non-contiguous {list(wire.shape)} tensor"
            elif rank == src:
                op.payload = wire
                for peer, target in list(op.pending.items()):
                    self._deliver(op, peer, target)
            elif op.payload is not None:
                self._deliver(op, rank, wire)
            else:
                op.pending[rank] = wire
            group.cond.notify_all()

        def done() -> bool:
            return op.error is not None or (
                len(op.received) == group.world_size - 1 if rank == src else rank in op.received
            )

        return CommHandle(lambda: self._wait(group, rank, index, op, done), done)

    @staticmethod
    def _deliver(op: _Broadcast, rank: int, target: torch.Tensor) -> None:
        payload = op.payload
        assert payload is not None
        op.pending.pop(rank, None)
        if target.dtype != payload.dtype or target.numel() != payload.numel():
            op.error = (
                f"rank {rank} receives {dtype_name(target.dtype)}[{target.numel()}] ({target.nbytes} bytes) but rank "
                f"{op.src} sends {dtype_name(payload.dtype)}[{payload.numel()}] ({payload.nbytes} bytes)"
            )
            return
        target.view(-1).view(torch.uint8).copy_(payload.reshape(-1).view(torch.uint8))  # bytes, as on a wire
        op.received.add(rank)

    def _wait(self, group: _Group, rank: int, index: int, op: _Broadcast, done: Callable[[], bool]) -> None:
        with group.cond:
            group.cond.wait_for(lambda: done() or group.broken is not None, self.timeout_seconds)
            if op.error is None and done():
                if len(op.received) == group.world_size - 1:  # every member posted it: the index is free again
                    group.ops.pop(index, None)
                return
            if op.error is not None:
                reason = op.error
            elif group.broken is not None:
                reason = group.broken
            else:
                waited = set(range(group.world_size)) - op.received - {op.src} if rank == op.src else {op.src}
                reason = f"timed out after {self.timeout_seconds:g}s waiting for {group.describe(waited)}"
        raise WeightSyncError(f"broadcast #{index} in loopback group {group.name!r} (rank {rank}) failed: {reason}")

    # --- point to point -------------------------------------------------------------------------
    def send(self, request: SendRequest) -> CommHandle:
        group, rank = self._held(request.group_name or "")
        message = {name: t.detach().to(self.device, copy=True) for name, t in request.tensor_dict.items()}
        with group.cond:
            if group.broken is not None:
                raise WeightSyncError(f"send in loopback group {group.name!r} failed: {group.broken}")
            group.mail.setdefault((rank, request.dst_rank), collections.deque()).append(message)
            group.cond.notify_all()
        return CommHandle.completed()

    def recv(self, request: RecvRequest) -> dict[str, torch.Tensor]:
        group, rank = self._held(request.group_name or "")
        specs: list[TensorSpec] = list(request.metadata.get("specs") or [])
        if not specs and request.tensor_names:
            raise InvalidTensorSpec(
                f"recv of {list(request.tensor_names)[:8]} needs metadata['specs'] (their TensorSpecs, in send order)"
            )
        box = (request.src_rank, rank)
        with group.cond:
            group.cond.wait_for(lambda: bool(group.mail.get(box)) or group.broken is not None, self.timeout_seconds)
            if not group.mail.get(box):
                why = group.broken or f"nothing from rank {request.src_rank} within {self.timeout_seconds:g}s"
                raise WeightSyncError(f"recv in loopback group {group.name!r} (rank {rank}) failed: {why}")
            message = group.mail[box].popleft()
        sent = [TensorSpec.of(name, t) for name, t in message.items()]
        if sent != specs:
            raise WeightSyncError(
                f"recv in loopback group {group.name!r}: rank {request.src_rank} sent {sent[:4]}, expected {specs[:4]}"
            )
        return message
