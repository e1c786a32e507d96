"""The engine's scheduler process: SGLang's weight-update stack around a tiny CPU model.

SGLang's `launch_server` starts one scheduler process per TP rank through its `run_scheduler_process_func`
hook (sglang/srt/entrypoints/engine.py `_launch_scheduler_processes`); the harness passes `run_scheduler`
here instead of SGLang's `run_scheduler_process`, which would build the GPU model, KV cache and batcher.
What runs is SGLang's own code:

- the ZMQ channels to the tokenizer manager (`SchedulerIpcChannels.create`, `sock_recv`, `send_output`),
  and TP rank 0 broadcasting each request to the other ranks (`broadcast_pyobj` over the TP group);
- `SchedulerWeightUpdaterManager` (sglang/srt/managers/scheduler_components/weight_updater.py): sessions,
  update/flush/version bookkeeping;
- `TpModelWorker`'s weight-update methods and the model runner's `WeightUpdater` (group join through
  `init_custom_process_group`, the broadcast receive, `load_weights`) and `WeightExporter`;
- `Scheduler.handle_update_weight_version` / `record_weight_version_change`.

Replaced (GPU or batching only): the model (tests.sglang_engine.tiny_model), the KV cache (`flush_cache`
always succeeds: no request ever runs), and generation (generate requests are dropped; health probes get
SGLang's `HealthCheckOutput`, as a busy SGLang scheduler sends, so `/health_generate` answers 200).
A handler that raises ends the process and signals the parent like SGLang's scheduler does (its
`run_scheduler_process` sends SIGQUIT to the parent, which kills the server).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import signal
import time
import traceback
import types
from typing import Any

import torch.distributed as dist

from tests.sglang_engine.tiny_model import TinyModel

log = logging.getLogger("sglang_engine.scheduler")


def run_detokenizer(*args: Any, **kwargs: Any) -> None:
    """Stand-in for SGLang's detokenizer process (with skip_tokenizer_init the scheduler answers the tokenizer
    directly); it only lives as long as its parent."""
    from sglang.srt.utils import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)


def run_scheduler(server_args: Any, port_args: Any, gpu_id: int, tp_rank: int, *rest: Any, **kwargs: Any) -> None:
    """SGLang's `run_scheduler_process` signature differs per version and launcher (the DP controller appends
    display ranks); the pipe writer is the last positional argument that can `send`."""
    pipe_writer = [arg for arg in rest if hasattr(arg, "send")][-1]
    parent = os.getppid()
    try:
        from sglang.srt.utils import kill_itself_when_parent_died

        kill_itself_when_parent_died()  # as SGLang's scheduler process does
        scheduler = HarnessScheduler(server_args, port_args, tp_rank)
        pipe_writer.send(scheduler.init_info())
        scheduler.event_loop()
    except Exception:
        log.error("Scheduler hit an exception: %s", traceback.format_exc())
        os.kill(parent, signal.SIGQUIT)
        os._exit(1)


def _publish(server_args: Any, tp_rank: int) -> None:
    from sglang.srt import runtime_context as rc

    params = inspect.signature(rc.publish).parameters
    if "ranks" in params:  # 0.5.21+: the launcher's placement
        ranks = rc.SpawnRanks(
            world_rank=rc.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), dp_rank=None, gpu_id=0
        )
        rc.publish(server_args, role="scheduler", ranks=ranks)
    else:
        rc.publish(server_args, role="scheduler")


def _build(cls: type, **values: Any) -> Any:
    """A dataclass of SGLang's built from the fields this version declares (extra values are dropped)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in values.items() if k in names})


class _Runner:
    """The slice of SGLang's ModelRunner the weight-update path reads."""

    def __init__(self, model: TinyModel, tp_rank: int, tp_size: int, model_path: str) -> None:
        from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight_updater = _build(
            WeightUpdater,
            tp_rank=tp_rank,
            device="cpu",
            gpu_id=0,
            model_config=None,
            custom_weight_loaders={},
            get_model=lambda: self.model,
            update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: self,
        )
        self.weight_exporter = _build(
            WeightExporter,
            tp_rank=tp_rank,
            tp_size=tp_size,
            gpu_id=0,
            get_model_path=lambda: model_path,
            get_model=lambda: self.model,
        )


def _tp_worker_class() -> type:
    """A TP worker whose weight methods are SGLang's `TpModelWorker` functions (they only read model_runner)."""
    from sglang.srt.managers.tp_worker import TpModelWorker

    methods = (
        "init_weights_update_group",
        "destroy_weights_update_group",
        "update_weights_from_distributed",
        "get_weights_by_name",
        "weight_update_runners",
        "update_weights_from_tensor",  # colocated updates (0.5.20)
        "deserialize_own_rank",  # colocated updates (0.5.21+)
    )
    attrs = {name: getattr(TpModelWorker, name) for name in methods if hasattr(TpModelWorker, name)}
    return type("HarnessTpWorker", (), attrs)


