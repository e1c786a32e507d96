"""One error tree. Every error names what failed and, where it helps, what to do about it."""

from __future__ import annotations


class DCSError(Exception):
    """Root of every error DCS raises on purpose."""


class ConfigError(DCSError, ValueError):
    """A setting is missing or invalid."""


class InvalidStorageURL(ConfigError):
    """A storage root (`DCS_CHECKPOINT_DIR`, `DCS_REPLICA_DIR`, `--dir`) looks like a URL but is not exactly
    `s3://bucket[/prefix]` or `file:///absolute/path` (`s3:/bucket`, `s3//bucket`, `S3://...`, `gs://...`): it is
    refused instead of being read as a local folder. A local folder whose name holds a colon is written `./name`."""


class SettingsMismatch(ConfigError):
    """The trainer's settings and those of the `dcs worker` serving its host disagree on where or how checkpoints
    are written (checkpoint root, store, memory tier): saves would fail on the worker or silently differ. The
    message names each setting, both values and which process to change."""


class PreflightFailed(DCSError):
    """A start-up check found a setting the host cannot honour (memory tier bigger than its directory's file
    system, a checkpoint root that cannot be written, an object store that refuses the credentials or has no such
    bucket). The message names the setting and how to fix it."""


class UnsafeHostDirectory(DCSError):
    """A host-local directory or socket DCS would use (the private runtime directory, staging, the memory tier,
    the host agent's socket) is not private to this user: a symlink, not a directory, owned by another uid, or
    open to group/other. Nothing is used, changed or given way to; the message names the path, what is wrong and
    how to fix it (remove it, or point the setting elsewhere). `dcs_tasks/hostdirs.py`."""


class HostBusy(DCSError):
    """`dcs clean` found a running `dcs worker`, `dcs up` or `dcs demo` of this user on the directories it would
    clean (a worker may still read a gone trainer's last staging file): nothing is removed. The message names each
    process; stop them, then run `dcs clean` again."""


class InstallationError(DCSError):
    """DCS as installed cannot run: a file of its package is missing (a `.lua` script left out of a wheel) or a
    dependency lacks what DCS relies on. Raised when the module that needs it is imported; the message names
    what is missing and what to install."""


class TorchInternalsMissing(InstallationError):
    """The installed torch lacks a private `torch.distributed` internal that DCS's process groups use
    (`dcs_tasks/backends/process_group.py`): raised when that module is imported, naming the torch version and
    the missing attribute, instead of a bare AttributeError at the first weight update."""


class DCSTimeoutError(DCSError, TimeoutError):
    """A bounded wait ran out (group init, broadcast, long-poll, task result, worker presence)."""


# --- control plane ------------------------------------------------------------------------------
class CoordinatorError(DCSError):
    """The coordinator answered with an error status."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached, or it could not reach Redis (503)."""


class ClientClosed(CoordinatorError):
    """The `CoordinatorAPI` was closed: no request can be sent through it any more."""


class NodeNotFound(CoordinatorError):
    """A (role, rank) is not registered or not alive."""


class AuthError(CoordinatorError):
    """The coordinator refused the bearer token (401)."""


class RankConflict(CoordinatorError):
    """The rank is now held by another node (409): this node was presumed dead and replaced; re-register."""


# --- tensors (both paths) ------------------------------------------------------------------------
class InvalidTensorSpec(DCSError, ValueError):
    """A tensor's description (name, dtype, shape, size) is inconsistent; the message names the tensor."""


class UnsupportedDtype(InvalidTensorSpec):
    """A tensor's dtype cannot travel this path: not in DCS's dtype table at all, or (complex128) not storable
    in a safetensors checkpoint. The message names the tensor and the dtype; `dcs_tasks/tensors.py` has the
    table of what each path carries."""


# --- checkpoints --------------------------------------------------------------------------------
class CheckpointError(DCSError):
    """Base for checkpoint save/restore failures."""


class CheckpointFailed(CheckpointError):
    """A save did not commit; the message carries the worker's reason."""


