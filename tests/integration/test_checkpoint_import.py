"""`dcs ckpt import`: torch DCP and Hugging Face checkpoints become committed steps, bit-exact, without a worker.

The checkpoints are written by the peers' own code (`torch.distributed.checkpoint.save`, single process and a
2-rank gloo group; `transformers`' `save_pretrained`), imported with the CLI against a real redis-server, and
read back with `Checkpointer.restore()` and `dcs ckpt verify`. Hostile inputs (a pickle that would run a
command, file names that leave the directory, a lying header) are refused by name before anything runs.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.store.ledger.stepledger import StepLedger, StepStatus
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from tests.checkpoint_support import assert_same_state, ckpt_config, dcs_ckpt
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import REPO

pytestmark = pytest.mark.integration


def trainer_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"bf16": torch.randn(5, 3).to(torch.bfloat16), "mask": torch.rand(9) > 0.5, "ids": torch.arange(6)},
        "step": 7,
        "name": "run-a",
        "lr": 1e-3,
    }


def dcp_flat(state: Any) -> Any:
    """A state as DCP gives it back: dict keys are strings (DCP's flattening turns int keys into str)."""
    if isinstance(state, dict):
        return {str(k): dcp_flat(v) for k, v in state.items()}
    if isinstance(state, list):
        return [dcp_flat(v) for v in state]
    return state


def test_import_dcp_single_process_restores_bit_exact(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=1 << 20)
    state = trainer_state()
    source = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(source), no_dist=True)

    done = dcs_ckpt(config, "import", "--run", "fromdcp", "--step", "5", "--from", str(source), "--format", "dcp")
    assert done.returncode == 0, done.stderr
    assert dcs_ckpt(config, "verify", "--run", "fromdcp").stdout.strip() == "step 5: ok"
    run_dir = Path(config.checkpoint.dir) / "fromdcp"
    assert (run_dir / "latest").read_text().strip() == "step-000000005"
    client = sync_client(config)
    try:
        assert StepLedger(client, Keys(config.redis.namespace)).read("fromdcp", 5).status is StepStatus.COMMITTED
    finally:
        client.close()
    with Checkpointer("fromdcp", config) as ckpt:
        restored = ckpt.restore()
    assert restored.step == 5
    assert restored.metadata["imported_from"]["format"] == "dcp"
    assert_same_state(dcp_flat(state), restored.state)

    # the step is committed: a second import of it is refused, the first stays as it was
    again = dcs_ckpt(config, "import", "--run", "fromdcp", "--step", "5", "--from", str(source), "--format", "dcp")
    assert again.returncode == 1 and "step 5 of run 'fromdcp' is already committed" in again.stderr


RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2,
                        timeout=__import__("datetime").timedelta(seconds=60))
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
torch.manual_seed(100 + rank)
mesh = init_device_mesh("cpu", (2,))
split = distribute_tensor(torch.arange(42.0).reshape(7, 6), mesh, [Shard(0)])  # rows 0-3 on rank 0, 4-6 on 1
state = {"model": {"shared.weight": torch.arange(12.0).reshape(3, 4),        # replicated: saved once
                   f"rank{rank}.weight": torch.randn(5, rank + 2),           # each rank's own key
                   "split.weight": split},                                    # one chunk per rank
         "step": 11}
