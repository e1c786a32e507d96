"""The bucketed, double-buffered broadcast of a state dict (the trainer side of every update).

Steps per update: plan buckets (`plan_buckets`; tensors of >= ALONE_BYTES alone, sent from their own
memory, first) -> for each bucket k: announce it to the receivers (an awaitable supplied by the caller:
HTTP to rollout engines, or weight meta through the coordinator; announcements go out in bucket order and
need only the layout, so bucket k's goes out while it is packed), pack it if it is fused (into whichever of
the two flat buffers is no longer on the wire, so packing overlaps the queued transfers) and queue its
broadcast, keeping up to MAX_QUEUED in flight. The two flat buffers are allocated once and reused while
the layout fits. An optional `ready` future gates the first announcement and broadcast (the caller's
sessions), so the first bucket is packed while the caller prepares the receivers.

Two modes, one method each on `BucketSender`, sharing the plan, the announcements and the report:
`send_fused` (one flat broadcast per bucket, as above) and `send_per_tensor` (per bucket: announce, then one
broadcast per tensor; SGLang's default wire format, for engines without `flattened_bucket`). Both return a
`SendReport`; the destinations wrap it in an `UpdateReport` that the client reads.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dcs_tasks.backends.base import CommBackend, CommHandle
from dcs_tasks.backends.fusion import (
    ALIGNMENT,
    SGLANG_ALIGNMENT,
    FusionLayout,
    pack_into,
    plan_buckets,
    sglang_layout,
)
from dcs_tasks.sync.quantize import to_wire, wire_spec
from dcs_tasks.sync.wire import QuantizationConfig
from dcs_tasks.tensors import TensorSpec

# Tensors this big are sent from their own memory in a bucket of their own: copying them into a flat
# buffer costs more CPU than the extra HTTP round trip of one more bucket (~ms).
ALONE_BYTES = 8 * 1024 * 1024
# Broadcasts queued at once: enough that the wire never idles between buckets while Python catches up.
MAX_QUEUED = 8

Announce = Callable[[int, FusionLayout, bool], Awaitable[None]]


SendMode = Literal["fused", "per_tensor"]


@dataclass(frozen=True)
class SendReport:
    """What one send moved and where the time went (seconds); `bytes` are the tensors' payload bytes on the
    wire (after quantization, without alignment padding)."""

    mode: SendMode
    bytes: int
    tensors: int
    buckets: int
    broadcasts: int  # fused: one per bucket; per-tensor: one per tensor
    pack_seconds: float
    wait_seconds: float
    total_seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The figures a client's metrics carry (`update_weights_for_rollout`'s `metrics["rollout"]`)."""
        return {
            "bytes": self.bytes,
            "tensors": self.tensors,
            "buckets": self.buckets,
            "pack_seconds": self.pack_seconds,
            "wait_seconds": self.wait_seconds,
            "broadcast_seconds": self.total_seconds,
            "gb_per_s": self.gb_per_s,
        }


@dataclass(frozen=True)
class RolloutDetails:
    """A rollout update's own figures: the engines it reached, the version they now serve, the group it used
    (`group_rebuilt`: formed for this update), and where the time went (`phases`: `<event>_at` and
    `<what>_seconds` from the update's start; `total_seconds` the whole update)."""

    engines: int
    weight_version: int
    total_seconds: float
    group_name: str | None = None
    group_rebuilt: bool = False
    flattened: bool = False
    phases: Mapping[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.phases)
        out.update(engines=self.engines, weight_version=self.weight_version, total_seconds=self.total_seconds)
        if self.group_name is not None:
            out.update(group_name=self.group_name, group_rebuilt=self.group_rebuilt, flattened=self.flattened)
        return out


@dataclass(frozen=True)
class ActorFwdDetails:
    """An actor_fwd / reference update's own figures: how many groups it went to (0: this actor is not a
    source this round, nothing was sent)."""

    actor_fwd_groups: int

    def as_dict(self) -> dict[str, Any]:
        return {"actor_fwd_groups": self.actor_fwd_groups}


@dataclass(frozen=True)
class UpdateReport:
    """One destination's update as the client gets it: what the sender moved (None: nothing was sent, e.g. no
    engine was live) and the destination's own figures (`RolloutDetails`, `ActorFwdDetails`, or None)."""

    sent: SendReport | None
    details: RolloutDetails | ActorFwdDetails | None = None

    def as_dict(self) -> dict[str, Any]:
        """The flat mapping a client's metrics carry: the send's figures, then the destination's."""
        out: dict[str, Any] = self.sent.as_dict() if self.sent is not None else {}
        if self.details is not None:
            out.update(self.details.as_dict())
        return out


