"""The harness is real SGLang: a trainer written like SGLang's own clients (no DCS code) updates a harness
engine of each installed version over gloo, and the weights read back through SGLang's /get_weights_by_name
are bit-exact. Also pins the per-version protocol facts DCS relies on (notes: tests/sglang_engine/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang_engine.harness import NEW, OLD, SGLangEngine, installed, run_trainer, warm
from tests.sglang_engine.tiny_model import SHAPES, SHARDED, initial_value

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
KEY = "harness-key"


@pytest.fixture(scope="module", autouse=True)
def _zygotes() -> None:
    warm(OLD, NEW)  # both versions' imports start at once (tests/sglang_engine/zygote.py)


def _engine(version: str, tp: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    if not installed(version):
        pytest.skip(f"SGLang {version} not installed: run `make sglang-engines`")
    log = tmp_path_factory.mktemp(f"sglang-{version}") / "engine.log"
    engine = SGLangEngine(version, log, tp=tp, api_key=KEY).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def old_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    yield from _engine(OLD, 1, tmp_path_factory)


@pytest.fixture(scope="module")
def new_engine_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    yield from _engine(NEW, 2, tmp_path_factory)


def _update(seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter (distinct from the engine's initial ones), ordered so that SGLang's
    flattened layout is aligned (decreasing itemsize)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(SHAPES, key=lambda n: -SHAPES[n][1].itemsize):
        shape, dtype = SHAPES[name]
        out[name] = torch.randn(shape, generator=gen).to(dtype)
    out["model.embed_tokens.weight"][0, 0] = -0.0
    return out


def _push(engine: SGLangEngine, tensors: dict[str, torch.Tensor], tmp_path: Path, **spec: Any) -> dict[str, Any]:
    """One update of `tensors` by the reference trainer; its answers with the update's under "update"."""
    update = {"tensors": tensors, **{k: spec.pop(k) for k in ("flattened", "weight_version") if k in spec}}
    answers = run_trainer([engine], tmp_path, [update], **spec)
    answers["update"] = answers["updates"][0]
    return answers


def _ok(answers: list[Any]) -> None:
    for status, body in answers:
        assert status == 200 and body["success"] is True, body


def _assert_holds(engine: SGLangEngine, tensors: dict[str, torch.Tensor]) -> None:
    for name, expected in tensors.items():
        got = engine.weights(name)
        assert got.dtype == expected.dtype
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name  # bit-exact, -0.0 included


def test_old_version_per_tensor_update_is_bit_exact(old_engine: SGLangEngine, tmp_path: Path) -> None:
    assert old_engine.get("/server_info").json()["version"] == OLD
    _assert_holds(old_engine, {n: initial_value(n) for n in SHAPES})
    tensors = _update(seed=1)
    answers = _push(old_engine, tensors, tmp_path, sessions=False, weight_version="11")
    for step in ("init", "update", "destroy"):
        _ok(answers[step])
    _assert_holds(old_engine, tensors)
    assert old_engine.get("/model_info").json()["weight_version"] == "11"


def test_old_version_has_no_session_routes(old_engine: SGLangEngine) -> None:
    response = old_engine.post("/begin_weight_update", {})
    assert response.status_code == 404


def test_new_version_tp2_session_update_is_bit_exact(new_engine_tp2: SGLangEngine, tmp_path: Path) -> None:
    info = new_engine_tp2.get("/server_info").json()
    assert (info["version"], info["tp_size"], info["dp_size"]) == (NEW, 2, 1)
    for flattened, seed in ((False, 2), (True, 3)):
        tensors = _update(seed)
        answers = _push(new_engine_tp2, tensors, tmp_path, sessions=True, flattened=flattened, weight_version=str(seed))
        for step in ("init", "begin", "update", "end", "destroy"):
            _ok(answers[step])
        _assert_holds(new_engine_tp2, tensors)  # the sharded weight is gathered from both TP ranks
        assert new_engine_tp2.get("/model_info").json()["weight_version"] == str(seed)
    assert SHARDED in tensors


def test_new_version_refuses_an_update_outside_a_session(new_engine_tp2: SGLangEngine) -> None:
    body = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[8]]}
    response = new_engine_tp2.post("/update_weights_from_distributed", body, timeout=30)
    assert response.status_code == 400
    assert response.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
    }


def test_api_key_is_required_except_on_health(new_engine_tp2: SGLangEngine) -> None:
    import httpx

    assert httpx.get(f"{new_engine_tp2.url}/model_info").status_code == 401
    assert httpx.post(f"{new_engine_tp2.url}/begin_weight_update", json={}).status_code == 401
    assert httpx.get(f"{new_engine_tp2.url}/health").status_code == 200
