"""One vLLM worker per TP rank, in its own process (replaces vLLM's executor and GPU worker process).

The weight methods are vLLM's own `Worker` methods (vllm/v1/worker/gpu_worker.py: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`, `shutdown_weight_transfer_engine`, with their
session checks), bound to this stand-in that holds what they read (`weight_transfer_engine`, the session flags,
`vllm_config`, `rank`). The engine comes from vLLM's `WeightTransferEngineFactory` with the config's backend.
Calls arrive as (method, kwargs) over a multiprocessing pipe from the engine client (`client.py`).
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

WORKER_METHODS = (
    "init_weight_transfer_engine",
    "shutdown_weight_transfer_engine",
    "start_weight_update",
    "_start_weight_update",
    "update_weights",
    "finish_weight_update",
    "_check_weight_transfer_engine",
)


def build_worker(tp_rank: int, tp_size: int, backend: str | None, sink: bool = False) -> Any:
    import torch
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_worker import Worker

    from tests.vllm_engine.tiny_model import SinkModel, TinyModel

    load_general_plugins()  # as vLLM's WorkerWrapperBase does: DCS's engine comes from its installed plugin
    transfer = WeightTransferConfig(backend=backend) if backend else None
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp_size), weight_transfer_config=transfer)
    config.parallel_config.rank = tp_rank

    class _Runner:
        def reset_lora_state(self) -> None:
            pass

    class HarnessWorker:
        def __init__(self) -> None:
            self.vllm_config = config
            self.rank = tp_rank
            self.model = (SinkModel if sink else TinyModel)(tp_rank, tp_size)
            self.model_runner = _Runner()
            self._weight_update_active = False
            self._weight_update_is_draft = False
            self.weight_transfer_engine = (
                WeightTransferEngineFactory.create_engine(transfer, config, torch.device("cpu"), self.model)
                if transfer is not None
                else None
            )

        def get_draft_model(self) -> None:
            return None

        def harness_weights(self) -> dict[str, tuple[str, list[int], bytes]]:
            return {
                name: (str(t.dtype).split(".")[-1], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                for name, t in self.model.local_state().items()
            }

    for name in WORKER_METHODS:
        setattr(HarnessWorker, name, getattr(Worker, name))
    return HarnessWorker()


def main(
    conn: Connection, tp_rank: int, tp_size: int, backend: str | None, sys_path: list[str], sink: bool = False
) -> None:
    import sys

    if sys.path != sys_path:  # spawned (a forked worker has its parent's path already)
        sys.path[:0] = sys_path
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        worker = build_worker(tp_rank, tp_size, backend, sink)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(worker, method)(**kwargs)))
        except BaseException as exc:  # vLLM's executor returns a worker's failure to the caller
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
