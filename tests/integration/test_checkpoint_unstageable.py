"""`save()` of a state DCS cannot stage as raw bytes raises StagingError naming the state path and the type,
before any of the tensor's memory is read: the trainer process never dies inside save() (a DTensor used to
SIGSEGV it). Tensors that can be staged, views with odd strides included, come back bit-exact."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dcs_tasks import Checkpointer
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import StagingError
from tests.checkpoint_support import Inline, as_bytes, ckpt_config, start_worker
from tests.helpers.ports import free_port
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def test_dtensor_and_nested_tensor_saves_raise_staging_error_in_a_live_gloo_trainer(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    worker = start_worker(config, tmp_path)
    out = tmp_path / "seen.json"
    try:
        env, log = child_env(config), tmp_path / "trainer.log"
        trainer = python_module("tests.integration.unstageable_trainer", str(free_port()), str(out), log=log, env=env)
        try:
            code = trainer.wait(timeout=180)
        finally:
            trainer.kill()
    finally:
        worker.discard()
    assert code == 0, f"the trainer died with {code}: {trainer.output()}"
    seen = json.loads(out.read_text())
    assert seen["dtensor"].startswith("UnsupportedPlacement: cannot checkpoint DTensor at 'model/w'"), seen["dtensor"]
    assert "Partial(sum)" in seen["dtensor"]
    assert seen["nested"].startswith("StagingError: cannot checkpoint Tensor at 'optim/state/0'"), seen["nested"]
    assert "nested" in seen["nested"]
    assert seen["plain"] == "saved" and seen["restored"] is True  # step 1 was never opened by the refused saves


class TorchFunctionOnly(torch.Tensor):
    """A subclass that only customises __torch_function__: plain storage, so it can be staged."""


def _unstageable() -> list[tuple[str, Callable[[], torch.Tensor], str]]:
    """(state key, tensor factory, what the error says) for tensors that cannot be staged as raw bytes."""
    dense = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return [
        ("coo", lambda: dense.to_sparse(), "layout torch.sparse_coo"),
        ("csr", lambda: dense.to_sparse_csr(), "layout torch.sparse_csr"),
        ("bsr", lambda: dense.to_sparse_bsr((1, 2)), "layout torch.sparse_bsr"),
        ("quantized", lambda: torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), "quantized"),
        ("meta", lambda: torch.empty(3, 4, device="meta"), "meta tensor"),
        ("complex", lambda: torch.randn(3, dtype=torch.complex128), "dtype torch.complex128"),
        ("lazy", lambda: torch.nn.UninitializedParameter(), "not initialized"),
        ("fake", _fake_tensor, "FakeTensor is a tensor subclass"),
    ]


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(3, 4)


def _stageable() -> dict[str, torch.Tensor]:
    """Odd but plain tensors: every one must be staged with its values (not its raw storage)."""
    base = torch.randn(6, 8)
    return {
        "transposed": base.t(),
        "offset_slice": base[2:, 3:],
        "every_other": base[:, ::2],
        "expanded": torch.randn(1, 5).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "neg_bit": torch.tensor(1 + 2j, dtype=torch.complex64).conj().imag,  # contiguous, lazily negated: -2.0
        "parameter": torch.nn.Parameter(torch.randn(3)),
        "subclass": torch.randn(4).as_subclass(TorchFunctionOnly),
        "empty": torch.empty(0, 3),
    }


def test_unstageable_tensors_are_refused_by_path_and_odd_views_round_trip(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = ckpt_config(dcs_config, tmp_path)
    committer = inline(config)
    try:
        with Checkpointer("odd", config, celery_app=committer) as ckpt, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse/quantized "beta"/"deprecated" notices
            for key, make, says in _unstageable():
                state = {"model": {"ok": torch.ones(2), key: make()}}
                with pytest.raises(StagingError, match=f"at 'model/{key}'") as err:
                    ckpt.save(state, step=1)
                assert says in str(err.value), str(err.value)
                assert type(state["model"][key]).__name__ in str(err.value)
            state = _stageable()
            ckpt.save(state, step=1).wait(60)  # the refused saves opened nothing
            restored = ckpt.restore(step=1).state
    finally:
        committer.close()
    for name, tensor in state.items():
        expected = tensor.detach().clone(memory_format=torch.contiguous_format).resolve_neg()
        assert restored[name].shape == expected.shape and restored[name].dtype == expected.dtype, name
        assert torch.equal(as_bytes(restored[name]), as_bytes(expected)), name
    assert restored["neg_bit"].item() == -2.0