class SaveFailed(CheckpointFailed):
    """An earlier save of this checkpointer failed for a reason retrying will not fix (an untrusted path, refused
    credentials, a full disk): raised by the next `save()` or by `close()` under `save_failure_policy` "raise".
    The message names each step and the worker's reason; `step` and `error_type` are the first one's, `steps` all
    of them."""

    def __init__(self, message: str, *, step: int = -1, error_type: str = "", steps: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.error_type = error_type
        self.steps = steps or ((step,) if step >= 0 else ())

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_save_failed, (str(self), self.step, self.error_type, self.steps))


def _rebuild_save_failed(message: str, step: int, error_type: str, steps: tuple[int, ...]) -> SaveFailed:
    return SaveFailed(message, step=step, error_type=error_type, steps=steps)


class RunNameTaken(CheckpointError):
    """A save's step is recorded as committed in Redis for this run name, but not under this checkpoint root:
    the name was used before with another `checkpoint_dir` (or its files were removed). Use a new run name or
    `DCS_NAMESPACE` to start fresh, or the old root to continue."""


class CheckpointNotFound(CheckpointError):
    """No committed (or no verifying) checkpoint matches the request."""


class CorruptCheckpoint(CheckpointError):
    """A file of a committed checkpoint is missing, truncated or fails its checksum."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class CorruptLedger(CheckpointError):
    """A checkpoint step's Redis ledger record holds a value DCS never writes there (edited by hand or damaged);
    the message names the step, the key and the field. Other steps' records are not affected."""


class StateMismatch(CheckpointError):
    """`restore(into=...)` found a tensor whose shape, dtype or presence differs."""


class NoWorkerError(CheckpointError):
    """No live `dcs worker` consumes the queue a task must go to."""


class StagingError(CheckpointError):
    """The shared-memory staging pool cannot take the state (too big, closed, busy under policy skip)."""


class ReplicaFailed(CheckpointError):
    """Copying a committed step to the replica root (`replica_dir`) failed: the root is not writable, the
    primary step is gone or does not match its checksums, or the copy does not verify. Only the replica
    task fails; the primary commit and the trainer's save are unaffected."""


class PeerError(CheckpointError):
    """Copying a step between hosts' memory tiers (`dcs_tasks.checkpoint.store.peers.transfer`) failed; the
    message names the peer, the step (`<run>/[rank-N/]step-N`) and what went wrong. Nothing was installed: a partial
    copy is removed and a step already committed at the target is never replaced."""


class PeerRefused(PeerError):
    """The peer refused the request: a bad step name, a step or manifest over its limits, a manifest the memory
    tier does not take (compressed or incremental files), no room. Retrying the same request will not help."""


class PeerAuthFailed(PeerRefused):
    """The shared token did not match: the peer refused ours, or the peer could not prove it knows it (a server
    that answers the challenge wrongly is never sent anything)."""


class PeerCorrupt(PeerError):
    """The peer sent bytes that do not verify: a file whose size or checksum differs from its manifest, a manifest
    that fails the checks, a malformed or oversized header, a frame failing its MAC, bytes beyond those announced."""


class PeerNotFound(PeerError):
    """The peer holds no committed step under that name."""


class PeerUnavailable(PeerError, ConnectionError):
    """The peer could not be reached, closed the connection mid-transfer, did not answer within the timeout or
    had no connection slot free: worth retrying (later, or on another peer)."""


class StorageError(CheckpointError):
    """The checkpoint store (a file system or an object store) refused or failed an operation; the message names
    the store, the object and the operation, never a credential."""


class StorageAccessDenied(StorageError):
    """The object store refused the credentials or the operation (S3 `AccessDenied`, `InvalidAccessKeyId`,
    `SignatureDoesNotMatch`): check the AWS credentials and the bucket's policy. Never retried."""


class StorageFull(StorageError):
    """The store has no room for the object (S3 `QuotaExceeded`/`EntityTooLarge`, or ENOSPC): the step fails,
    earlier committed steps are untouched."""


class StorageNotFound(StorageError):
    """The bucket (or the root) does not exist."""


