"""vLLM general plugin: registers DCS's weight-transfer engine as backend "dcs".

vLLM loads every `vllm.general_plugins` entry point in its API server, its engine core and each worker process
(vllm/plugins/__init__.py, `load_general_plugins`), possibly more than once per process; `register` is
idempotent. The engine module (and vLLM's weight-transfer code it builds on) is imported only when a worker
creates the engine (`WeightTransferEngineFactory`'s lazy registration), so loading the plugin costs nothing
in processes that never transfer weights.

    pip install plugins/vllm-dcs            # into the environment vLLM runs in
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "dcs"}'
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "dcs-ipc"}'   # colocated
"""

from __future__ import annotations

BACKEND = "dcs"
"""The name `--weight-transfer-config '{"backend": "dcs"}'` selects."""
ENGINE_MODULE = "vllm_dcs.engine"
ENGINE_CLASS = "DCSWeightTransferEngine"
IPC_BACKEND = "dcs-ipc"
"""The dcs backend's colocated transport (trainer on the same host and device): buckets by handle, no group."""
IPC_ENGINE_CLASS = "DCSIpcWeightTransferEngine"


def register() -> None:
    """Register backend "dcs" with vLLM's `WeightTransferEngineFactory`, once per process: vLLM's
    `register_engine` raises ValueError for a name already registered, which a second load of the plugin (or
    another registration of the same name) is, so that one is taken as done."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((BACKEND, ENGINE_CLASS), (IPC_BACKEND, IPC_ENGINE_CLASS)):
        try:
            WeightTransferEngineFactory.register_engine(name, ENGINE_MODULE, cls)
        except ValueError as exc:
            if "already registered" not in str(exc):
                raise


__all__ = ["BACKEND", "IPC_BACKEND", "register"]
