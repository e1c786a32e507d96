"""`DeviceDirectBackend`: broadcasts over torch.distributed, gloo for CPU tensors and NCCL for CUDA.

Each named group is a standalone process group (see `process_group.new_group`), so one process can hold
several. Every collective carries `timeout_seconds` (the group's timeout and the wait's), and a failed
or timed-out operation raises `WeightSyncError` naming the group and, where known, the peer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dcs_tasks.backends.base import CommBackend, CommHandle, GroupSpec, RecvRequest, SendRequest, transport_view
from dcs_tasks.backends.fusion import FusionLayout, TensorFusion, unpack_views
from dcs_tasks.backends.process_group import destroy, new_group_within, release_store
from dcs_tasks.config import BackendType, RoleInfo
from dcs_tasks.errors import BackendUnavailable, GroupInitError, InvalidTensorSpec, WeightSyncError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.tensors import TensorSpec

log = logging.getLogger(__name__)


class _WorkSlot:
    """The only reference DCS keeps to an in-flight work: emptied when the work ends or its group is destroyed."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work: Any = work


@dataclass
class _Group:
    spec: GroupSpec
    pg: dist.ProcessGroup | None
    peers: dict[int, str] = field(default_factory=dict)
    slots: set[_WorkSlot] = field(default_factory=set)

    def process_group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise WeightSyncError(f"process group {self.spec.group_name!r} was destroyed")
        return self.pg

    def describe_peers(self, exclude: int) -> str:
        names = [self.peers.get(r, f"rank {r}") for r in range(self.spec.world_size) if r != exclude]
        return ", ".join(names)


