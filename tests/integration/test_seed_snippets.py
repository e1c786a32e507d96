# ruff: noqa: RUF001 (the original examples carry full-width punctuation in their comments)
"""The original design's code examples (config, metrics, client), run as written against a real stack.

Each snippet below is the original text. What the test changes, and nothing else (docs/seed_compat.md):
- the import prefix `relax.distributed.checkpoint_service` -> `dcs_tasks` (done by `as_dcs`, visibly);
- the coordinator address `http://localhost:8000` -> the test coordinator's (a free port);
- on a host without CUDA, `BackendType.NCCL` -> `BackendType.GLOO` (NCCL needs GPUs);
- `args` and `model` (free names in the original) are given: an argparse.Namespace and a small torch model;
  the config examples get the root import of the names they use, and the metrics example the import of
  `MetricsCollector`, which the original uses without importing it;
- the multi-node example's `create_dcs_deployment(config)` line (Ray Serve) is not run: DCS runs its
  coordinator as `dcs coordinator` (docs/seed_compat.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import DCSError
from dcs_tasks.sync.receiving import tensor_sha256
from tests.distributed.sync_stack import auth_headers, sync_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PREFIX = "relax.distributed.checkpoint_service"

CONFIG_EXAMPLE = """
config = DCSConfig(
    coordinator_host="0.0.0.0",
    coordinator_port=8000,
    backend_type=BackendType.NCCL,
    heartbeat_interval_seconds=5.0,
    heartbeat_timeout_seconds=30.0,
    checkpoint_dir="/checkpoints",
    tensor_fusion_threshold=1024*1024,  # 1MB
    enable_metrics=True,
)
"""

SINGLE_NODE_EXAMPLE = """
config = DCSConfig(
    backend_type=BackendType.NCCL,
    coordinator_host="127.0.0.1",
    coordinator_port=8000,
    comm_base_port=20000,
)

client = CheckpointEngineClient(
    args=args,
    coordinator_url="http://127.0.0.1:8000",
    role="actor",
    rank=0,
    backend_type=BackendType.NCCL,
    device_id=0,
    model=model,
    model_name="qwen3-4B",
)
"""

MULTI_NODE_EXAMPLE = """
config = DCSConfig(
    backend_type=BackendType.NCCL,
    coordinator_host="10.0.0.1",
    coordinator_port=8000,
    heartbeat_interval_seconds=5.0,
    heartbeat_timeout_seconds=30.0,
)

topology_config = TopologyConfig(
    role_mappings={
        "actor": "rollout",
    }
)
"""

TUNING_EXAMPLES = """
config.sync.tensor_fusion_threshold = 1024 * 1024  # 1MB
config.staging.pinned_memory = True  # 默认，推荐用于 GPU
config.receiver.tcp_nodelay = True              # 禁用 Nagle 算法
config.receiver.tcp_buffer_size = 65536         # 64KB 缓冲区
config.sync.comm_base_port = 20000          # 基础端口
config.heartbeat.interval_seconds = 5.0   # 每 5 秒
config.heartbeat.timeout_seconds = 30.0   # 30 秒截止
config.task.max_retries = 3
config.task.retry_delay_seconds = 1.0  # 指数退避
"""

METRICS_EXAMPLES = """
from relax.distributed.checkpoint_service.metrics import MetricsCollector

metrics = MetricsCollector()
metrics.record_send(bytes_sent=1024*1024, duration=0.05)
print(metrics.export_prometheus())  # Prometheus 格式

# 全局实例
from relax.distributed.checkpoint_service.metrics import get_metrics
metrics = get_metrics()
metrics.record_save(bytes_saved=5*1024*1024, duration=1.2)

from relax.distributed.checkpoint_service.metrics import get_metrics

metrics = get_metrics()

# 获取为字典
stats = metrics.get_all()
print(f"发送的总字节数: {stats['counters']['bytes_sent']}")
print(f"平均发送延迟: {stats['latency']['send']['avg']:.3f}s")

# 导出为 Prometheus
prom_text = metrics.export_prometheus()
# 写入 Prometheus 端点
"""

CLIENT_EXAMPLE = """
import asyncio
from relax.distributed.checkpoint_service import CheckpointEngineClient, BackendType

async def main():
    client = CheckpointEngineClient(
        args=args,
        coordinator_url="http://localhost:8000",
        role="actor",
        rank=0,
        backend_type=BackendType.NCCL,
        device_id=0,
        model=model,
        model_name="qwen3-4B",
    )

    await client.start()

    # 向协调器注册
    print(f"注册为 {client.node_id}")

    # 更新 rollout 权重
    await client.update_weights_for_rollout()

    # 初始化 actor_fwd 权重同步
    await client.init_process_groups_for_actor_fwd_ref(rollout_id=100)

    await client.stop()