dcp.save(state, checkpoint_id=sys.argv[3])
state["model"]["split.weight"] = split.to_local()
torch.save(state, sys.argv[3] + f".expected{rank}.pt")
dist.barrier()  # neither rank tears the group down while the other still uses it
dist.destroy_process_group()
"""


def test_import_dcp_saved_by_two_gloo_ranks(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    source = tmp_path / "dcp2"
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    # the ranks are forked from the forkserver that imported torch (tests/helpers/preloaded.py)
    procs = [
        python_module("tests.helpers.code_main", RANK_SCRIPT, str(r), port, str(source), log=logs[r], env=env)
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert sorted(p.name for p in source.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    done = dcs_ckpt(config, "import", "--run", "two", "--step", "1", "--from", str(source), "--format", "dcp")
    assert done.returncode == 0, done.stderr
    with Checkpointer("two", config) as ckpt:
        restored = ckpt.restore()
    ranks = [torch.load(f"{source}.expected{r}.pt", weights_only=True) for r in range(2)]
    expected = {
        "model": {
            "shared.weight": ranks[0]["model"]["shared.weight"],
            "rank0.weight": ranks[0]["model"]["rank0.weight"],
            "rank1.weight": ranks[1]["model"]["rank1.weight"],
            "split.weight": torch.cat([ranks[0]["model"]["split.weight"], ranks[1]["model"]["split.weight"]]),
        },
        "step": 11,
    }
    assert restored.state["step"] == 11
    assert torch.equal(expected["model"]["split.weight"], torch.arange(42.0).reshape(7, 6))
    assert sorted(restored.state["model"]) == sorted(expected["model"])
    for key, tensor in expected["model"].items():
        assert torch.equal(restored.state["model"][key], tensor), key


def test_import_hf_from_save_pretrained_and_back(dcs_config: DCSConfig, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
    config = ckpt_config(dcs_config, tmp_path)
    llama = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(llama)
    source = tmp_path / "hf"
    model.save_pretrained(source, max_shard_size="100KB")  # shards + index, as large models come
    assert (source / "model.safetensors.index.json").exists()

    done = dcs_ckpt(config, "import", "--run", "fromhf", "--step", "0", "--from", str(source), "--format", "hf")
    assert done.returncode == 0, done.stderr
    assert dcs_ckpt(config, "verify", "--run", "fromhf").returncode == 0
    with Checkpointer("fromhf", config) as ckpt:
        restored = ckpt.restore()
    saved = restored.state["model"]
    expected = model.state_dict()
    assert set(saved) == set(expected) - {"lm_head.weight"}  # what the files hold: the tied head is not there
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    fresh = transformers.AutoModelForCausalLM.from_config(llama)
    missing = fresh.load_state_dict(saved, strict=False).missing_keys
    assert missing == ["lm_head.weight"]
    assert torch.equal(fresh.lm_head.weight, expected["lm_head.weight"])  # tied: the embedding is the head

    out = tmp_path / "back"  # and out again: what from_pretrained loads is the original model
    assert dcs_ckpt(config, "export", "--run", "fromhf", "--out", str(out)).returncode == 0
    llama.save_pretrained(out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in expected.items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_import_refuses_hostile_dcp_metadata(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    source = tmp_path / "evil"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(source), no_dist=True)
    marker = tmp_path / "pwned"
    (source / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    done = dcs_ckpt(config, "import", "--run", "evil", "--step", "1", "--from", str(source), "--format", "dcp")
    assert done.returncode == 1
    assert "ForeignCheckpointError" in done.stderr and "posix.system" in done.stderr
    assert not marker.exists()

    # real DCP metadata whose storage index points outside the directory
    good = tmp_path / "good"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(good), no_dist=True)
    metadata = pickle.loads((good / ".metadata").read_bytes())  # our own file, written just above
    for info in metadata.storage_data.values():
        info.relative_path = "../evil/__0_0.distcp"
    (good / ".metadata").write_bytes(pickle.dumps(metadata))
    done = dcs_ckpt(config, "import", "--run", "evil", "--step", "1", "--from", str(good), "--format", "dcp")
    assert done.returncode == 1 and "'../evil/__0_0.distcp', not a file here" in done.stderr
    assert not (Path(config.checkpoint.dir) / "evil").exists()


def test_import_refuses_hostile_hf_dirs(dcs_config: DCSConfig, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = ckpt_config(dcs_config, tmp_path)
    escape = tmp_path / "escape"
    escape.mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "outside.safetensors"))
    index = {"metadata": {}, "weight_map": {"w": "../outside.safetensors"}}
    (escape / "model.safetensors.index.json").write_text(json.dumps(index))
    done = dcs_ckpt(config, "import", "--run", "h", "--step", "1", "--from", str(escape), "--format", "hf")
    assert done.returncode == 1 and "'../outside.safetensors', not a file here" in done.stderr

    liar = tmp_path / "liar"
    liar.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode()
    (liar / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    done = dcs_ckpt(config, "import", "--run", "h", "--step", "1", "--from", str(liar), "--format", "hf")
    assert done.returncode == 1 and "no consistent dtype, shape and byte range" in done.stderr

    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    done = dcs_ckpt(config, "import", "--run", "h", "--step", "1", "--from", str(huge), "--format", "hf")
    assert done.returncode == 1 and "header length" in done.stderr
    done = dcs_ckpt(config, "import", "--run", "h", "--step", "1", "--from", str(tmp_path / "nope"), "--format", "hf")
    assert done.returncode == 1 and "is not a directory" in done.stderr
    assert not (Path(config.checkpoint.dir) / "h").exists()


def test_list_of_a_run_that_does_not_exist_is_an_error(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    done = dcs_ckpt(config, "list", "--run", "nonexistent")
    assert done.returncode != 0
    assert "'nonexistent'" in done.stderr and "does not exist" in done.stderr
    assert done.stdout == ""


def test_import_then_restore_into_a_live_state(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """A trainer resumes from an imported DCP step with `restore(into=)` on its own (str-keyed) state."""
    config = ckpt_config(dcs_config, tmp_path)
    state = {"model": trainer_state(1)["model"], "step": 3}
    source = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(source), no_dist=True)
    assert (
        dcs_ckpt(config, "import", "--run", "r", "--step", "3", "--from", str(source), "--format", "dcp").returncode
        == 0
    )
    target = {"model": trainer_state(2)["model"], "step": 0}
    weight = target["model"]["0.weight"]
    with Checkpointer("r", config) as ckpt:
        restored = ckpt.restore(into=target)
    assert restored.state["model"]["0.weight"] is weight and torch.equal(weight, state["model"]["0.weight"])
    assert restored.state["step"] == 3


def test_import_obeys_the_ledger_and_needs_redis(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """A step another save has in flight is not written over; without Redis nothing is written at all."""
    import time

    from dcs_tasks.checkpoint.format.layout import ManifestDraft

    config = ckpt_config(dcs_config, tmp_path)
    source = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(source), no_dist=True)
    client = sync_client(config)
    try:
        draft = ManifestDraft(run="busy", step=2, tensors={}, structure={"k": "v", "v": None}, created_at=time.time())
        ledger = StepLedger(client, Keys(config.redis.namespace))
        assert ledger.begin("busy", 2, "trainer-token", 1, draft, abandoned_after=600).value == "write"
        done = dcs_ckpt(config, "import", "--run", "busy", "--step", "2", "--from", str(source), "--format", "dcp")
        assert done.returncode == 1 and "step 2 of run 'busy' is being saved right now" in done.stderr
        assert ledger.read("busy", 2).token == "trainer-token"  # the trainer's attempt is untouched
    finally:
        client.close()
    assert not (Path(config.checkpoint.dir) / "busy" / "step-000000002").exists()

    offline = config.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    done = dcs_ckpt(offline, "import", "--run", "off", "--step", "1", "--from", str(source), "--format", "dcp")
    assert done.returncode == 1 and "needs the Redis ledger" in done.stderr
    assert not (Path(config.checkpoint.dir) / "off").exists()


def test_a_failed_import_is_failed_in_the_ledger_and_can_be_retried(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    source = tmp_path / "dcp"
    state = {"model": {"w": torch.arange(6.0)}, "step": 4}
    dcp.save(state, checkpoint_id=str(source), no_dist=True)
    blocker = Path(config.checkpoint.dir) / "retry" / "step-000000004"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")  # the step's files cannot be written: the import fails mid-way
    args = ("import", "--run", "retry", "--step", "4", "--from", str(source), "--format", "dcp")
    done = dcs_ckpt(config, *args)
    assert done.returncode == 1 and "Not a directory" in done.stderr
    client = sync_client(config)
    try:
        failed = StepLedger(client, Keys(config.redis.namespace)).read("retry", 4)
        assert failed.status is StepStatus.FAILED and "import failed" in failed.reason
    finally:
        client.close()
    assert not (blocker.parent / "latest").exists()

    blocker.unlink()
    assert dcs_ckpt(config, *args).returncode == 0  # a FAILED step may be written again
    with Checkpointer("retry", config) as ckpt:
        assert torch.equal(ckpt.restore(step=4).state["model"]["w"], torch.arange(6.0))


def _shared_bytes_held() -> int:
    """Bytes of shared memory (memfd or /dev/shm files) this process holds open."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/memfd:") or target.startswith("/dev/shm/"):
                held += os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return held