@dataclass
class _Tally:
    """A send's running totals, frozen into a `SendReport` at the end."""

    mode: SendMode
    tensors: int
    buckets: int
    started: float
    bytes: int = 0
    broadcasts: int = 0
    pack_seconds: float = 0.0
    wait_seconds: float = 0.0

    def report(self) -> SendReport:
        return SendReport(
            self.mode,
            self.bytes,
            self.tensors,
            self.buckets,
            self.broadcasts,
            self.pack_seconds,
            self.wait_seconds,
            time.perf_counter() - self.started,
        )


@dataclass
class _Queued:
    """A bucket whose broadcast is queued: its layout, handle, announcement and flat buffer slot (None: own
    memory)."""

    layout: FusionLayout
    handle: CommHandle
    announce: asyncio.Future[None] | None
    slot: int | None


class BucketSender:
    """Sends state dicts over one group of a backend as its rank `src`, in one of two modes: `send_fused` (one
    flat broadcast per bucket) or `send_per_tensor` (one broadcast per tensor, SGLang's default wire format).
    Both plan the same buckets and announce them the same way; it keeps its two flat buffers between updates.

    `sglang=True` lays fused buckets out as SGLang's `flattened_bucket` (no padding, largest itemsize first);
    otherwise DCS's 64-byte-aligned layout (actor_fwd / reference receivers)."""

    def __init__(
        self,
        backend: CommBackend,
        device: torch.device,
        bucket_size_bytes: int,
        alone_bytes: int | None = ALONE_BYTES,
        sglang: bool = False,
        src: int = 0,
    ) -> None:
        self.backend = backend
        self.device = device
        self.bucket_size_bytes = bucket_size_bytes
        self.alone_bytes = alone_bytes
        self.sglang = sglang
        self.src = src
        self._slots: list[torch.Tensor] = []
        self._planned: tuple[object, list[FusionLayout]] | None = None

    def plan(self, state: Mapping[str, torch.Tensor], quant: QuantizationConfig | None = None) -> list[FusionLayout]:
        """The buckets of `state`, in sending order. Kept for the next update: a state with the same names,
        dtypes, shapes, devices and contiguity (a model's, update after update) reuses them (planning 300
        tensors: 1.0 ms, the kept plan: 0.2 ms); the key holds no tensor."""
        key = (quant, [(name, t.dtype, t.shape, t.device, t.is_contiguous()) for name, t in state.items()])
        if self._planned is not None and self._planned[0] == key:
            return list(self._planned[1])
        specs = [wire_spec(TensorSpec.of(name, t), quant) for name, t in state.items()]
        alignment = SGLANG_ALIGNMENT if self.sglang else ALIGNMENT
        layouts = plan_buckets(specs, self.bucket_size_bytes, alignment, alone_bytes=self.alone_bytes)
        if self.sglang:
            layouts = [sglang_layout(layout.specs) for layout in layouts]
        # buckets sent from the tensors' own memory first: packing the fused ones then overlaps their transfer
        layouts.sort(key=lambda layout: not self._zero_copy(layout, state, quant))
        self._planned = (key, layouts)
        return list(layouts)

    def _zero_copy(
        self, layout: FusionLayout, state: Mapping[str, torch.Tensor], quant: QuantizationConfig | None
    ) -> bool:
        if len(layout.specs) != 1:
            return False
        tensor = state[layout.specs[0].name]
        return to_wire(tensor, quant) is tensor and tensor.is_contiguous() and tensor.device == self.device

    @property
    def buffer_bytes(self) -> int:
        """Bytes of flat send buffers this sender holds (two, reused by every update; 0 before a fused send)."""
        return sum(slot.numel() for slot in self._slots)

    def _buffers(self, fused: list[FusionLayout]) -> list[torch.Tensor]:
        """The two flat buffers, big enough for every bucket in `fused` (buckets sent from a tensor's own memory
        need none: a tensor larger than a bucket does not make them grow)."""
        need = max((lay.total_bytes for lay in fused), default=0)
        if not self._slots or self._slots[0].numel() < need or self._slots[0].device != self.device:
            self._slots = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._slots

    def _pack(
        self,
        slot: torch.Tensor,
        layout: FusionLayout,
        state: Mapping[str, torch.Tensor],
        quant: QuantizationConfig | None,
    ) -> torch.Tensor:
        if self._zero_copy(layout, state, quant):
            return state[layout.specs[0].name].detach().reshape(-1).view(torch.uint8)  # its own memory: no copy
        tensors = {spec.name: to_wire(state[spec.name], quant).to(self.device) for spec in layout.specs}
        view = pack_into(slot, layout, tensors)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return view

    async def send_fused(
        self,
        state: Mapping[str, torch.Tensor],
        group_name: str,
        announce: Announce | None = None,
        quant: QuantizationConfig | None = None,
        ready: asyncio.Future[None] | None = None,
    ) -> SendReport:
        """Broadcast every tensor of `state`, one flat uint8 broadcast per bucket; receivers learn what comes per
        bucket (`announce(k, layout, is_last)`, in bucket order, each once the previous one went through; it
        needs only the layout, so it goes out while its bucket is still being packed). `ready`: nothing is
        announced or broadcast before it resolves (the first bucket is packed meanwhile); its failure is raised.
        """
        started = time.perf_counter()
        layouts = self.plan(state, quant)
        tally = _Tally("fused", len(state), len(layouts), started)
        slots = self._buffers([lay for lay in layouts if not self._zero_copy(lay, state, quant)])
        queued: collections.deque[_Queued] = collections.deque()
        per: asyncio.Future[None] | None = None
        try:
            fused = 0
            for k, layout in enumerate(layouts):
                slot = None if self._zero_copy(layout, state, quant) else fused % 2
                if slot is not None:
                    fused += 1
                    while any(q.slot == slot for q in queued):  # its buffer is still on the wire
                        await self._settle(queued.popleft(), tally)
                previous = queued[-1] if queued else None
                per = self._announce_in_order(announce, k, layout, len(layouts), previous, ready if k == 0 else None)
                t0 = time.perf_counter()
                if slot is None:  # a view of the tensor itself: nothing to copy
                    view = self._pack(slots[0], layout, state, quant)
                else:
                    view = await asyncio.to_thread(self._pack, slots[slot], layout, state, quant)
                tally.pack_seconds += time.perf_counter() - t0
                if k == 0 and ready is not None:
                    await asyncio.shield(ready)
                queued.append(_Queued(layout, self.backend.broadcast_async(view, self.src, group_name), per, slot))
                tally.broadcasts += 1
                per = None
                while len(queued) > MAX_QUEUED:
                    await self._settle(queued.popleft(), tally)
            while queued:
                await self._settle(queued.popleft(), tally)
        finally:  # on failure: stop announcing; broadcasts still queued end within the group timeout
            await _cancel(per)
            for q in queued:
                await _cancel(q.announce)
        return tally.report()

    @staticmethod
    def _announce_in_order(
        announce: Announce | None,
        k: int,
        layout: FusionLayout,
        count: int,
        previous: _Queued | None,
        ready: asyncio.Future[None] | None = None,
    ) -> asyncio.Future[None] | None:
        """Bucket k's announcement, started only after bucket k-1's went through (receivers read them in order)
        and `ready` resolved."""
        if announce is None:
            return None
        before = previous.announce if previous is not None else None

        async def after_previous() -> None:
            if ready is not None:
                await asyncio.shield(ready)
            if before is not None:
                await before
            await announce(k, layout, k == count - 1)

        return asyncio.ensure_future(after_previous())

    @staticmethod
    async def _settle(queued: _Queued, tally: _Tally) -> None:
        t0 = time.perf_counter()
        await _settle(queued.handle.wait_async(), queued.announce)
        tally.wait_seconds += time.perf_counter() - t0
        tally.bytes += queued.layout.payload_bytes

    async def send_per_tensor(
        self,
        state: Mapping[str, torch.Tensor],
        group_name: str,
        announce: Announce,
        quant: QuantizationConfig | None = None,
        ready: asyncio.Future[None] | None = None,
    ) -> SendReport:
        """Per bucket: announce, then one async broadcast per tensor in layout order, then wait for all. `ready`
        is awaited before anything (there is nothing to pack ahead); its failure is raised."""
        if ready is not None:
            await asyncio.shield(ready)
        started = time.perf_counter()
        layouts = self.plan(state, quant)
        tally = _Tally("per_tensor", len(state), len(layouts), started)
        for k, layout in enumerate(layouts):
            announcing = asyncio.ensure_future(announce(k, layout, k == len(layouts) - 1))
            try:
                wired = [to_wire(state[s.name], quant).to(self.device).contiguous() for s in layout.specs]
                handles = [self.backend.broadcast_async(t, self.src, group_name) for t in wired]
                tally.broadcasts += len(handles)
                t0 = time.perf_counter()
                await asyncio.gather(*(h.wait_async() for h in handles), announcing)
                tally.wait_seconds += time.perf_counter() - t0
            finally:
                if not announcing.done():
                    announcing.cancel()
                    await asyncio.gather(announcing, return_exceptions=True)
            tally.bytes += layout.payload_bytes
        return tally.report()


async def _settle(broadcast: Awaitable[Any], per: asyncio.Future[None] | None) -> None:
    """Wait for a bucket's broadcast and its announcement; fail as soon as either fails."""
    bucket = asyncio.ensure_future(asyncio.gather(broadcast, *([per] if per is not None else [])))
    try:
        await bucket
    finally:
        await _cancel(bucket)
        await _cancel(per)


async def _cancel(future: asyncio.Future[Any] | None) -> None:
    if future is not None and not future.done():
        future.cancel()
        await asyncio.gather(future, return_exceptions=True)