asyncio.run(main())
"""

ROOT_IMPORTS = f"from {PREFIX} import BackendType, CheckpointEngineClient, DCSConfig, TopologyConfig\n"


def as_dcs(snippet: str, coordinator_url: str | None = None) -> str:
    """The original snippet with the changes listed in this module's docstring (and only those)."""
    code = snippet.replace(PREFIX, "dcs_tasks")
    if coordinator_url is not None:
        code = code.replace('"http://localhost:8000"', repr(coordinator_url))
    if not torch.cuda.is_available():
        code = code.replace("BackendType.NCCL", "BackendType.GLOO")
    return code


def run(snippet: str, names: dict[str, Any] | None = None, coordinator_url: str | None = None) -> dict[str, Any]:
    namespace: dict[str, Any] = {"args": argparse.Namespace(), "model": torch.nn.Linear(8, 4), **(names or {})}
    exec(compile(as_dcs(snippet, coordinator_url), "<original example>", "exec"), namespace)
    return namespace


def test_the_config_examples_run_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DCS_")]:
        monkeypatch.delenv(name)  # the examples describe defaults, not this shell's settings
    done = run(ROOT_IMPORTS + CONFIG_EXAMPLE)
    config = done["config"]
    assert (config.coordinator.host, config.coordinator.port, config.sync.tensor_fusion_threshold) == (
        "0.0.0.0",
        8000,
        2**20,
    )
    assert config.base_url == "http://127.0.0.1:8000" and str(config.checkpoint.dir) == "/checkpoints"

    single = run(ROOT_IMPORTS + SINGLE_NODE_EXAMPLE)
    assert (single["config"].sync.comm_base_port, single["config"].sync.comm_max_port) == (20000, 20999)
    assert single["client"].node_id == "actor_0" and single["client"].model_name == "qwen3-4B"

    multi = run(ROOT_IMPORTS + MULTI_NODE_EXAMPLE + TUNING_EXAMPLES)
    assert multi["topology_config"].get_peer_role("actor") == "rollout"
    tuned = multi["config"]
    assert (tuned.sync.comm_base_port, tuned.sync.comm_max_port, tuned.receiver.tcp_buffer_size) == (
        20000,
        20999,
        65536,
    )


def test_the_metrics_examples_print_prometheus_text_and_stats(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")}
    env["PYTHONPATH"] = str(REPO)
    script = tmp_path / "metrics_example.py"
    script.write_text(as_dcs(METRICS_EXAMPLES), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "b'" not in out and "\\n" not in out  # text, not a bytes repr
    assert "# TYPE dcs_bytes_sent_total counter" in out and "dcs_bytes_sent_total 1.048576e+06" in out
    assert "发送的总字节数: 0.0" in out and "平均发送延迟: 0.000s" in out  # the global collector: nothing sent


def test_the_client_example_runs_against_a_real_stack(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Registers, pushes the model to two real `dcs receiver` engines (bit-exact), then reaches the actor ->
    actor_fwd step, which DCS refuses with a named error saying what to declare (docs/seed_compat.md): the
    original leaves the actor's pp-source role implicit. Declared as that error says, the example runs to its
    end."""
    with sync_stack(dcs_config, tmp_path, receivers=2) as stack:
        for name, value in stack.config.to_env().items():  # the client reads its settings from the environment
            monkeypatch.setenv(name, value)
        model = torch.nn.Linear(8, 4)
        with pytest.raises(DCSError, match="is_pp_src_rank"):
            run(CLIENT_EXAMPLE, {"model": model}, stack.url)
        assert "注册为 actor_0" in capsys.readouterr().out
        expected = {name: tensor_sha256(t) for name, t in model.state_dict().items()}
        for receiver in stack.receivers:
            digest = receiver.digest()
            assert digest.weight_version == 1 and digest.tensors == expected

        declared = CLIENT_EXAMPLE.replace(
            'model_name="qwen3-4B",', 'model_name="qwen3-4B",\n        metadata={"is_pp_src_rank": True},'
        )
        run(declared, {"model": model}, stack.url)
        assert "注册为 actor_0" in capsys.readouterr().out
        assert all(receiver.digest().weight_version == 2 for receiver in stack.receivers)


def test_register_accepts_null_for_the_optional_fields(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """RegisterRequest types ip, port and metadata optional: a real coordinator takes null for each."""
    with sync_stack(dcs_config, tmp_path) as stack:
        body = {"role_name": "rollout", "rank": 3, "world_size": None, "ip": None, "port": None}
        body |= {"device_id": None, "metadata": None}
        answer = httpx.post(f"{stack.url}/register", json=body, headers=auth_headers(stack.config.token()), timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["node_id"] == "rollout_3"
        node = httpx.get(
            f"{stack.url}/node", params={"role": "rollout", "rank": 3}, headers=auth_headers(stack.config.token())
        )
        assert node.status_code == 200 and node.json()["metadata"] == {} and node.json()["ip"] == "127.0.0.1"