class StorageUnavailable(StorageError, ConnectionError):
    """The store could not be reached or kept failing (connection refused, timeouts, 5xx and throttling after
    the client's retries): retried like any connection error."""


class InvalidTaskPayload(CheckpointError, ValueError):
    """A checkpoint task's JSON payload is malformed (bad run name, step, file name or path). A worker
    fails such a task at once and never retries it."""


class UntrustedPath(InvalidTaskPayload):
    """A checkpoint task names a path outside the worker's configured checkpoint root or staging directory
    (or one reached through a symlink that leaves them); the worker refuses it without touching it."""


# --- weight sync --------------------------------------------------------------------------------
class WeightSyncError(DCSError):
    """A weight update failed; `member` names the node that failed, when known."""

    def __init__(self, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member


class GroupInitError(WeightSyncError):
    """A process group could not be formed within its timeout after retries."""


class PortAllocationError(WeightSyncError):
    """No free master port in the configured range on the host."""


class LoopbackAddressError(GroupInitError, ConfigError):
    """A group's master address is loopback while a member is on another host: raised before any join is sent
    (the member could never connect). `member` names that node; advertise a routable address instead."""


class RequestRejected(WeightSyncError):
    """A receiver refused a weight-sync request before acting on it (bad dtype, shape, name or address, over a
    size limit, wrong group, another group init in flight); nothing was allocated or changed."""


class WeightMetaVersionError(WeightSyncError):
    """An actor_fwd / reference receiver met a weight-meta entry of its groups it must not take: one without a
    version (written by a DCS release before versioned entries: upgrade the actors), or one more than
    `MAX_VERSIONS_AHEAD` updates past the update being received (a stage ran that far ahead). The update in
    assembly is dropped; the previous weights and version stay."""


class EngineIncompatible(WeightSyncError):
    """A rollout engine cannot take DCS's distributed weight updates: it is not an SGLang version DCS supports
    (docs/weight_sync.md lists them), or it runs with dp_size > 1 or pp_size > 1. Refused before any group
    forms; `member` names the engine."""


class EngineAuthRefused(WeightSyncError):
    """A rollout engine refused DCS's API key (401/403): start it with `--api-key` equal to DCS_AUTH_TOKEN."""


class BackendUnavailable(WeightSyncError, ConfigError):
    """The weight-sync transport cannot run in this process: NCCL where torch sees no CUDA device (or was built
    without NCCL), a CUDA device id this host does not have, or a backend DCS does not broadcast over (gloo and
    nccl only). Raised by the client before it registers or asks any engine to join, and never retried."""


class SyncPreconditionError(WeightSyncError, ConfigError):
    """A weight sync cannot start because of how a node was set up (e.g. an actor registered without metadata
    `is_pp_src_rank=True`, so no pp stage has a group to send in); the message says exactly what to set."""


class ActorWaitTimeout(DCSTimeoutError):
    """An actor_fwd / reference waited its bound (`init_process_groups_for_actor_fwd_ref(wait_timeout_s=...)`,
    default `group_init_timeout_seconds`) for the source actor of every pp stage to register, and the message
    names the stages still missing."""


class UnsupportedEngineVersion(EngineIncompatible):
    """A rollout engine runs an SGLang or vLLM version DCS does not support (docs/weight_sync.md names the
    supported ones); the message names the engine, its version and the supported list."""


class VLLMBackendMismatch(EngineIncompatible):
    """A vLLM engine runs with a weight-transfer backend other than DCS's plugin (`--weight-transfer-config`
    absent, or vLLM's own `nccl`, ...): read from its dev-mode `/server_info` before any join. The message says
    what to install and start `vllm serve` with."""


class VLLMDevModeOff(EngineIncompatible):
    """A vLLM engine does not serve its RL weight-transfer API (`/get_world_size`, `/pause`,
    `/init_weight_transfer_engine`, ... answer 404): start `vllm serve` with `VLLM_SERVER_DEV_MODE=1` and a
    `--weight-transfer-config`."""
