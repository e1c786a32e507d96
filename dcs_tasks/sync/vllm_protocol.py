"""The trainer's side of vLLM's RL weight-transfer HTTP API (dev mode), by vLLM version.

Supported: vLLM 0.33.0 (vllm/entrypoints/rl/online/api_router.py, v1/engine/async_llm.py, v1/worker/gpu_worker.py
and distributed/weight_transfer/ of that release were read against what DCS sends, and run in CI on CPU:
tests/vllm_engine/); any other version is refused with `UnsupportedEngineVersion` before a group forms. The RL
routes exist only when the server runs with `VLLM_SERVER_DEV_MODE=1`; without it `/get_world_size` is a 404 and
DCS raises `VLLMDevModeOff` saying what to turn on.

What DCS calls, per engine (the HTTP `EngineAPI` of `engine_protocol`: kept-alive connections, bounded answers):


| when | call | vLLM's answer |
- group formation: `GET /version` -> `{"version"}`, `GET /get_world_size` (TP * PP * DP) -> `{"world_size"}`,
  `GET /server_info?config_format=json` -> `vllm_config.weight_transfer_config.backend`, which must be "dcs"
  (DCS's plugin, plugins/vllm-dcs: `VLLMBackendMismatch` otherwise, saying what to start `vllm serve` with)
- join (Celery `dcs.sync.join_engine`): `POST /init_weight_transfer_engine {"init_info": {...}}`, answered
  once every worker joined; `transport` is the trainer's backend ("gloo" or "nccl"): the plugin's workers join
  the trainer's torch.distributed group, the one SGLang engines and `dcs receiver`s join
- each update: `POST /pause?mode=abort`, `POST /start_weight_update`; per bucket `POST /update_weights
  {"update_info": {"names", "dtype_names", "shapes"}}` (answered once loaded); `POST /finish_weight_update
  {"weight_version": "N"}`, `POST /resume`
- version read: `GET /weight_info` -> `{"weight_version"}` ("default" before any update)
- teardown: none. `/shutdown_weight_transfer_engine` names no group, and DCS's teardown task runs after the
  trainer moved on, so it could drop a group formed since; the next join replaces the engine's group

The engine's rank span is its `/get_world_size` (every worker of every TP/PP/DP rank joins, at
rank_offset + dp_rank * TP * PP + rank, vLLM's `_worker_group_rank`). Each bucket is one packed broadcast:
`packed=True` with a buffer size no bucket reaches, so vLLM's packed consumer takes a request's tensors as one
chunk (raw bytes back to back, in the request's order: vLLM's `unpack_tensor`), exactly SGLang's flattened layout.
vLLM's `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`: the RL routes take no key (DCS sends
its token anyway); keep a dev-mode server's port on a trusted network.
"""

from __future__ import annotations

from typing import Any

from packaging.version import InvalidVersion, Version

from dcs_tasks.config import BackendType
from dcs_tasks.errors import EngineIncompatible, UnsupportedEngineVersion, VLLMBackendMismatch, VLLMDevModeOff
from dcs_tasks.sync.wire import EngineEndpoint, EngineInfo

SUPPORTED_VLLM_VERSIONS = ("0.33.0",)
VLLM_PAUSE_MODE = "abort"
"""`/pause` mode: in-flight requests are aborted (their clients get an aborted answer), new ones get 503 until
`/resume`; vLLM's default and what TRL's client uses."""
PACKED_BUFFER_BYTES = 1 << 40
"""`packed_buffer_size_bytes` sent at join: above any bucket, so one update request = one packed broadcast."""
PACKED_NUM_BUFFERS = 2
MAX_VERSION_CHARS = 64
MAX_WORLD_SIZE = 4096
PLUGIN_BACKEND = "dcs"
"""The weight-transfer backend DCS's vLLM plugin registers (plugins/vllm-dcs, entry point `vllm.general_plugins`)."""
IPC_BACKEND = "dcs-ipc"
"""The plugin's colocated transport (buckets by handle in DCS's JSON frame, no group): a backend name of its own,
as vLLM's `WeightTransferConfig` takes nothing but `backend`, so `/server_info` shows it."""
SERVER_INFO_PATH = "/server_info?config_format=json"
SERVER_INFO_TIMEOUT_SECONDS = 60.0
"""Bound of the `/server_info` read (at least the probe's own): vLLM builds its `system_env` part (collect_env,
which runs subprocesses) on the first call, 8 s on the CI machine, and caches it for later calls."""
BACKEND_HINT = (
    "install DCS's vLLM plugin into the engine's environment (`pip install plugins/vllm-dcs` from a DCS checkout) "
    "and start it as `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config "
    '\'{"backend": "dcs"}\'` (docs/weight_sync.md, vLLM engines)'
)
DEV_MODE_HINT = (
    "start `vllm serve` with VLLM_SERVER_DEV_MODE=1 in its environment and --weight-transfer-config "
    '\'{"backend": "dcs"}\' (docs/weight_sync.md, vLLM engines)'
)