def test_a_sparse_hf_file_is_imported_without_growing_shared_memory(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 20, finding 3: one 512 MiB tensor in a sparse file (4 KiB on disk) was assembled in a memfd, so
    the import grew the host's shared memory by the tensor's size (a 12 GiB file: 6 GiB in 32 s). The output
    file is now assembled in an unlinked temporary file on disk; the import holds no shared memory."""
    import threading

    from dcs_tasks.cli.main import main

    size = 512 << 20
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    source = tmp_path / "sparse"
    source.mkdir()
    with open(source / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)  # a hole: nothing on disk
    assert os.stat(source / "model.safetensors").st_blocks * 512 < 1 << 20
    config = ckpt_config(dcs_config, tmp_path)
    for name, value in config.to_env().items():
        monkeypatch.setenv(name, value)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _shared_bytes_held())
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        code = main(["ckpt", "import", "--run", "sparse", "--step", "1", "--from", str(source), "--format", "hf"])
    finally:
        done.set()
        sampler.join()
    assert code == 0
    assert peak[0] < 16 << 20, f"the import held {peak[0] >> 20} MiB of shared memory"
    step_dir = Path(config.checkpoint.dir) / "sparse" / "step-000000001"
    assert (step_dir / "manifest.json").is_file() and not [p for p in step_dir.iterdir() if p.name.startswith("tmp")]
