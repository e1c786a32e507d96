"""vLLM engine family: version and world-size checks, the registration's kind, the join body (no processes)."""

from __future__ import annotations

import pytest

from dcs_tasks.config import BackendType, RoleInfo
from dcs_tasks.errors import EngineIncompatible, UnsupportedEngineVersion, VLLMBackendMismatch, VLLMDevModeOff
from dcs_tasks.sync import vllm_protocol
from dcs_tasks.sync.planning import endpoint_of, plan_rollout_group
from dcs_tasks.sync.wire import EngineEndpoint

ENGINE = EngineEndpoint(rank=3, ip="10.0.0.7", port=8100, kind="vllm")


def test_the_supported_version_is_accepted_and_others_are_refused_by_name() -> None:
    assert vllm_protocol.vllm_version(ENGINE, {"version": "0.33.0"}) == "0.33.0"
    with pytest.raises(UnsupportedEngineVersion) as refused:
        vllm_protocol.vllm_version(ENGINE, {"version": "0.32.0"})
    assert refused.value.member == "rollout_3"
    assert "vLLM 0.32.0" in str(refused.value) and "supports vLLM 0.33.0" in str(refused.value)
    for payload in ({}, {"version": 33}, {"version": "x" * 100}, {"version": "not a version"}, []):
        with pytest.raises(EngineIncompatible):
            vllm_protocol.vllm_version(ENGINE, payload)


def test_world_size_is_the_rank_span_and_must_be_a_sane_integer() -> None:
    info = vllm_protocol.vllm_engine_info(ENGINE, "0.33.0", {"world_size": 4})
    assert (info.kind, info.tp_size, info.pause_mode, info.flattened_bucket) == ("vllm", 4, "abort", True)
    for payload in ({}, {"world_size": 0}, {"world_size": True}, {"world_size": 5000}, {"world_size": "2"}):
        with pytest.raises(EngineIncompatible):
            vllm_protocol.vllm_engine_info(ENGINE, "0.33.0", payload)


def test_dev_mode_off_says_what_to_turn_on() -> None:
    error = vllm_protocol.dev_mode_off(ENGINE, "/get_world_size")
    assert isinstance(error, VLLMDevModeOff) and isinstance(error, EngineIncompatible)
    assert "VLLM_SERVER_DEV_MODE=1" in str(error) and error.member == "rollout_3"


def test_the_registration_chooses_the_family_and_ranks_follow_each_engines_span() -> None:
    def node(rank: int, metadata: dict[str, object]) -> RoleInfo:
        return RoleInfo(role_name="rollout", rank=rank, ip="10.0.0.1", port=9000 + rank, metadata=metadata)

    endpoints = [
        endpoint_of(node(0, {})),
        endpoint_of(node(1, {"engine": "vllm"})),
        endpoint_of(node(2, {"engine": 7})),
    ]
    assert [e.kind for e in endpoints] == ["sglang", "vllm", "sglang"]
    sglang = vllm_protocol.vllm_engine_info(ENGINE, "0.33.0", {"world_size": 1}).model_copy(update={"kind": "sglang"})
    infos = {
        "rollout_0": sglang,
        "rollout_1": vllm_protocol.vllm_engine_info(ENGINE, "0.33.0", {"world_size": 2}),
        "rollout_2": sglang,
    }
    plan = plan_rollout_group(endpoints, infos)
    assert [e.rank_offset for e in plan.engines] == [1, 2, 4] and plan.world_size == 5


def test_the_join_body_is_vllms_init_info_with_one_chunk_per_request() -> None:
    body = vllm_protocol.init_info("10.0.0.1", 11000, 2, 5, "g-e1", 60.0)["init_info"]
    assert body["packed"] is True and body["packed_buffer_size_bytes"] >= 1 << 40
    assert (body["rank_offset"], body["world_size"], body["group_name"]) == (2, 5, "g-e1")
    assert body["transport"] == "gloo"
    nccl = vllm_protocol.init_info("10.0.0.1", 11000, 2, 5, "g-e1", 60.0, BackendType.NCCL)["init_info"]
    assert nccl["transport"] == "nccl"  # the plugin's workers join the trainer's NCCL group
    update = vllm_protocol.update_body(["a"], ["float32"], [[2, 3]])
    assert update == {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2, 3]]}}


def _server_info(transfer: object) -> dict[str, object]:
    return {"vllm_config": {"model_config": {}, "weight_transfer_config": transfer}, "vllm_env": {}}


def test_only_an_engine_on_dcss_plugin_backend_is_joined_and_a_mismatch_says_what_to_start() -> None:
    vllm_protocol.check_backend(ENGINE, _server_info({"backend": "dcs"}))
    for transfer, shown in (({"backend": "nccl"}, "'nccl'"), (None, "none (no --weight-transfer-config)")):
        with pytest.raises(VLLMBackendMismatch) as refused:
            vllm_protocol.check_backend(ENGINE, _server_info(transfer))
        message = str(refused.value)
        assert isinstance(refused.value, EngineIncompatible) and refused.value.member == "rollout_3"
        assert f"weight-transfer backend {shown}" in message
        assert (
            "pip install plugins/vllm-dcs" in message and '--weight-transfer-config \'{"backend": "dcs"}\'' in message
        )
    for payload in ({}, {"vllm_config": "VllmConfig(...)"}, []):  # text format or no config: not judged as dcs
        with pytest.raises(EngineIncompatible):
            vllm_protocol.check_backend(ENGINE, payload)
