"""How real SGLang answers the weight-update calls DCS makes, per version: sessions, refusals, what a failed
update leaves loaded, and what kills the server. Each assertion is SGLang's own code answering (tests/
sglang_engine/README.md); PROTOCOL.md beside this file explains them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.sglang_engine.harness import NEW, OLD, SGLangEngine, installed, run_trainer, warm
from tests.sglang_engine.tiny_model import initial_value

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]
KEY = "protocol-key"
EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"


@pytest.fixture(scope="module", autouse=True)
def _zygotes() -> None:
    warm(NEW, OLD)  # both versions' imports start at once (tests/sglang_engine/zygote.py)


def _engine(version: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    if not installed(version):
        pytest.skip(f"SGLang {version} not installed: run `make sglang-engines`")
    engine = SGLangEngine(version, tmp_path_factory.mktemp(f"proto-{version}") / "engine.log", api_key=KEY).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def new_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    yield from _engine(NEW, tmp_path_factory)


@pytest.fixture(scope="module")
def old_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    yield from _engine(OLD, tmp_path_factory)


def _answer(engine: SGLangEngine, path: str) -> tuple[int, Any]:
    response = engine.post(path, {})
    return response.status_code, response.json()


def _failures() -> list[dict[str, Any]]:
    """Updates SGLang refuses, in the order the tests read them (see the asserts)."""
    new_embed = torch.full((16, 8), 0.25)
    return [
        # 0: SGLang's flattened layout with a float32 at byte offset 6 (after 3 bfloat16s)
        {"tensors": {"x.a": torch.ones(3, dtype=torch.bfloat16), "x.b": torch.ones(2)}, "flattened": True},
        # 1: a dtype written as "torch.float32" (SGLang parses with getattr(torch, dtype))
        {"tensors": {EMBED: new_embed}, "body": {"dtypes": ["torch.float32"]}, "broadcast": False},
        # 2: names the model does not have
        {"tensors": {"not.a.param": torch.ones(4)}},
        # 3: a good tensor, then one of the wrong shape
        {"tensors": {EMBED: new_embed, NORM: torch.ones(4, dtype=torch.bfloat16)}},
    ]


def test_new_version_session_rules(new_engine: SGLangEngine) -> None:
    assert _answer(new_engine, "/end_weight_update") == (
        400,
        {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"},
    )
    assert _answer(new_engine, "/begin_weight_update") == (200, {"success": True, "message": "Success"})
    assert _answer(new_engine, "/begin_weight_update") == (
        400,
        {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"},
    )
    assert _answer(new_engine, "/end_weight_update") == (200, {"success": True, "message": "Success"})


def test_new_version_refusals_and_partial_loads(new_engine: SGLangEngine, tmp_path: Path) -> None:
    updates = _failures()
    updates[0]["broadcast"] = False  # 0.5.23 checks the alignment before receiving anything
    updates.append({"tensors": {NORM: torch.ones(8, dtype=torch.bfloat16)}, "body": {"group_name": "nope"}})
    updates[-1]["broadcast"] = False
    assert new_engine.post("/pause_generation", {"mode": "retract"}).status_code == 200
    answers = run_trainer([new_engine], tmp_path, updates, sessions=True)
    assert new_engine.post("/continue_generation", {}).status_code == 200
    (misaligned,), (bad_dtype,), (unknown,), (partial,), (bad_group,) = answers["updates"]
    assert misaligned == [
        400,
        {
            "success": False,
            "message": "Failed to receive weights: Unaligned received tensor x.b: byte offset 6, dtype torch.float32",
        },
    ]
    assert bad_dtype[0] == 400
    assert bad_dtype[1]["message"] == "Failed to receive weights: module 'torch' has no attribute 'torch.float32'"
    assert unknown == [200, {"success": True, "message": "Succeeded to update parameter online."}]
    assert partial[0] == 400
    assert partial[1]["message"].startswith("Failed to update parameter online: Attempted to load weight")
    assert partial[1]["message"].endswith("Please discard the whole weights.")
    assert bad_group[0] == 400
    assert bad_group[1]["message"].startswith("Failed to receive weights: Group nope not in ['harness_group']")
    assert answers["end"] == [[200, {"success": True, "message": "Success"}]]
    # no rollback: the tensor loaded before the failing one stays, the failing one is untouched
    assert torch.equal(new_engine.weights(EMBED), torch.full((16, 8), 0.25))
    assert torch.equal(new_engine.weights(NORM), initial_value(NORM))


def test_new_version_survives_a_trainer_dying_mid_update(new_engine: SGLangEngine, tmp_path: Path) -> None:
    """The trainer exits after broadcasting 1 of 2 tensors: SGLang's receive fails at once (gloo: connection
    closed by peer), nothing of the update is loaded (the load runs after every receive), the dead group can
    be destroyed and a new one serves the next update."""
    before = {name: new_engine.weights(name) for name in (EMBED, NORM)}
    update = {"tensors": {NORM: torch.full((8,), 9.0, dtype=torch.bfloat16), EMBED: torch.zeros(16, 8)}}
    assert run_trainer([new_engine], tmp_path, [{**update, "die_after": 1}], sessions=True) == {"died": True}
    assert new_engine.wait_for_log("Failed to receive weights: [")
    assert new_engine.wait_for_log("Connection closed by peer")
    destroyed = new_engine.post("/destroy_weights_update_group", {"group_name": "harness_group"})
    assert destroyed.json() == {"success": True, "message": "Succeeded to destroy custom process group."}
    assert new_engine.post("/end_weight_update", {}).json() == {"success": True, "message": "Success"}
    assert all(torch.equal(new_engine.weights(name), before[name]) for name in before)
    answers = run_trainer([new_engine], tmp_path, [update], sessions=True)
    assert answers["updates"] == [[[200, {"success": True, "message": "Succeeded to update parameter online."}]]]
    assert torch.equal(new_engine.weights(NORM), update["tensors"][NORM])


def test_old_version_refusals_and_partial_loads(old_engine: SGLangEngine, tmp_path: Path) -> None:
    answers = run_trainer([old_engine], tmp_path, _failures())  # 0.5.20 receives the misaligned bucket first
    (misaligned,), (bad_dtype,), (unknown,), (partial,) = answers["updates"]
    assert misaligned[0] == 400 and misaligned[1]["message"].startswith("Failed to update parameter online: ")
    assert bad_dtype[0] == 400
    assert bad_dtype[1]["message"].startswith(
        "Failed to update parameter online: module 'torch' has no attribute 'torch.float32'"
    )
    assert unknown == [200, {"success": True, "message": "Succeeded to update parameter online."}]
    assert partial[0] == 400 and partial[1]["message"].startswith("Failed to update parameter online: Attempted")
    assert torch.equal(old_engine.weights(EMBED), torch.full((16, 8), 0.25))
    assert torch.equal(old_engine.weights(NORM), initial_value(NORM))


def test_old_version_dies_on_an_unknown_group(old_engine: SGLangEngine) -> None:
    """0.5.20 asserts the group name outside its try: the scheduler raises and SGLang kills the server.
    (Last in this module: it ends the module's engine.)"""
    body = {"names": [NORM], "dtypes": ["bfloat16"], "shapes": [[8]], "group_name": "nope"}
    with pytest.raises(httpx.TransportError):  # the connection drops (or the call times out)
        old_engine.post("/update_weights_from_distributed", body, timeout=30)
    assert old_engine.proc is not None
    old_engine.proc.wait(30)
    assert old_engine.wait_for_log("AssertionError: Group nope not in")


def test_dp_admin_key_and_health_with_sglang_defaults(sglang_engine: Callable[..., SGLangEngine]) -> None:
    """0.5.23 with --dp-size 2, --api-key K --admin-api-key A and SGLang's default /health (a generation):
    weight routes take only A, other routes only K; data parallelism is an AssertionError (500); /health
    answers 200 once the scheduler answers its probe, but while paused the probe is never sent (the tokenizer
    holds generations until /continue_generation) and /health answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT
    (SGLang's default 20 s; 5 s here, so that the 503 comes sooner: the probe's answer takes milliseconds)."""
    engine = sglang_engine(
        NEW,
        api_key=KEY,
        sglang_args=("--dp-size", "2", "--admin-api-key", "admin-key"),
        env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true", "SGLANG_HEALTH_CHECK_TIMEOUT": "5"},
    )
    admin = {"Authorization": "Bearer admin-key"}
    init = dict(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, backend="gloo")
    assert engine.post("/init_weights_update_group", init).status_code == 401  # the normal key
    assert httpx.get(f"{engine.url}/model_info", headers=admin).status_code == 401  # the admin key
    response = httpx.post(f"{engine.url}/init_weights_update_group", json=init, headers=admin, timeout=30)
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    assert engine.wait_for_log("AssertionError: data-parallel replicas are not supported")
    assert engine.get("/server_info").json()["dp_size"] == 2
    assert httpx.get(f"{engine.url}/health", timeout=40).status_code == 200  # the probe is answered
    paused = httpx.post(f"{engine.url}/pause_generation", json={"mode": "retract"}, headers=admin)
    assert paused.status_code == 200
    assert httpx.get(f"{engine.url}/health", timeout=40).status_code == 503
    assert engine.get("/model_info").status_code == 200  # answered by the tokenizer, paused or not
