"""`WeightReceiver`: joins an update group, receives buckets into a staging area, swaps atomically.

Contract: `weights` and `weight_version` change only in `commit()`, and only when every bucket of the
staged update arrived intact; a failed or abandoned update leaves the previous weights and version
untouched (no partial update). Buckets arrive either flattened (one uint8 broadcast laid out by
`FusionLayout.from_wire`) or one broadcast per tensor (SGLang's default wire format).

Groups change only through `init_group`, which forms the new group first, outside the lock guarding the
current one, and swaps it in only once formed: a failed init leaves the current group, staging, weights and
version as they were. One init runs at a time; another is refused (`RequestRejected`) after a bounded wait.

Flat receive buffers are recycled: version v's buffers receive version v+2, so steady-state updates
touch no fresh memory. Tensors of `weights` therefore stay valid until the second commit after theirs;
copy what must outlive that (ActorFwdReceiver copies into its model at commit).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dcs_tasks.backends.base import CommBackend, GroupSpec
from dcs_tasks.backends.fusion import ALIGNMENT, FusionLayout, unpack_views
from dcs_tasks.errors import RequestRejected, WeightSyncError
from dcs_tasks.sync.receive_checks import check_group_spec, check_tensors
from dcs_tasks.tensors import parse_dtype

log = logging.getLogger(__name__)

BucketMeta = tuple[Sequence[str], Sequence[str], Sequence[Sequence[int]]]  # names, dtypes, shapes of one bucket


@dataclass(frozen=True)
class _Targets:
    """What one announced bucket is received into, and how to read the named tensors back."""

    tensors: list[torch.Tensor]
    result: Callable[[], dict[str, torch.Tensor]]


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 hex of a tensor's raw bytes (C-contiguous, native byte order)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


class WeightReceiver:
    """Holds named tensors received from rank 0 of an update group. Thread-safe; one update at a time."""

    def __init__(
        self,
        backend: CommBackend,
        device: torch.device | None = None,
        max_update_bytes: int | None = None,
        init_wait_seconds: float = 0.0,
    ) -> None:
        self.backend = backend
        self.max_update_bytes = max_update_bytes  # tensor bytes one staged update may hold (None: unbounded)
        self.init_wait_seconds = init_wait_seconds  # how long an init waits for the one in flight
        self.device = device or torch.device("cpu")
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        self.group_name: str | None = None
        self._staging: dict[str, torch.Tensor] = {}
        self._staged_buffers: list[torch.Tensor] = []  # flat buffers backing `_staging`
        self._committed_buffers: list[torch.Tensor] = []  # flat buffers backing `weights`
        self._spare: list[torch.Tensor] = []  # free, already page-faulted buffers (the previous version's)
        self._staging_version: int | None = None
        self._staging_named = False  # whether a bucket of the staged update named its version
        self._staging_failed = False
        self._staged_bytes = 0  # tensor bytes announced by the buckets of the staged update
        self._epoch = 0  # bumped whenever staging is dropped; a bucket received across a bump is discarded
        self._lock = threading.RLock()  # guards groups and staging; never held while a collective waits
        self._state_lock = threading.Lock()  # guards the committed (weights, version) pair
        self._init_lock = threading.Lock()  # one group init at a time
        self._init_pending: str | None = None  # the group an init in flight is forming

    def init_group(self, spec: GroupSpec) -> None:
        """Form `spec`'s group, then swap it in for the current one (dropping any staged update). The group
        forms outside `_lock`, so digests and updates on the current group go on meanwhile; a failed init
        (GroupInitError) leaves everything as it was. RequestRejected for an implausible `spec`, when another
        init is still in flight after `init_wait_seconds`, or when `spec` names the group already held."""
        check_group_spec(spec)
        wait = self.init_wait_seconds
        if not (self._init_lock.acquire(timeout=wait) if wait > 0 else self._init_lock.acquire(blocking=False)):
            raise RequestRejected(
                f"another init_weights_update_group (group {self._init_pending!r}) is still in flight; retry later"
            )
        try:
            with self._lock:
                if spec.group_name == self.group_name:
                    raise RequestRejected(f"already a member of group {spec.group_name!r}; destroy it first")
            self._init_pending = spec.group_name
            self.backend.create_group(spec)
            with self._lock:
                previous, self.group_name = self.group_name, spec.group_name
                self.abort()
            if previous is not None:
                self.backend.destroy_group(previous)
        finally:
            self._init_pending = None
            self._init_lock.release()

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            self.backend.destroy_group(group_name)
            if self.group_name == group_name:
                self.group_name = None

    def receive_bucket(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: int | None,
        flattened: bool,
        alignment: int = ALIGNMENT,
    ) -> int:
        """Receive one bucket of update `weight_version` into staging (see `receive_buckets`)."""
        return self.receive_buckets([(names, dtypes, shapes)], group_name, weight_version, flattened, alignment)

    def receive_buckets(
        self,
        buckets: Sequence[BucketMeta],
        group_name: str,
        weight_version: int | None,
        flattened: bool,
        alignment: int = ALIGNMENT,
    ) -> int:
        """Receive consecutive buckets (each one flat broadcast, or one broadcast per tensor) into staging. Every
        receive is posted before the first wait, so the sender never stalls between buckets. Returns the
        version staged; raises WeightSyncError.

        `weight_version=None` (SGLang's senders name the version on the last bucket only) joins the update
        being staged, or starts one at the committed version + 1; a versioned bucket then names that update.

        The lock is not held while the collectives wait, so a replacement group (`init_group`) can form
        while a bucket of an abandoned update is still stuck waiting for its sender.
        """
        nbytes = sum(check_tensors(*bucket, self.max_update_bytes) for bucket in buckets)
        if not self.backend.has_group(group_name):
            raise RequestRejected(f"not a member of group {group_name!r} (init_weights_update_group first)")
        with self._lock:
            weight_version = self._start_staging(weight_version)
            self._reserve(nbytes, weight_version)
            epoch = self._epoch
            targets = [self._targets(bucket, flattened, alignment) for bucket in buckets]
        try:
            received = self._recv_all(targets, group_name, weight_version)
        except Exception:
            with self._lock:
                if self._epoch == epoch:
                    self._staging_failed = True
            raise
        with self._lock:
            if self._epoch != epoch:
                raise WeightSyncError(
                    f"bucket of v{weight_version} from {group_name!r} arrived after its update was abandoned; dropped"
                )
            self._staging.update(received)
        return weight_version

    def _reserve(self, nbytes: int, weight_version: int) -> None:
        """Count `nbytes` more into the staged update; RequestRejected (nothing allocated) past the limit."""
        limit = self.max_update_bytes
        if limit is not None and self._staged_bytes + nbytes > limit:
            raise RequestRejected(
                f"update v{weight_version} would hold {self._staged_bytes + nbytes} bytes, over the limit of "
                f"{limit} (receiver_max_update_bytes); refused before allocating"
            )
        self._staged_bytes += nbytes

    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat receive buffer: the next spare one if big enough (no page faults), else a new one."""
        if self._spare and self._spare[0].numel() >= nbytes:
            buffer = self._spare.pop(0)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._staged_buffers.append(buffer)
        return buffer

    def _targets(self, bucket: BucketMeta, flattened: bool, alignment: int = ALIGNMENT) -> _Targets:
        names, dtypes, shapes = bucket
        if flattened:  # `alignment`: ALIGNMENT (DCS senders) or SGLANG_ALIGNMENT (SGLang's flattened_bucket)
            layout = FusionLayout.from_wire(names, dtypes, shapes, alignment)
            view = self._take_buffer(layout.total_bytes)[: layout.wire_bytes]
            return _Targets([view], lambda: unpack_views(view, layout))
        tensors = {
            n: torch.empty(tuple(s), dtype=parse_dtype(d), device=self.device)
            for n, d, s in zip(names, dtypes, shapes, strict=True)
        }
        return _Targets(list(tensors.values()), lambda: tensors)

    def _recv_all(self, targets: list[_Targets], group_name: str, version: int) -> dict[str, torch.Tensor]:
        handles = [[self.backend.broadcast_async(t, 0, group_name) for t in target.tensors] for target in targets]
        out: dict[str, torch.Tensor] = {}
        for index, (target, posted) in enumerate(zip(targets, handles, strict=True)):
            for handle in posted:
                handle.wait()
            received = target.result()
            out.update(received)
            log.info("bucket %d/%d of v%d received (%d tensors)", index + 1, len(targets), version, len(received))
        return out

    def _start_staging(self, weight_version: int | None) -> int:
        staging = self._staging_version
        if weight_version is None:  # an unversioned bucket belongs to the update being staged
            if staging is not None:
                return staging
            self.abort()
            self._staging_version, self._staging_named = self.weight_version + 1, False
            return self._staging_version
        if staging is not None and not self._staging_named and not self._staging_failed:
            self._staging_version, self._staging_named = weight_version, True  # its first buckets were unversioned
            return weight_version
        if staging != weight_version:
            if staging is not None:
                log.warning("abandoning incomplete update v%s for v%s", staging, weight_version)
            self.abort()
            self._staging_version, self._staging_named = weight_version, True
        return weight_version

    def commit(self, weight_version: int) -> None:
        """Swap the staged update in. Raises WeightSyncError if it is incomplete or failed."""
        with self._lock:
            if self._staging_version != weight_version or self._staging_failed:
                raise WeightSyncError(
                    f"update v{weight_version} is incomplete or failed here (staged: v{self._staging_version}, "
                    f"failed: {self._staging_failed}); keeping v{self.weight_version}"
                )
            with self._state_lock:
                self.weights = self._staging
                self.weight_version = weight_version
            self._spare, self._committed_buffers = self._committed_buffers, self._staged_buffers
            self._staged_buffers = []
            self._staging = {}
            self._staging_version = None
            self._staged_bytes = 0

    def abort(self) -> None:
        """Drop whatever is staged."""
        with self._lock:
            self._epoch += 1
            self._staging = {}
            self._staged_buffers = []  # not recycled: an abandoned collective may still write into them
            self._staging_version = None
            self._staging_failed = False
            self._staged_bytes = 0

    def digest(self) -> tuple[int, dict[str, str]]:
        """(committed version, sha256 hex per tensor); never waits for an update in flight."""
        with self._state_lock:
            weights, version = self.weights, self.weight_version
        return version, {name: tensor_sha256(t) for name, t in weights.items()}
