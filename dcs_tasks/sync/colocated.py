"""Colocated updates: a trainer and rollout engines on the same host and device, weights by handle.

Topology. An engine is colocated with a trainer rank when its registration says so:
`metadata["colocated"] = {"trainer_rank": R, "device": "cuda:0" | "cpu", "host_id": ID}` (`colocation_metadata`;
`dcs receiver --colocated-with R`). `host_id` is the machine's boot id (/proc/sys/kernel/random/boot_id), so a
trainer never takes an engine on another machine that claims the same device for a colocated one. A malformed
entry is refused with `ColocationInvalid` naming the engine; an entry for another trainer rank, another host or
another device is a remote engine for this trainer. Everything else about the engine (its protocol family,
tp_size) comes from the engine, as for remote ones.

Transport. The trainer packs each bucket (SGLang's flattened layout) into one of two reused buckets it owns
(`BucketPool`): on CUDA a device tensor shared by CUDA IPC handle, on CPU a tensor in torch's shared-memory file
(`/dev/shm/torch_*`); no byte goes through the host or a process group. Each engine gets the bucket by handle
in its own protocol:
- SGLang: `POST /update_weights_from_tensor` with `load_format="flattened_bucket"` and, per TP rank, SGLang's
  `MultiprocessingSerializer` payload (torch's ForkingPickler reductions; metadata entries as
  `types.SimpleNamespace`, which SGLang's `SafeUnpickler` allows and its loader reads by attribute). The engine
  unpickles it: that is SGLang's protocol, and it runs only on a trainer the engine's API key trusts.
- `dcs receiver`: `POST /update_weights_from_ipc_frame` with DCS's frame (`dcs_tasks/sync/ipcframe.py`: JSON,
  fixed fields; the receiver never unpickles).
- vLLM (DCS's plugin, plugins/vllm-dcs, started with backend "dcs-ipc"): its RL API's session (`/pause?mode=abort`,
  `/start_weight_update`, `/finish_weight_update {"weight_version"}`, `/resume`) and per bucket
  `POST /update_weights {"update_info": {"frame": <DCS's frame>}}`; the plugin's workers read the frame with
  their own reader of the same format (plugins/vllm-dcs/vllm_dcs/ipcframe.py), never unpickle. vLLM's own
  `ipc` engine is not used: its HTTP path unpickles `ipc_handles_pickled` (with
  VLLM_ALLOW_INSECURE_SERIALIZATION=1), on a route vLLM's `--api-key` does not guard.
A bucket is released when every engine answered its request. An engine that has not answered within
`release_seconds` is marked failed (`ColocatedEngineFailed` names it), its request is abandoned, and the
bucket it may still hold is dropped and a fresh one allocated: on CPU the trainer unmaps its file (the engine
keeps only its own mapping); on CUDA the trainer zeroes the block's IPC reference count (a file torch created
in this process) and calls `torch.cuda.ipc_collect()`, so the block returns to the trainer's allocator instead
of waiting in torch's limbo for an engine that never lets go. Nothing an engine answers is used as an address.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import mmap
import os
import re
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from dcs_tasks.backends.fusion import SGLANG_ALIGNMENT, FusionLayout, pack_into, plan_buckets, sglang_layout
from dcs_tasks.engine_http import EngineHTTP, EngineHTTPError
from dcs_tasks.errors import ConfigError, WeightSyncError
from dcs_tasks.sync.engine_protocol import auth_headers, engine_info
from dcs_tasks.sync.ipcframe import CudaRef, IpcFrame, ShmRef, frame_for
from dcs_tasks.sync.wire import EngineEndpoint
from dcs_tasks.tensors import TensorSpec

log = logging.getLogger(__name__)

MAX_TRAINER_RANK = 65535
DEVICE_PATTERN = re.compile(r"^(cpu|cuda:[0-9]{1,3})$")
HOST_ID_PATTERN = re.compile(r"^[0-9a-f-]{8,64}$")
FRAME_ROUTE = "/update_weights_from_ipc_frame"
SGLANG_ROUTE = "/update_weights_from_tensor"
VLLM_ROUTE = "/update_weights"
_VLLM_STEPS = {
    "/pause_generation": "/pause",
    "/begin_weight_update": "/start_weight_update",
    "/end_weight_update": "/finish_weight_update",
    "/continue_generation": "/resume",
}
REF_COUNTER_FILE_BYTES = 8 * 10000  # torch's CUDA IPC ref-counter files (c10 ipc_ref_counter_file_size entries)


class ColocationInvalid(ConfigError):
    """An engine's `metadata["colocated"]` that is not `{"trainer_rank", "device", "host_id"}` within bounds."""


