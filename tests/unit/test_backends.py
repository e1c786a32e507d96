"""CommHandle, group planning, quantization bounds, and WeightReceiver's no-partial-update contract.

The receiver tests use a real one-member gloo group (no other process needed, no mocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from dcs_tasks.backends.base import CommHandle, GroupSpec
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import (
    SGLANG_ALIGNMENT,
    FusionLayout,
    TensorFusion,
    TensorSpec,
    dtype_name,
    sglang_layout,
)
from dcs_tasks.config import RoleInfo
from dcs_tasks.errors import EngineIncompatible, WeightSyncError
from dcs_tasks.sync.engine_protocol import engine_info
from dcs_tasks.sync.planning import endpoint_of, plan_rollout_group
from dcs_tasks.sync.quantize import relative_error_bound, to_wire, wire_spec
from dcs_tasks.sync.receiving import WeightReceiver, tensor_sha256
from dcs_tasks.sync.wire import EngineEndpoint, QuantizationConfig
from tests.helpers.ports import free_port


def test_comm_handle_returns_result_once_and_reraises_errors() -> None:
    calls = []

    def work() -> int:
        calls.append(1)
        return 7

    handle = CommHandle(work)
    assert not handle.is_complete
    assert handle.wait() == 7 and handle.wait() == 7 and calls == [1]
    assert handle.is_complete and handle.error is None

    def boom() -> None:
        raise WeightSyncError("peer gone", member="rollout_1")

    failing = CommHandle(boom)
    with pytest.raises(WeightSyncError):
        failing.wait()
    with pytest.raises(WeightSyncError):
        asyncio.run(failing.wait_async())
    assert isinstance(failing.error, WeightSyncError) and failing.error.member == "rollout_1"


def test_rollout_group_offsets_follow_engine_rank_and_reported_tp_size() -> None:
    nodes = [
        RoleInfo(role_name="rollout", rank=2, ip="10.0.0.3", port=3, metadata={"num_gpus": 1}),  # ignored
        RoleInfo(role_name="rollout", rank=0, ip="10.0.0.1", port=1),
        RoleInfo(role_name="rollout", rank=1, ip="10.0.0.2", port=2),
    ]
    endpoints = [endpoint_of(n) for n in nodes]
    infos = {f"rollout_{r}": engine_info(endpoint_of(nodes[0]), server_info(tp)) for r, tp in ((0, 2), (1, 1), (2, 4))}
    plan = plan_rollout_group(endpoints, infos)
    assert plan.world_size == 1 + 2 + 1 + 4
    assert [(e.rank, e.rank_offset, e.tp_size) for e in plan.engines] == [(0, 1, 2), (1, 3, 1), (2, 4, 4)]
    moved = plan_rollout_group([*endpoints[:2], endpoints[2].model_copy(update={"port": 9})], infos)
    assert moved.signature != plan.signature  # a changed member forces a rebuild


@pytest.mark.parametrize(
    ("token", "read"),
    [("a1b2", "a1b2"), (None, ""), (7, ""), ("x" * 65, ""), ("../etc", ""), ("white space", ""), ("", "")],
)
def test_an_engine_restarted_at_the_same_address_changes_the_signature_unless_its_token_is_unusable(
    token: object, read: str
) -> None:
    """A registration's `metadata["instance"]` is part of the group signature, so a restarted engine (a new
    token at the old address) forces a rebuild; a token that is not a short [A-Za-z0-9_.-] string, from a
    hand-edited or hostile Redis record, is read as none and breaks nothing."""
    metadata = {} if token is None else {"instance": token}
    node = RoleInfo(role_name="rollout", rank=0, ip="10.0.0.1", port=1, metadata=metadata)
    assert endpoint_of(node).instance == read
    infos = {"rollout_0": engine_info(endpoint_of(node), server_info())}
    plan = plan_rollout_group([endpoint_of(node)], infos)
    restarted = node.model_copy(update={"metadata": {"instance": "c3d4"}})
    assert plan_rollout_group([endpoint_of(restarted)], infos).signature != plan.signature
    same = node.model_copy(update={"metadata": dict(metadata, num_gpus=2)})  # other metadata: not read
    assert plan_rollout_group([endpoint_of(same)], infos).signature == plan.signature


def server_info(tp_size: int = 1, version: str = "0.5.23", **extra: object) -> dict[str, object]:
    return {"version": version, "tp_size": tp_size, "dp_size": 1, "pp_size": 1, "api_key": "secret", **extra}


def test_engine_protocol_follows_the_sglang_version_and_refuses_what_it_cannot_push_to() -> None:
    engine = EngineEndpoint(rank=3, ip="10.0.0.1", port=1)
    old = engine_info(engine, server_info(version="0.5.20"))
    assert old.sessions is False and old.pause_mode == "abort"  # 0.5.20's flush asserts an empty queue
    assert engine_info(engine, server_info(version="0.5.21")).pause_mode == "retract"
    assert all(engine_info(engine, server_info(version=v)).sessions for v in ("0.5.21", "0.5.22", "0.5.23"))
    for bad in (server_info(version="0.5.19"), server_info(version="0.6.0"), server_info(dp_size=2), {"tp_size": 1}):
        with pytest.raises(EngineIncompatible) as refused:
            engine_info(engine, bad)
        assert refused.value.member == "rollout_3" and "secret" not in str(refused.value)


def test_sglang_flat_layout_orders_by_itemsize_so_every_offset_is_aligned() -> None:
    specs = [TensorSpec("a", "int8", (3,)), TensorSpec("b", "float32", (5,)), TensorSpec("c", "bfloat16", (1,))]
    layout = sglang_layout(specs)
    assert layout.names == ["b", "c", "a"] and layout.offsets == (0, 20, 22) and layout.wire_bytes == 25
    wire = FusionLayout.from_wire(layout.names, ["float32", "bfloat16", "int8"], [[5], [1], [3]], SGLANG_ALIGNMENT)
    assert wire.offsets == layout.offsets
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        FusionLayout.from_wire(["a", "b"], ["int8", "float32"], [[3], [5]], SGLANG_ALIGNMENT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_transfer_stays_within_its_documented_bound(dtype: str) -> None:
    config = QuantizationConfig(dtype=dtype)
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 10
    wired = to_wire(x, config)
    assert dtype_name(wired.dtype) == dtype
    rel = ((wired.float() - x).abs() / x.abs().clamp_min(1e-3)).max().item()
    assert rel <= relative_error_bound(dtype)
    assert wire_spec(TensorSpec("x", "float32", (3,)), config).dtype == dtype
    ints = torch.arange(5)
    assert to_wire(ints, config) is ints  # only source dtypes are cast


@pytest.fixture
def solo_receiver() -> Iterator[WeightReceiver]:
    backend = DeviceDirectBackend(timeout_seconds=10, group_init_timeout_seconds=10)
    receiver = WeightReceiver(backend)
    receiver.init_group(GroupSpec("solo", "127.0.0.1", free_port(), 1, 0))
    yield receiver
    backend.close()


def _bucket(receiver: WeightReceiver, tensors: dict[str, torch.Tensor], version: int | None) -> int:
    buffer, layout = TensorFusion().fuse(tensors)
    names, dtypes = layout.names, [s.dtype for s in layout.specs]
    shapes = [list(s.shape) for s in layout.specs]
    # world size 1: the broadcast is a real no-op collective; we pre-fill the buffer the receiver will get
    spare = torch.empty(layout.total_bytes, dtype=torch.uint8)
    spare[: buffer.numel()].copy_(buffer)
    receiver._spare = [spare]
    return receiver.receive_bucket(names, dtypes, shapes, "solo", version, flattened=True)


def test_receiver_commits_only_a_complete_update(solo_receiver: WeightReceiver) -> None:
    a = {"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16)}
    _bucket(solo_receiver, a, version=1)
    assert solo_receiver.weight_version == 0 and solo_receiver.weights == {}  # staged, not visible
    solo_receiver.commit(1)
    version, digest = solo_receiver.digest()
    assert version == 1 and digest == {n: tensor_sha256(t) for n, t in a.items()}

    _bucket(solo_receiver, {"w": torch.zeros(4, 3)}, version=2)
    _bucket(solo_receiver, {"w": torch.ones(4, 3)}, version=3)  # v2 abandoned for v3
    with pytest.raises(WeightSyncError):
        solo_receiver.commit(2)
    assert solo_receiver.digest() == (1, digest)
    solo_receiver.abort()
    with pytest.raises(WeightSyncError):
        solo_receiver.commit(3)
    assert solo_receiver.digest() == (1, digest)


def test_unversioned_buckets_join_the_update_the_last_bucket_names(solo_receiver: WeightReceiver) -> None:
    """SGLang's senders name weight_version on the last bucket only: earlier, unversioned buckets belong to
    that update (not to an abandoned committed+1), and an update never named commits as committed+1."""
    a, b = {"a": torch.randn(3)}, {"b": torch.randn(5)}
    assert _bucket(solo_receiver, a, version=None) == 1  # provisional: committed + 1
    assert _bucket(solo_receiver, b, version=7) == 7  # the trainer is further along: the update is v7
    solo_receiver.commit(7)
    version, digest = solo_receiver.digest()
    assert version == 7 and set(digest) == {"a", "b"}

    assert _bucket(solo_receiver, {"a": torch.zeros(3)}, version=None) == 8
    assert _bucket(solo_receiver, {"b": torch.zeros(5)}, version=None) == 8
    solo_receiver.commit(8)
    assert solo_receiver.weight_version == 8 and torch.equal(solo_receiver.weights["b"], torch.zeros(5))

    _bucket(solo_receiver, {"a": torch.ones(3)}, version=9)
    assert _bucket(solo_receiver, {"b": torch.ones(5)}, version=None) == 9  # joins the named update
    _bucket(solo_receiver, {"a": torch.full((3,), 2.0)}, version=10)  # a new name abandons v9
    with pytest.raises(WeightSyncError):
        solo_receiver.commit(9)
    assert solo_receiver.weight_version == 8


def test_actor_fwd_receiver_refuses_weights_whose_names_do_not_match_its_model() -> None:
    from dcs_tasks.sync.actor_fwd import ActorFwdReceiver

    model = torch.nn.Linear(3, 2)
    receiver = WeightReceiver(DeviceDirectBackend())
    fwd = ActorFwdReceiver(api=None, receiver=receiver, timeout_seconds=1, model=model)  # type: ignore[arg-type]
    receiver.weights = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    fwd.apply_weights()
    assert torch.equal(model.weight, torch.ones(2, 3))
    receiver.weights = {"module.weight": torch.full((2, 3), 2.0), "bias": torch.ones(2)}
    with pytest.raises(WeightSyncError, match=r"missing \['weight'\].*unexpected \['module.weight'\]"):
        fwd.apply_weights()


def test_active_connections_gauge_counts_the_groups_held() -> None:
    from dcs_tasks.metrics import get_metrics

    def held() -> float:
        return get_metrics().registry.get_sample_value("dcs_active_connections") or 0.0

    before = held()
    backend = DeviceDirectBackend(timeout_seconds=10, group_init_timeout_seconds=10)
    backend.create_group(GroupSpec("gauge", "127.0.0.1", free_port(), 1, 0))
    assert held() == before + 1
    backend.close()
    assert held() == before