def vllm_version(engine: EngineEndpoint, payload: Any) -> str:
    """The version of `GET /version`'s answer; EngineIncompatible / UnsupportedEngineVersion naming the engine."""
    node = engine.node_id
    text = payload.get("version") if isinstance(payload, dict) else None
    if not isinstance(text, str) or len(text) > MAX_VERSION_CHARS:
        raise EngineIncompatible(f"{node} at {engine.url}: /version has no vLLM `version`", node)
    try:
        version = str(Version(text))
    except (InvalidVersion, ValueError):
        raise EngineIncompatible(f"{node}: {text!r} is not a vLLM version", node) from None
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedEngineVersion(
            f"{node} at {engine.url} runs vLLM {version}; DCS supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}",
            node,
        )
    return version


def vllm_engine_info(engine: EngineEndpoint, version: str, world_payload: Any) -> EngineInfo:
    """EngineInfo of a vLLM engine from its version and `GET /get_world_size`'s answer."""
    node = engine.node_id
    size = world_payload.get("world_size") if isinstance(world_payload, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_WORLD_SIZE:
        shown = repr(size)[:40]
        raise EngineIncompatible(f"{node}: /get_world_size world_size={shown} is not an integer in 1..4096", node)
    return EngineInfo(
        kind="vllm",
        version=version,
        tp_size=size,
        sessions=True,
        flattened_bucket=True,
        pause=True,
        pause_mode=VLLM_PAUSE_MODE,
    )


def backend_hint(colocated: bool) -> str:
    """What to start `vllm serve` with: backend "dcs" (a remote engine) or "dcs-ipc" (a colocated one)."""
    if not colocated:
        return BACKEND_HINT
    return BACKEND_HINT.replace('{"backend": "dcs"}', '{"backend": "dcs-ipc"}').replace(
        "vLLM engines)", "Colocated engines)"
    )


def check_backend(engine: EngineEndpoint, server_info: Any, colocated: bool = False) -> None:
    """VLLMBackendMismatch naming the engine unless its dev-mode `/server_info` (JSON) says it runs DCS's
    weight-transfer backend with the transport this trainer uses: `vllm_config.weight_transfer_config.backend`
    is "dcs" (a group, remote engines) or, for an engine colocated with the trainer, "dcs-ipc" (by handle).
    Checked before any join or update: a group joined by vLLM's own engine (its `StatelessProcessGroup`
    rendezvous) or by none could only time out, and a "dcs" engine refuses frames."""
    node = engine.node_id
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    if not isinstance(config, dict):
        raise EngineIncompatible(f"{node} at {engine.url}: /server_info has no JSON `vllm_config`", node)
    transfer = config.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    wanted = IPC_BACKEND if colocated else PLUGIN_BACKEND
    if backend == wanted:
        return
    shown = "none (no --weight-transfer-config)" if transfer is None else repr(backend)[:80]
    where = "a colocated engine (updates by handle)" if colocated else "a remote engine (a process group)"
    raise VLLMBackendMismatch(
        f"{node} at {engine.url} runs vLLM with weight-transfer backend {shown}, not {wanted!r} for {where}: "
        f"{backend_hint(colocated)}",
        node,
    )


def dev_mode_off(engine: EngineEndpoint, path: str) -> VLLMDevModeOff:
    return VLLMDevModeOff(
        f"{engine.node_id} at {engine.url} runs vLLM without its RL API ({path} is 404): {DEV_MODE_HINT}",
        engine.node_id,
    )


def init_info(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    timeout: float,
    transport: BackendType = BackendType.GLOO,
) -> dict[str, Any]:
    """The body of `POST /init_weight_transfer_engine`: vLLM's NCCL init-info fields (packed, buffer geometry),
    plus `group_name`, `timeout_seconds` and `transport` (the group's torch.distributed backend) for DCS's plugin
    (plugins/vllm-dcs/vllm_dcs/engine.py)."""
    return {
        "init_info": {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
            "packed_num_buffers": PACKED_NUM_BUFFERS,
            "group_name": group_name,
            "timeout_seconds": timeout,
            "transport": transport.value,
        }
    }


def update_body(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    """The body of `POST /update_weights` for one bucket."""
    return {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}