class ColocatedEngineFailed(WeightSyncError):
    """A colocated engine refused a bucket, or did not answer (release it) within the deadline."""


@dataclass(frozen=True)
class Colocation:
    trainer_rank: int
    device: str
    host_id: str


def host_id() -> str:
    """This machine's boot id: the same for every process of one boot of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # no procfs: the host name, spelled as an id
        return os.uname().nodename.encode().hex()[:64]


def colocation_metadata(trainer_rank: int, device: str) -> dict[str, Any]:
    """The registration metadata entry saying this engine shares `device` with trainer rank `trainer_rank`."""
    entry = {"trainer_rank": trainer_rank, "device": device, "host_id": host_id()}
    colocation_of({"colocated": entry}, "this engine")
    return {"colocated": entry}


def colocation_of(metadata: Mapping[str, Any], engine: str) -> Colocation | None:
    """The engine's colocation (None: it has none, it is remote); ColocationInvalid naming `engine` when the
    entry is there but malformed."""
    entry = metadata.get("colocated")
    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) != {"trainer_rank", "device", "host_id"}:
        raise ColocationInvalid(
            f"{engine}: metadata['colocated'] must be {{'trainer_rank', 'device', 'host_id'}}, got {entry!r:.200}"
        )
    rank, device, host = entry["trainer_rank"], entry["device"], entry["host_id"]
    if type(rank) is not int or not 0 <= rank <= MAX_TRAINER_RANK:
        raise ColocationInvalid(f"{engine}: colocated trainer_rank must be an integer in [0, {MAX_TRAINER_RANK}]")
    if not isinstance(device, str) or not DEVICE_PATTERN.match(device):
        raise ColocationInvalid(f"{engine}: colocated device must be 'cpu' or 'cuda:N', got {device!r:.40}")
    if not isinstance(host, str) or not HOST_ID_PATTERN.match(host):
        raise ColocationInvalid(f"{engine}: colocated host_id must be a boot id, got {host!r:.80}")
    return Colocation(rank, device, host)


def is_colocated(metadata: Mapping[str, Any], engine: str, trainer_rank: int, device: torch.device) -> bool:
    """Whether this trainer rank on `device` reaches the engine by handle (same rank, device and host)."""
    where = colocation_of(metadata, engine)
    if where is None:
        return False
    here = "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else 0}"
    return where.trainer_rank == trainer_rank and where.device == here and where.host_id == host_id()


# --- the trainer's buckets ------------------------------------------------------------------------------------


@dataclass
class _Slot:
    tensor: torch.Tensor
    generation: int
    shm: ShmRef | None = None
    cuda: CudaRef | None = None
    storage_meta: tuple[Any, ...] = ()  # what torch's sharing gave (CPU: manager, name, size)


class BucketPool:
    """Two reused buckets of `bucket_bytes` on `device`, shared once each (a reallocation shares anew).
    `drop(k)` forgets slot k (an engine kept it past its deadline) and allocates a fresh one."""

    SLOTS = 2

    def __init__(self, device: torch.device, bucket_bytes: int) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"colocated updates need a cpu or cuda device, not {device}")
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.slots: list[_Slot] = [self._new(0) for _ in range(self.SLOTS)]
        self.dropped = 0

    def _new(self, generation: int) -> _Slot:
        tensor = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        storage = tensor.untyped_storage()
        if self.device.type == "cpu":
            manager, name, size = storage._share_filename_cpu_()
            shm_name = name.decode() if isinstance(name, bytes) else name
            return _Slot(tensor, generation, shm=ShmRef(shm_name, 64), storage_meta=(manager, name, size))
        (dev, handle, size, offset, ref, ref_offset, event, _sync) = storage._share_cuda_()
        cuda = CudaRef(int(dev), bytes(handle), int(size), int(offset), bytes(ref), int(ref_offset), bytes(event))
        return _Slot(tensor, generation, cuda=cuda)

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() for s in self.slots)

    def drop(self, k: int) -> None:
        """Forget slot k's memory (an engine may still hold it) and allocate a fresh bucket in its place."""
        old = self.slots[k]
        self.slots[k] = self._new(old.generation + 1)
        self.dropped += 1
        if old.cuda is not None:
            _unpin_cuda(old.cuda)
        if old.shm is not None:
            _own_only(old.shm)
        del old
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


