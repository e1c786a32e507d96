"""Test helper: a vLLM engine made of vLLM's own code on CPU (`VLLMEngine`), see README.md beside this file.

engine = VLLMEngine(tmp_path / "engine.log", tp=2).start()
engine.get("/get_world_size").json()      # {"world_size": 2}, vLLM's RL router
engine.weights()                          # {name: torch.Tensor}, the full tensors, bit-exact
engine.stop()                             # kill -9 of the server and its worker processes
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from tests.helpers.ports import free_port
from tests.vllm_engine.install import VERSIONS

REPO = Path(__file__).resolve().parents[2]
VLLM_ROOT = REPO / ".vllm"
NEWEST = VERSIONS[-1]


def installed(version: str = NEWEST) -> bool:
    dirs = (VLLM_ROOT / version, VLLM_ROOT / "deps", VLLM_ROOT / "plugins")
    return all((d / ".installed").exists() for d in dirs)


class VLLMEngine:
    """`python -m tests.vllm_engine.serve` in its own session on a free port, logging to `log_path`.

    `dev_mode=False` starts it without VLLM_SERVER_DEV_MODE (no RL routes); `backend=None` without
    `--weight-transfer-config` (its workers refuse every weight-transfer call)."""

    def __init__(
        self,
        log_path: Path,
        *,
        version: str = NEWEST,
        tp: int = 1,
        api_key: str | None = None,
        dev_mode: bool = True,
        backend: str | None = "dcs",
        port: int | None = None,
    ) -> None:
        self.log_path, self.version, self.tp, self.api_key = log_path, version, tp, api_key
        self.dev_mode, self.backend = dev_mode, backend
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The harness command; everything after `--` is a `vllm serve` command line."""
        model_dir = self.log_path.parent / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        cmd = [sys.executable, "-m", "tests.vllm_engine.serve", "--vllm-dir", str(VLLM_ROOT / self.version), "--"]
        cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.backend:
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.backend})]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self, timeout: float | None = None) -> VLLMEngine:
        """Start and wait for /health: `timeout`, else DCS_TEST_VLLM_START_SECONDS, else 300 s (vLLM's imports
        take ~30 s per process on an idle 2-core machine, minutes under load)."""
        if timeout is None:
            timeout = float(os.environ.get("DCS_TEST_VLLM_START_SECONDS", "300"))
        if not installed(self.version):
            raise RuntimeError(f"vLLM {self.version} is not installed under {VLLM_ROOT}: run `make vllm-engines`")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DCS_", "VLLM_"))}
        env.update(PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu")
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM engine exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self.http.get("/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM engine not healthy after {timeout}s: {self.log_tail()}")

    def stop(self) -> None:
        """kill -9 the whole session (server and worker processes)."""
        self.http.close()
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""

    def get(self, path: str, timeout: float = 60.0) -> httpx.Response:
        return self.http.get(path, timeout=timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> httpx.Response:
        return self.http.post(path, json=body, timeout=timeout)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight the engine's workers hold, TP shards joined (the harness's /harness/weights)."""
        response = self.get("/harness/weights")
        response.raise_for_status()
        out = {}
        for name, item in response.json().items():
            raw = torch.frombuffer(bytearray(bytes.fromhex(item["hex"])), dtype=torch.uint8)
            out[name] = raw.view(getattr(torch, item["dtype"])).reshape(item["shape"])
        return out

    def weight_version(self) -> str:
        return str(self.get("/weight_info").json()["weight_version"])
