"""`dcs ckpt export --format hf`: a step saved (by an in-process committer, the worker's code) loads with
transformers, bit-exact.

The models are built from configs in code (nothing is downloaded). The saved state holds the model, its
optimizer and plain values, as a trainer saves it; only `model/` is exported, with the prefix stripped, the
tied output head left out as `save_pretrained` does, and `from_pretrained` ties it again.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.inline import InlineCommitter
from dcs_tasks.config import DCSConfig
from tests.checkpoint_support import ckpt_config, dcs_ckpt

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

pytestmark = pytest.mark.integration


def tiny_llama(tied: bool = True, dtype: torch.dtype = torch.float32) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def trained_state(model: Any) -> dict[str, Any]:
    """One optimizer step, so the weights are not the init values and the optimizer has state."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1, "lr": 1e-2}


def save_step(config: DCSConfig, tmp_path: Path, run: str, state: dict[str, Any], step: int = 10) -> Path:
    """Save `state` as `step` (persisted and committed by an in-process committer: the worker's code)."""
    committer = InlineCommitter(config)
    try:
        with Checkpointer(run, config, celery_app=committer) as ckpt:
            info = ckpt.save(state, step=step).wait(timeout=120)
    finally:
        committer.close()
    return Path(info.path)


def assert_bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        other = got[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert torch.equal(tensor.contiguous().view(torch.uint8), other.contiguous().view(torch.uint8)), name


def header_of(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(length)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_loads_with_from_pretrained_bit_exact(dcs_config: DCSConfig, tmp_path: Path, dtype: torch.dtype) -> None:
    config = ckpt_config(dcs_config, tmp_path, file_shard_bytes=1 << 20)  # several DCS files
    model = tiny_llama(dtype=dtype)
    state = trained_state(model)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step_dir = save_step(config, tmp_path, "llama", state)
    assert len(list(step_dir.glob("*.safetensors"))) >= 2

    out = tmp_path / "hf"
    done = dcs_ckpt(config, "export", "--run", "llama", "--format", "hf", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "tied: lm_head.weight -> model.embed_tokens.weight" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    header = header_of(out / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    # what save_pretrained writes: every key but the tied head, no prefix, nothing of the optimizer
    assert set(header) - {"__metadata__"} == set(expected) - {"lm_head.weight"}

    model.config.save_pretrained(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    assert_bit_exact(expected, loaded.state_dict())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again
    if dtype == torch.float32:  # in bf16 the rotary buffers (not saved: non-persistent) are built differently
        ids = torch.randint(0, 256, (1, 8))
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)


def test_export_shards_with_an_index_and_tied_copy_loads_strictly(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    model = tiny_llama()
    state = trained_state(model)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_step(config, tmp_path, "sharded", state, step=3)

    model.config.save_pretrained(tmp_path / "cfg")  # --config copies it next to the weights
    out = tmp_path / "hf"
    args = ("--run", "sharded", "--step", "3", "--out", str(out), "--max-shard-size", "200KB")
    done = dcs_ckpt(config, "export", *args, "--config", str(tmp_path / "cfg" / "config.json"))
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(expected) - {"lm_head.weight"}
    assert index["metadata"]["total_size"] == sum(t.nbytes for k, t in expected.items() if k != "lm_head.weight")
    assert_bit_exact(expected, transformers.AutoModelForCausalLM.from_pretrained(out).state_dict())

    # --tied copy: every key is written, so plain torch can load it strictly without transformers' tying
    from safetensors.torch import load_file

    flat = tmp_path / "flat"
    done = dcs_ckpt(config, "export", "--run", "sharded", "--out", str(flat), "--tied", "copy")
    assert done.returncode == 0, done.stderr
    fresh = tiny_llama(tied=False)
    fresh.load_state_dict(load_file(str(flat / "model.safetensors")), strict=True)
    assert_bit_exact(expected, fresh.state_dict())


def test_export_refuses_a_step_that_does_not_verify(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    model = tiny_llama()
    step_dir = save_step(config, tmp_path, "bad", trained_state(model), step=4)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = manifest["tensors"]["model/model.norm.weight"]
    victim = step_dir / entry["file"]
    data = bytearray(victim.read_bytes())
    data[entry["offsets"][0]] ^= 0x01  # one bit of a model tensor: sizes and headers still check
    victim.write_bytes(bytes(data))

    out = tmp_path / "hf"
    done = dcs_ckpt(config, "export", "--run", "bad", "--out", str(out))
    assert done.returncode == 1
    assert "CorruptCheckpoint" in done.stderr and victim.name in done.stderr and "checksum" in done.stderr
    assert not [p for p in out.iterdir()]  # neither a weights file nor a temp left behind


def test_export_names_what_is_wrong(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    save_step(config, tmp_path, "plain", trained_state(tiny_llama()), step=2)
    done = dcs_ckpt(config, "export", "--run", "plain", "--out", str(tmp_path / "a"), "--prefix", "ema/")
    assert done.returncode == 1 and "no tensor under prefix 'ema/'" in done.stderr and "'model'" in done.stderr
    done = dcs_ckpt(config, "export", "--run", "plain", "--step", "9", "--out", str(tmp_path / "b"))
    assert done.returncode == 1 and "CheckpointNotFound" in done.stderr and "no committed step 9" in done.stderr
    done = dcs_ckpt(config, "export", "--run", "nosuchrun", "--out", str(tmp_path / "c"))
    assert done.returncode == 1 and "'nosuchrun'" in done.stderr
    assert dcs_ckpt(config, "export", "--run", "plain", "--out", str(tmp_path / "d")).returncode == 0
    done = dcs_ckpt(config, "export", "--run", "plain", "--out", str(tmp_path / "d"))
    assert done.returncode == 1 and "already holds ['model.safetensors']" in done.stderr
    (tmp_path / "bad.json").write_text("[1, 2]")
    done = dcs_ckpt(
        config, "export", "--run", "plain", "--out", str(tmp_path / "e"), "--config", str(tmp_path / "bad.json")
    )
    assert done.returncode == 1 and "is not a JSON object" in done.stderr and not (tmp_path / "e").exists()


def test_export_of_a_multi_rank_run_joins_the_shards(dcs_config: DCSConfig, tmp_path: Path) -> None:
    """Two ranks each save their half of the embedding (tied to the head) and of an MLP weight; the export is
    the whole model."""
    config = ckpt_config(dcs_config, tmp_path)
    model = tiny_llama()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    split = {"model.embed_tokens.weight": 0, "model.layers.0.mlp.up_proj.weight": 0}
    committer = InlineCommitter(config)
    try:
        for rank in range(2):
            part = dict(full)
            for name, dim in split.items():
                part[name] = torch.tensor_split(full[name], 2, dim)[rank].clone()
            part["lm_head.weight"] = part["model.embed_tokens.weight"]  # tied on each rank, as in the model
            with Checkpointer("tp", config, rank=rank, world_size=2, celery_app=committer) as ckpt:
                sharding = {f"model/{name}": dim for name, dim in split.items()}
                ckpt.save({"model": part, "step": 5}, step=5, sharding=sharding).wait(timeout=120)
    finally:
        committer.close()

    out = tmp_path / "hf"
    done = dcs_ckpt(config, "export", "--run", "tp", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "tied: lm_head.weight -> model.embed_tokens.weight" in done.stdout
    model.config.save_pretrained(out)
    assert_bit_exact(full, transformers.AutoModelForCausalLM.from_pretrained(out).state_dict())