def _own_only(ref: ShmRef) -> None:
    """Set the reference count of a shared file this process created back to its own one, so that torch unlinks
    it when the trainer's tensor goes (references handed to engines that never opened or never closed it are
    forgotten; an engine's own mapping stays valid, its later close only counts below zero). Unlinking the file
    here instead would make torch's own unlink fail, and abort, when the trainer's tensor is freed."""
    try:
        fd = os.open("/dev/shm" + ref.name, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        with mmap.mmap(fd, 8) as m:  # torch's RefcountedMapAllocator header: an atomic int refcount first
            m[0:4] = (1).to_bytes(4, "little")
    finally:
        os.close(fd)


def _unpin_cuda(ref: CudaRef) -> None:
    """Zero the IPC reference count of a block this process shared, so that torch frees it once the trainer's
    own tensor is gone (otherwise torch keeps it in limbo until every engine that opened it closed it)."""
    name = ref.ref_counter.decode(errors="replace")
    if not re.fullmatch(r"/torch_[0-9_]+", name):
        return
    try:
        fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        where = 64 + ref.ref_counter_offset * 8  # RefcountedMapAllocator's header, then int64 counters
        if where + 8 <= size:
            with mmap.mmap(fd, size) as m:
                m[where : where + 8] = (0).to_bytes(8, "little")
    finally:
        os.close(fd)


# --- SGLang's payload ---------------------------------------------------------------------------------------


def _reduce_cpu_storage(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """torch's file_system reduction of a CPU storage (torch.multiprocessing.reductions.reduce_storage), whatever
    the process's sharing strategy: the engine opens the file by name, an unrelated process can."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    return (rebuild_storage_filename, (type(storage), *metadata))


def sglang_payload(view: torch.Tensor, layout: FusionLayout) -> str:
    """One TP rank's `serialized_named_tensors` entry for `load_format="flattened_bucket"` (base64)."""
    import torch.multiprocessing

    metadata = [
        types.SimpleNamespace(
            name=spec.name,
            shape=torch.Size(spec.shape),
            dtype=spec.torch_dtype,
            start_idx=offset,
            end_idx=offset + spec.nbytes,
            numel=spec.nbytes,
        )
        for spec, offset in zip(layout.specs, layout.offsets, strict=True)
    ]
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if view.device.type == "cpu":
        pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
    pickler.dump({"flattened_tensor": view, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


# --- targets and the update -----------------------------------------------------------------------------------


@dataclass
class ColocatedEngine:
    """One colocated engine of an update: its node id, URL, protocol family ("sglang", "dcs", "vllm") and TP
    size."""

    node_id: str
    url: str
    kind: str
    tp_size: int = 1
    sessions: bool = True  # SGLang 0.5.21+ and `dcs receiver`: /begin_weight_update and /end_weight_update
    pause_mode: str = "retract"  # SGLang 0.5.20: "abort" (dcs_tasks/sync/engine_protocol.py says which)
    failed: str | None = None


@dataclass
class ColocatedReport:
    bytes: int = 0
    buckets: int = 0
    pack_seconds: float = 0.0
    load_seconds: float = 0.0
    total_seconds: float = 0.0
    dropped_buckets: int = 0
    failed: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "buckets": self.buckets,
            "pack_seconds": self.pack_seconds,
            "load_seconds": self.load_seconds,
            "total_seconds": self.total_seconds,
            "dropped_buckets": self.dropped_buckets,
            "gb_per_s": self.bytes / self.total_seconds / 1e9 if self.total_seconds > 0 else 0.0,
        }


class ColocatedSender:
    """Pushes state dicts to colocated engines by handle (see the module docstring). One per trainer rank and
    device; keeps its two buckets between updates."""

    def __init__(
        self,
        device: torch.device,
        bucket_size_bytes: int,
        http: EngineHTTP,
        release_seconds: float = 60.0,
        call_seconds: float = 30.0,
    ) -> None:
        self.device = device
        self.bucket_size_bytes = bucket_size_bytes
        self.http = http
        self.release_seconds = release_seconds
        self.call_seconds = call_seconds
        self._pool: BucketPool | None = None

    def plan(self, state: Mapping[str, torch.Tensor]) -> list[FusionLayout]:
        specs = [TensorSpec.of(name, t) for name, t in state.items()]
        layouts = plan_buckets(specs, self.bucket_size_bytes, SGLANG_ALIGNMENT)
        return [sglang_layout(layout.specs) for layout in layouts]

    def pool(self, need: int) -> BucketPool:
        if self._pool is None or self._pool.bucket_bytes < need:
            self._pool = BucketPool(self.device, max(need, 1))
        return self._pool

    async def _call(self, engine: ColocatedEngine, path: str, body: Any, timeout: float) -> None:
        try:
            answer = await self.http.request("POST", engine.url + path, timeout, json_body=body)
        except EngineHTTPError as exc:
            raise ColocatedEngineFailed(f"{engine.node_id} at {engine.url}{path}: {exc}") from None
        if not answer.is_success:
            raise ColocatedEngineFailed(f"{engine.node_id} at {engine.url}{path}: {answer.status} {answer.text:.300}")

    async def _session(self, engines: Sequence[ColocatedEngine], path: str, body: Any, weight_version: int = 0) -> None:
        async def one(engine: ColocatedEngine) -> None:
            if path.endswith("_weight_update") and not engine.sessions:
                return
            path_here, body_here = path, body
            if path == "/pause_generation":
                body_here = {"mode": engine.pause_mode}
            if engine.kind == "vllm":  # vLLM's RL API names the same steps its own way
                path_here, body_here = _VLLM_STEPS[path], {}
                if path == "/pause_generation":
                    path_here = f"/pause?mode={engine.pause_mode}"
                elif path == "/end_weight_update":
                    body_here = {"weight_version": str(weight_version)}
            if engine.failed is None:
                try:
                    await self._call(engine, path_here, body_here, self.call_seconds)
                except ColocatedEngineFailed as exc:
                    engine.failed = str(exc)

        await asyncio.gather(*(one(e) for e in engines))

    def _body(self, engine: ColocatedEngine, frame: IpcFrame, view: torch.Tensor, layout: FusionLayout) -> Any:
        if engine.kind == "dcs":
            return json.loads(frame.encode())
        if engine.kind == "vllm":
            return {"update_info": {"frame": json.loads(frame.encode())}}
        # one payload per TP rank, each pickled on its own: torch counts one reference per pickle, released by the
        # one unpickle of it (a payload unpickled twice would release the trainer's own reference)
        body: dict[str, Any] = {
            "serialized_named_tensors": [sglang_payload(view, layout) for _ in range(engine.tp_size)],
            "load_format": "flattened_bucket",
            "flush_cache": frame.last,
        }
        if frame.last:
            body["weight_version"] = str(frame.weight_version)
        return body

    async def update(
        self, state: Mapping[str, torch.Tensor], engines: Sequence[ColocatedEngine], weight_version: int
    ) -> ColocatedReport:
        """One update into `engines`: pause, begin, every bucket by handle, end, continue. An engine that fails
        is left out of the rest of the update and named in the report's `failed` (and the error raised at the
        end, `ColocatedEngineFailed`); the others complete."""
        started = time.perf_counter()
        report = ColocatedReport()
        layouts = self.plan(state)
        pool = self.pool(max((lay.total_bytes for lay in layouts), default=1))
        await self._session(engines, "/pause_generation", {"mode": "retract"})
        await self._session(engines, "/begin_weight_update", {})
        for k, layout in enumerate(layouts):
            slot_k = k % BucketPool.SLOTS
            slot = pool.slots[slot_k]
            t0 = time.perf_counter()
            tensors = {spec.name: state[spec.name].detach().to(self.device) for spec in layout.specs}
            view = await asyncio.to_thread(pack_into, slot.tensor, layout, tensors)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            report.pack_seconds += time.perf_counter() - t0
            last = k == len(layouts) - 1
            kind = "shm" if slot.shm is not None else "cuda"
            frame = frame_for(kind, slot_k, slot.generation, layout, weight_version, last, slot.shm, slot.cuda)
            t0 = time.perf_counter()
            held = await self._deliver(engines, frame, view, layout)
            report.load_seconds += time.perf_counter() - t0
            if held:  # an engine may still hold this bucket: it gets no more of the trainer's memory
                pool.drop(slot_k)
                report.dropped_buckets += 1
            report.bytes += layout.payload_bytes
            report.buckets += 1
        await self._session(engines, "/end_weight_update", {}, weight_version)
        await self._session(engines, "/continue_generation", {})
        report.total_seconds = time.perf_counter() - started
        report.failed = {e.node_id: e.failed for e in engines if e.failed is not None}
        if report.failed:
            raise ColocatedEngineFailed(
                f"colocated update v{weight_version} failed on {'; '.join(report.failed.values())}"
            )
        return report

    async def _deliver(
        self, engines: Sequence[ColocatedEngine], frame: IpcFrame, view: torch.Tensor, layout: FusionLayout
    ) -> bool:
        """Send one bucket to every live engine; True when one did not answer within the deadline (it may
        still hold the bucket)."""
        held = False

        async def one(engine: ColocatedEngine) -> None:
            nonlocal held
            path = {"dcs": FRAME_ROUTE, "vllm": VLLM_ROUTE}.get(engine.kind, SGLANG_ROUTE)
            try:
                await self._call(engine, path, self._body(engine, frame, view, layout), self.release_seconds)
            except ColocatedEngineFailed as exc:
                engine.failed = str(exc)
                held = True  # a refusal may come after the engine opened the handle: treat it as held

        await asyncio.gather(*(one(e) for e in engines if e.failed is None))
        return held


# --- the trainer's colocated part of a rollout update ---------------------------------------------------------


class ColocatedUpdater:
    """The colocated part of a rollout update: reads the topology, takes the engines colocated with this trainer
    rank and device (`is_colocated`), learns each one's protocol once (`GET /server_info`: a `dcs receiver` says
    `launch_command: "dcs receiver"`; SGLang's version gives sessions and pause mode; an engine registered as
    vLLM (`metadata["engine"]`) is probed as vLLM, its backend "dcs-ipc") and pushes by handle.
    The remote engines of the same update go through the process group as before (`RolloutUpdater` leaves out
    what `is_colocated` takes)."""

    def __init__(
        self,
        api: Any,
        rollout_role: str,
        trainer_rank: int,
        device: torch.device,
        bucket_size_bytes: int,
        token: str | None,
        timeout_seconds: float,
    ) -> None:
        self.api = api
        self.rollout_role = rollout_role
        self.trainer_rank = trainer_rank
        self.device = device
        self.token = token
        self.http = EngineHTTP(auth_headers(token))
        self.sender = ColocatedSender(device, bucket_size_bytes, self.http, timeout_seconds, timeout_seconds)
        self.timeout_seconds = timeout_seconds
        self._known: dict[tuple[str, str], ColocatedEngine] = {}  # (node id, instance) -> engine facts
        self.last_version = 0
        self._seen: dict[int, Any] | None = None  # rank -> colocated node, from this update's topology reads

    def takes(self, node: Any) -> bool:
        """Whether `node` (a rollout registration) is this trainer's to update by handle. The nodes the remote
        updater's topology reads ask about are kept for this update: no second read of the topology."""
        taken = is_colocated(node.metadata, f"rollout_{node.rank}", self.trainer_rank, self.device)
        if self._seen is None:
            self._seen = {}
        if taken:
            self._seen[node.rank] = node
        else:
            self._seen.pop(node.rank, None)
        return taken

    def begin(self) -> None:
        """A new update starts: forget the nodes an earlier one listed (it may have failed before using them)."""
        self._seen = None

    async def engines(self) -> list[ColocatedEngine]:
        seen, self._seen = self._seen, None
        if seen is None:  # the remote updater read no topology in this update: read it here
            topology = await self.api.topology(self.rollout_role)
            seen = {n.rank: n for n in topology.nodes.get(self.rollout_role, {}).values() if self.takes(n)}
            self._seen = None
        out: list[ColocatedEngine] = []
        for node in sorted(seen.values(), key=lambda n: n.rank or 0):
            node_id = f"rollout_{node.rank}"
            key = (node_id, str(node.metadata.get("instance", "")))
            known = self._known.get(key)
            if known is None:
                url = f"http://{node.ip}:{node.port}"
                if node.metadata.get("engine") == "vllm":
                    known = await self._learn_vllm(node_id, url, int(node.rank))
                else:
                    known = await self._learn(node_id, url)
                self._known[key] = known
            out.append(ColocatedEngine(known.node_id, known.url, known.kind, known.tp_size, known.sessions,
                                       known.pause_mode))  # fmt: skip
        return out

    async def _learn(self, node_id: str, url: str) -> ColocatedEngine:
        try:
            answer = await self.http.request("GET", url + "/server_info", self.timeout_seconds)
            payload = answer.json() if answer.is_success else None
        except (EngineHTTPError, ValueError) as exc:
            raise ColocatedEngineFailed(f"{node_id} at {url}: /server_info: {exc}") from None
        if isinstance(payload, dict) and payload.get("launch_command") == "dcs receiver":
            return ColocatedEngine(node_id, url, "dcs")
        host, _, port = url.removeprefix("http://").rpartition(":")
        rank = int(node_id.rsplit("_", 1)[1])
        info = engine_info(EngineEndpoint(rank=rank, ip=host, port=int(port)), payload)
        if self.device.type == "cuda" and info.tp_size > 1:
            raise ColocatedEngineFailed(
                f"{node_id} at {url} runs with tp_size={info.tp_size}: a colocated engine shares one device with "
                "its trainer rank (TP 1); register TP engines without `colocated`"
            )
        return ColocatedEngine(node_id, url, "sglang", info.tp_size, info.sessions, info.pause_mode)

    async def _learn_vllm(self, node_id: str, url: str, rank: int) -> ColocatedEngine:
        """A vLLM engine (registered with `--kind vllm`): its version, world size and weight-transfer backend, as
        the remote updater probes it, but the backend must be the plugin's "dcs-ipc" (`VLLMBackendMismatch`
        saying what to start `vllm serve` with otherwise)."""
        from dcs_tasks.sync.engine_protocol import EngineAPI

        host, _, port = url.removeprefix("http://").rpartition(":")
        endpoint = EngineEndpoint(rank=rank, ip=host, port=int(port), kind="vllm")
        api = EngineAPI(self.token, self.timeout_seconds)
        try:
            info = await api.probe(endpoint, self.timeout_seconds, colocated=True)
        finally:
            await api.aclose()
        if self.device.type == "cuda" and info.tp_size > 1:
            raise ColocatedEngineFailed(
                f"{node_id} at {url} runs with world size {info.tp_size}: a colocated engine shares one device with "
                "its trainer rank (TP 1); register TP engines without `colocated`"
            )
        return ColocatedEngine(node_id, url, "vllm", info.tp_size, True, info.pause_mode)

    async def update(self, state: Mapping[str, torch.Tensor], weight_version: int) -> ColocatedReport | None:
        """Push `state` as `weight_version` into this trainer's colocated engines; None when it has none."""
        engines = await self.engines()
        if not engines:
            return None
        return await self.sender.update(state, engines, weight_version)

    async def aclose(self) -> None:
        await self.http.aclose()

    @classmethod
    def beside(cls, rollout: Any, trainer_rank: int, device: torch.device, token: str | None) -> ColocatedUpdater:
        """The colocated updater of a trainer whose remote engines `rollout` (a `RolloutUpdater`) updates: same
        coordinator, role, bucket size and timeout; `rollout` leaves out the engines this one takes."""
        updater = cls(
            rollout.api,
            rollout.rollout_role,
            trainer_rank,
            device,
            rollout.sender.bucket_size_bytes,
            token,
            rollout.engines._timeout,
        )
        rollout.is_colocated = updater.takes
        return updater

    async def update_after(self, rollout: Any, state: Mapping[str, torch.Tensor]) -> Any:
        """The colocated part of the update `rollout` just made (the same version; the next one when it had no
        remote engine, which `rollout` then counts as its own); an `UpdateReport`, or None without colocated
        engines."""
        from dcs_tasks.sync.sender import RolloutDetails, SendReport, UpdateReport

        engines = await self.engines()
        if not engines:
            return None
        version = rollout.weight_version if rollout.weight_version > self.last_version else rollout.weight_version + 1
        r = await self.sender.update(state, engines, version)
        self.last_version = version
        rollout.weight_version = version
        sent = SendReport("fused", r.bytes, len(state), r.buckets, 0, r.pack_seconds, r.load_seconds, r.total_seconds)
        details = RolloutDetails(engines=len(engines), weight_version=version, total_seconds=r.total_seconds,
                                 phases={"dropped_buckets": r.dropped_buckets})  # fmt: skip
        return UpdateReport(sent, details)