class DeviceDirectBackend(CommBackend):
    """torch.distributed transport. Thread-safe for group bookkeeping; collectives follow torch's rules."""

    def __init__(
        self,
        backend_type: BackendType = BackendType.GLOO,
        role_info: RoleInfo | None = None,
        timeout_seconds: float = 300.0,
        group_init_timeout_seconds: float = 60.0,
        device_id: int | None = None,
        fusion_threshold_bytes: int = 1024 * 1024,
    ) -> None:
        if backend_type not in (BackendType.GLOO, BackendType.NCCL):
            raise BackendUnavailable(
                f"DeviceDirectBackend supports gloo and nccl, not {getattr(backend_type, 'value', backend_type)}"
            )
        self.backend_type = backend_type
        self.role_info = role_info
        self.timeout_seconds = timeout_seconds
        self.group_init_timeout_seconds = group_init_timeout_seconds
        self.device_id = device_id
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._fusion = TensorFusion(fusion_threshold_bytes)

    @property
    def device(self) -> torch.device:
        """Where tensors for this transport must live: CPU for gloo, the CUDA device for NCCL."""
        if self.backend_type is BackendType.NCCL:
            return torch.device("cuda", self.device_id or 0)
        return torch.device("cpu")

    # --- groups ---------------------------------------------------------------------------------
    def create_group(self, spec: GroupSpec) -> None:
        self.destroy_group(spec.group_name)
        if self.backend_type is BackendType.NCCL and self.device_id is not None:
            torch.cuda.set_device(self.device_id)
        try:
            pg = new_group_within(spec, self.group_init_timeout_seconds, self.timeout_seconds)
        except Exception as exc:  # torch raises DistStoreError, RuntimeError, ValueError, TimeoutError
            raise GroupInitError(
                f"group {spec.group_name!r} (tcp://{spec.master_address}:{spec.master_port}, world "
                f"{spec.world_size}, rank {spec.rank}) did not form within {self.group_init_timeout_seconds:g}s: "
                f"{exc}"
            ) from exc
        with self._lock:
            self._groups[spec.group_name] = _Group(spec, pg)
        get_metrics().active_connections.inc()  # one per process group held
        log.info("joined group %s as rank %d of %d", spec.group_name, spec.rank, spec.world_size)

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is not None:
            get_metrics().active_connections.dec()
            # Drop every reference to the group and its works first: gloo keeps its sockets open while any
            # ProcessGroup or Work object is alive (handles, tracebacks), and an engine blocked in a receive
            # (SGLang waits up to its 30-min default) is only released when the connection closes.
            pg, group.pg = group.pg, None
            for slot in list(group.slots):
                slot.work = None
            group.slots.clear()
            if pg is not None:
                destroy(pg)
            del pg
            if group.spec.rank == 0:
                release_store(group.spec.master_address, group.spec.master_port)

    def has_group(self, group_name: str) -> bool:
        with self._lock:
            return group_name in self._groups

    def group_spec(self, group_name: str) -> GroupSpec:
        return self._group(group_name).spec

    def register_peer(self, group_name: str, group_rank: int, peer: RoleInfo) -> None:
        self._group(group_name).peers[group_rank] = f"{peer.node_id} ({peer.address})"

    def close(self) -> None:
        with self._lock:
            names = list(self._groups)
        for name in names:
            self.destroy_group(name)

    def _group(self, group_name: str) -> _Group:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise WeightSyncError(f"no process group named {group_name!r} in this process; create it first")
        return group

    # --- collectives ----------------------------------------------------------------------------
    def broadcast_async(self, tensor: torch.Tensor, src: int, group_name: str) -> CommHandle:
        group = self._group(group_name)
        tensor = transport_view(tensor, group.spec.backend)
        try:
            work = dist.broadcast(tensor, src=src, group=group.process_group(), async_op=True)
        except Exception as exc:
            raise self._failure(group, "broadcast", exc) from exc
        return self._handle(group, "broadcast", work)

    def send(self, request: SendRequest) -> CommHandle:
        """The original design's point-to-point send: one fused message when `TensorFusion.should_fuse` says so
        (more than one tensor and >= `fusion_threshold_bytes` in total), else one message per tensor, in dict
        order, each the tensor's bytes. `recv` decides the same way from its specs, so both ends need the same
        threshold (`DCSConfig.sync.tensor_fusion_threshold`)."""
        group = self._group(request.group_name or "")
        tensors = dict(request.tensor_dict)
        if self._fusion.should_fuse(tensors):
            messages = [self._fusion.fuse(tensors)[0]]
        else:
            messages = [_as_bytes(t) for name, t in tensors.items() if TensorSpec.of(name, t).nbytes]
        works: list[Any] = []
        try:
            for message in messages:
                works.append(dist.isend(message, dst=request.dst_rank, group=group.process_group()))
        except Exception as exc:
            raise self._failure(group, "send", exc) from exc
        handle = self._handle_all(group, "send", works)
        if not request.async_op:
            handle.wait()
        return handle

    def recv(self, request: RecvRequest) -> dict[str, torch.Tensor]:
        """Receive what a matching `send` sent; `request.metadata["specs"]` lists its `TensorSpec`s in order."""
        group = self._group(request.group_name or "")
        specs: list[TensorSpec] = list(request.metadata.get("specs") or [])
        if not specs and request.tensor_names:
            raise InvalidTensorSpec(
                f"recv of {list(request.tensor_names)[:8]} needs metadata['specs'] (their TensorSpecs, in send order)"
            )
        targets, result = self._recv_targets(specs)
        works: list[Any] = []
        try:
            for target in targets:
                works.append(dist.irecv(target, src=request.src_rank, group=group.process_group()))
        except Exception as exc:
            raise self._failure(group, "recv", exc) from exc
        self._handle_all(group, "recv", works).wait()
        return result()

    def _recv_targets(
        self, specs: list[TensorSpec]
    ) -> tuple[list[torch.Tensor], Callable[[], dict[str, torch.Tensor]]]:
        """The buffers `recv` receives into (one fused buffer, or one per non-empty tensor) and how to read the
        tensors back from them."""
        if self._fusion.should_fuse_specs(specs):
            layout = FusionLayout.build(specs, self._fusion.alignment)
            buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
            return [buffer[: layout.wire_bytes]], lambda: unpack_views(buffer, layout)
        raw = {s.name: torch.empty(s.nbytes, dtype=torch.uint8, device=self.device) for s in specs}

        def tensors() -> dict[str, torch.Tensor]:
            return {s.name: raw[s.name].view(s.torch_dtype).view(s.shape) for s in specs}

        return [t for t in raw.values() if t.numel()], tensors

    def _handle_all(self, group: _Group, op: str, works: list[Any]) -> CommHandle:
        """One handle over several works (a send of several messages): done when each is."""
        handles = [self._handle(group, op, work) for work in works]
        works.clear()
        return CommHandle(lambda: [h.wait() for h in handles], lambda: all(h.is_complete for h in handles))

    def _handle(self, group: _Group, op: str, work: Any) -> CommHandle:
        timeout = timedelta(seconds=self.timeout_seconds)
        slot = _WorkSlot(work)
        group.slots.add(slot)
        del work

        def waiter() -> None:
            current = slot.work
            if current is None:
                raise self._failure(group, op, RuntimeError("the group was destroyed while this operation ran"))
            try:
                current.wait(timeout)
            except Exception as exc:
                raise self._failure(group, op, exc) from exc
            finally:
                del current
                slot.work = None
                group.slots.discard(slot)

        def poll() -> bool:
            current = slot.work
            return current is None or bool(current.is_completed())

        return CommHandle(waiter, poll)

    def _failure(self, group: _Group, op: str, exc: BaseException) -> WeightSyncError:
        peers = group.describe_peers(exclude=group.spec.rank)
        return WeightSyncError(
            f"{op} in group {group.spec.group_name!r} failed or timed out after <= {self.timeout_seconds:g}s "
            f"(members: {peers}): {exc}",
            member=None,
        )


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when it is contiguous): what a point-to-point message
    carries, so that every dtype of the table travels, bit-exact, whatever the transport knows of it."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
