"""The engine client of a harness server (replaces vLLM's `AsyncLLM` + EngineCore + executor, which need a GPU
model and scheduler).

The RL methods the HTTP router calls are `AsyncLLM`'s own (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update` (which sets the version after the workers finished),
`update_weight_version`, `get_weight_version`, `pause_generation`, `resume_generation`, `is_paused`,
`shutdown_weight_transfer_engine`), bound to this class. What they call is replaced: `collective_rpc` sends the
call to every TP worker process (`worker.py`) and raises the first worker's failure, as vLLM's executor does;
`engine_core` keeps the weight version (EngineCore's initial "default") and the pause flag (no requests run here).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

RPC_TIMEOUT_SECONDS = 300.0
START_TIMEOUT_SECONDS = 240.0


class _EngineCore:
    def __init__(self) -> None:
        self.weight_version = "default"
        self.paused = False

    async def set_weight_version_async(self, version: str) -> None:
        self.weight_version = version

    async def get_weight_version_async(self) -> str:
        return self.weight_version

    async def pause_generation_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        self.paused = True

    async def resume_scheduler_async(self) -> None:
        self.paused = False

    async def is_scheduler_paused_async(self) -> bool:
        return self.paused


class _Renderer:
    async def clear_mm_cache_async(self) -> None:
        pass


def _bind_async_llm_methods(cls: type) -> type:
    from vllm.v1.engine.async_llm import AsyncLLM

    for name in (
        "init_weight_transfer_engine",
        "shutdown_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "update_weight_version",
        "get_weight_version",
        "pause_generation",
        "resume_generation",
        "is_paused",
    ):
        setattr(cls, name, getattr(AsyncLLM, name))
    return cls


class HarnessEngineClient:
    """Starts `tp_size` worker processes; `vllm_config` is what /get_world_size reads."""

    def __init__(self, vllm_config: Any, backend: str | None, sink: bool = False) -> None:
        self.vllm_config = vllm_config
        self.engine_core = _EngineCore()
        self.renderer = _Renderer()
        self.errored = False
        self.dead_error = RuntimeError("engine dead")
        tp = vllm_config.parallel_config.tensor_parallel_size
        # Forked, not spawned: a worker then starts with this process's imports (vLLM, torch) instead of paying them
        # again (10-30 s of CPU each on a 2-core machine). vLLM on CPU spawns its workers (its CPU platform sets
        # VLLM_WORKER_MULTIPROC_METHOD=spawn); fork is that variable's default, and before a fork vLLM's executor
        # joins libgomp's idle threads (vllm.utils.system_utils.get_mp_context), as here.
        _release_libgomp_threads()
        ctx = multiprocessing.get_context("fork")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            from tests.vllm_engine import worker

            proc = ctx.Process(target=worker.main, args=(child, rank, tp, backend, list(sys.path), sink), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:
            status, detail = self._recv(conn, START_TIMEOUT_SECONDS)
            if status != "ok":
                raise RuntimeError(f"worker failed to start: {detail}")

    @staticmethod
    def _recv(conn: Connection, timeout: float) -> tuple[str, Any]:
        if not conn.poll(timeout):
            raise TimeoutError(f"worker gave no answer within {timeout:g}s")
        return conn.recv()  # type: ignore[no-any-return]

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        for conn in self._conns:
            conn.send((method, kwargs or {}))
        limit = timeout or RPC_TIMEOUT_SECONDS
        answers = await asyncio.gather(*(asyncio.to_thread(self._recv, c, limit) for c in self._conns))
        for status, detail in answers:
            if status != "ok":
                raise RuntimeError(f"Worker failed with error '{detail}', please check the stack trace above")
        return [detail for _, detail in answers]

    async def check_health(self) -> None:
        dead = [p.pid for p in self._procs if not p.is_alive()]
        if dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError(f"worker processes {dead} died")

    async def do_log_stats(self) -> None:
        pass

    def shutdown(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()


def _release_libgomp_threads() -> None:
    """vLLM's step before it forks workers: a child forked after OpenMP ran a parallel region deadlocks in its own."""
    try:
        from vllm.utils.system_utils import _release_libgomp_threads as release
    except ImportError:  # a vLLM without it
        return
    release()


def make_client(vllm_config: Any, backend: str | None, sink: bool = False) -> HarnessEngineClient:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return _bind_async_llm_methods(HarnessEngineClient)(vllm_config, backend, sink)  # type: ignore[no-any-return]