class HarnessScheduler:
    """One TP rank: SGLang's request types dispatched to SGLang's weight-update handlers."""

    def __init__(self, server_args: Any, port_args: Any, tp_rank: int) -> None:
        from sglang.srt.runtime_context import get_model, get_parallel

        _publish(server_args, tp_rank)
        self.tp_rank = tp_rank
        self.tp_size = int(get_parallel().tp_size)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port_args.nccl_port}",
            world_size=self.tp_size,
            rank=tp_rank,
        )
        self.tp_group = dist.group.WORLD  # an engine with TP only: SGLang's WORLD is its TP group
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        model = TinyModel(tp_rank, self.tp_size, self.tp_group, default_weight_loader)
        self.runner = _Runner(model, tp_rank, self.tp_size, get_model().model_path)
        worker = _tp_worker_class()()
        worker.model_runner = worker._model_runner = self.runner
        self.tp_worker = worker
        self.weight_updater = self._weight_updater_manager()
        self._bind_scheduler_methods()
        self.ipc = self._ipc_channels(port_args, server_args)
        self._engine_paused = False
        self.dispatch = self._dispatcher()

    # --- state the bound Scheduler methods read -----------------------------------------------------
    waiting_queue: list[Any] = []
    chunked_req = None
    hisparse_coordinator = None

    def collect_inflight_reqs(self) -> set[Any]:
        return set()

    def flush_cache(self, empty_cache: bool = False) -> bool:
        return True  # no request ever runs here, so SGLang's flush would always succeed

    def is_fully_idle(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def _bind_scheduler_methods(self) -> None:
        from sglang.srt.managers.scheduler import Scheduler

        for name in ("handle_update_weight_version", "record_weight_version_change"):
            setattr(self, name, types.MethodType(getattr(Scheduler, name), self))

    def _weight_updater_manager(self) -> Any:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.runtime_context import get_parallel

        fields = {f.name for f in dataclasses.fields(SchedulerWeightUpdaterManager)}
        if "tp_cpu_group" in fields and not any(
            f.name == "tp_cpu_group" and f.init for f in dataclasses.fields(SchedulerWeightUpdaterManager)
        ):  # 0.5.21+: read from the runtime context in __post_init__
            get_parallel().override_permanently(tp_group=types.SimpleNamespace(cpu_group=self.tp_group))
        return _build(
            SchedulerWeightUpdaterManager,
            tp_worker=self.tp_worker,
            draft_worker=None,
            tp_cpu_group=self.tp_group,
            memory_saver_adapter=None,
            flush_cache=self.flush_cache,
            is_fully_idle=self.is_fully_idle,
            scheduler=self,
            metrics_collector=None,
        )

    def _ipc_channels(self, port_args: Any, server_args: Any) -> Any:
        from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels

        return SchedulerIpcChannels.create(
            port_args=port_args,
            is_rank_zero=self.tp_rank == 0,
            skip_tokenizer_init=True,
            metrics_enabled=False,
            enable_scripted_runtime=False,
        )

    def _dispatcher(self) -> dict[type, Any]:
        from sglang.srt.managers import io_struct as io

        wu = self.weight_updater
        table: dict[str, Any] = {
            "InitWeightsUpdateGroupReqInput": wu.init_weights_update_group,
            "DestroyWeightsUpdateGroupReqInput": wu.destroy_weights_update_group,
            "UpdateWeightsFromDistributedReqInput": wu.update_weights_from_distributed,
            "UpdateWeightsFromTensorReqInput": wu.update_weights_from_tensor,  # colocated updates (by handle)
            "GetWeightsByNameReqInput": wu.get_weights_by_name,
            "BeginWeightUpdateReqInput": getattr(wu, "begin_weight_update", None),
            "EndWeightUpdateReqInput": getattr(wu, "end_weight_update", None),
            "UpdateWeightVersionReqInput": self.handle_update_weight_version,  # type: ignore[attr-defined]
            "PauseGenerationReqInput": self.pause_generation,
            "ContinueGenerationReqInput": self.continue_generation,
            "GetInternalStateReq": self.get_internal_state,
        }
        return {getattr(io, name): fn for name, fn in table.items() if fn is not None and hasattr(io, name)}

    # --- Scheduler control handlers SGLang implements against its batcher -------------------------------
    def pause_generation(self, req: Any) -> None:
        assert req.mode in ("in_place", "retract")  # as Scheduler.pause_generation
        self._engine_paused = True

    def continue_generation(self, req: Any) -> None:
        self._engine_paused = False

    def get_internal_state(self, req: Any) -> Any:
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput

        return GetInternalStateReqOutput(internal_state={"harness": True, "paused": self._engine_paused})

    def init_info(self) -> dict[str, Any]:
        return {"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4096, "startup_time": 0.0}

    # --- the loop --------------------------------------------------------------------------------------
    def _recv(self) -> list[Any]:
        from sglang.srt.managers.io_struct import sock_recv
        from sglang.srt.utils import broadcast_pyobj

        reqs: list[Any] = []
        if self.tp_rank == 0:
            reqs.append(sock_recv(self.ipc.recv_from_tokenizer))
        if self.tp_size > 1:
            reqs = broadcast_pyobj(reqs, self.tp_rank, self.tp_group, src=0)
        return reqs

    def _health_check(self, req: Any) -> Any:
        """A /health or /health_generate probe: SGLang's scheduler answers `HealthCheckOutput` for a probe it
        cannot run at once (`maybe_send_health_check_signal`); the harness never runs one."""
        from sglang.srt.managers.io_struct import HealthCheckOutput
        from sglang.srt.managers.utils import is_health_check_generate_req

        if is_health_check_generate_req(req):
            return HealthCheckOutput(http_worker_ipc=getattr(req, "http_worker_ipc", None))
        log.info("harness scheduler drops %s (no generation here)", type(req).__name__)
        return None

    def event_loop(self) -> None:
        while True:
            for req in self._recv():
                handler = self.dispatch.get(type(req), self._health_check)
                output = handler(req)
                if output is not None:
                    self.ipc.send_to_tokenizer.send_output(output, req)
