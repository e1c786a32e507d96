"""`BucketSender` -> `WeightReceiver`s over the in-process `LoopbackBackend`: both send modes, every dtype of
the table, SGLang's and DCS's bucket layouts, quantization, bucket boundaries, the typed report, and the
errors a receiver names. No processes, sockets or Redis (the gloo runs: tests/distributed/test_sync_dtypes.py,
tests/integration/test_weight_sync.py)."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dcs_tasks.backends.base import GroupSpec, RecvRequest, SendRequest
from dcs_tasks.backends.fusion import ALIGNMENT, SGLANG_ALIGNMENT, FusionLayout
from dcs_tasks.backends.loopback import LoopbackBackend, LoopbackHub
from dcs_tasks.client.engine import record_send
from dcs_tasks.errors import RequestRejected, WeightSyncError
from dcs_tasks.metrics import get_metrics
from dcs_tasks.sync.quantize import relative_error_bound
from dcs_tasks.sync.receiving import WeightReceiver, tensor_sha256
from dcs_tasks.sync.sender import ActorFwdDetails, BucketSender, RolloutDetails, SendReport, UpdateReport
from dcs_tasks.sync.wire import QuantizationConfig
from dcs_tasks.tensors import DTYPES, TensorSpec

GROUP = "g"
Lie = dict[str, tuple[str, list[int]]]  # tensor name -> (dtype, shape) a receiver is told instead of the truth


def table_state() -> dict[str, torch.Tensor]:
    """One tensor of every dtype of the table (odd sizes: misaligned offsets), a zero-element one and a big one."""
    gen = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for i, row in enumerate(DTYPES):
        raw = torch.randint(0, 256, (3 * (i + 1) * row.itemsize,), dtype=torch.uint8, generator=gen)
        state[f"t.{row.name}"] = raw.view(row.torch_dtype).reshape(3, -1)  # every bit pattern, NaNs included
    state["t.empty"] = torch.empty(0, 5)
    state["t.big"] = torch.randn(64, 64, generator=gen)  # 16 KiB: more than a bucket
    return state


class Scene:
    """A `BucketSender` (rank 0) and `receivers` `WeightReceiver`s in one loopback group."""

    def __init__(self, receivers: int = 2, bucket: int = 4096, alone: int | None = 2048, sglang: bool = False) -> None:
        backends = LoopbackHub().backends(1 + receivers, timeout_seconds=10.0)
        self.backend = backends[0]
        self.sender = BucketSender(self.backend, torch.device("cpu"), bucket, alone_bytes=alone, sglang=sglang)
        self.receivers = [WeightReceiver(b) for b in backends[1:]]
        size = 1 + receivers
        joins = [lambda: self.backend.create_group(GroupSpec(GROUP, "127.0.0.1", 0, size, 0))]
        for rank, receiver in enumerate(self.receivers, start=1):
            joins.append(lambda r=receiver, k=rank: r.init_group(GroupSpec(GROUP, "127.0.0.1", 0, size, k)))  # type: ignore[misc]
        with ThreadPoolExecutor(size) as pool:
            for joined in [pool.submit(join) for join in joins]:
                joined.result(timeout=30)
        self.alignment = SGLANG_ALIGNMENT if sglang else ALIGNMENT
        self.announced: list[list[str]] = []

    def push(
        self,
        state: Mapping[str, torch.Tensor],
        fused: bool = True,
        quant: QuantizationConfig | None = None,
        version: int = 1,
        lie: Lie | None = None,
    ) -> SendReport:
        """One update: each announcement makes every receiver receive its bucket (the last one names `version`
        and commits), as SGLang's and `dcs receiver`'s update request does."""

        async def announce(k: int, layout: FusionLayout, last: bool) -> None:
            self.announced.append(layout.names)
            told = [(lie or {}).get(s.name, (s.dtype, list(s.shape))) for s in layout.specs]
            meta = (layout.names, [d for d, _ in told], [s for _, s in told], GROUP, version if last else None)
            loop = asyncio.get_running_loop()
            receiving = [
                loop.run_in_executor(pool, functools.partial(r.receive_bucket, *meta, fused, self.alignment))
                for r in self.receivers
            ]
            await asyncio.gather(*receiving)
            if last:
                for r in self.receivers:
                    r.commit(version)

        # receivers block on their own threads (another process's, in production), never on the loop's executor,
        # whose threads the sender's waits may all hold
        with ThreadPoolExecutor(len(self.receivers)) as pool:
            send = self.sender.send_fused if fused else self.sender.send_per_tensor
            return asyncio.run(asyncio.wait_for(send(state, GROUP, announce, quant), 30))

    def assert_received(self, state: Mapping[str, torch.Tensor], version: int = 1) -> None:
        for receiver in self.receivers:
            assert receiver.weight_version == version
            got = receiver.weights
            assert list(sorted(got)) == sorted(state)
            for name, tensor in state.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
                assert tensor_sha256(got[name]) == tensor_sha256(tensor), name  # bit-exact


MODES = [
    pytest.param(True, False, id="fused-dcs"),
    pytest.param(True, True, id="fused-sglang"),
    pytest.param(False, False, id="per-tensor"),
]


@pytest.mark.parametrize(("fused", "sglang"), MODES)
def test_every_dtype_arrives_bit_exact_with_a_report_that_counts_it(fused: bool, sglang: bool) -> None:
    scene = Scene(sglang=sglang)
    state = table_state()
    report = scene.push(state, fused=fused)
    scene.assert_received(state)
    layouts = scene.sender.plan(state)
    assert report.mode == ("fused" if fused else "per_tensor")
    assert report.tensors == len(state) and report.buckets == len(layouts) == len(scene.announced)
    assert report.bytes == sum(TensorSpec.of(n, t).nbytes for n, t in state.items())
    assert report.broadcasts == (len(layouts) if fused else len(state))
    assert report.total_seconds > 0 and report.gb_per_s == report.bytes / report.total_seconds / 1e9
    assert set(report.as_dict()) == {
        "bytes",
        "tensors",
        "buckets",
        "pack_seconds",
        "wait_seconds",
        "broadcast_seconds",
        "gb_per_s",
    }
    # a second update reuses the group and the sender's buffers; the receivers swap it in whole
    again = {name: t.clone() for name, t in state.items()}
    again["t.float32"] += 1
    scene.push(again, fused=fused, version=2)
    scene.assert_received(again, version=2)


@pytest.mark.parametrize("sglang", [False, True], ids=["dcs", "sglang"])
def test_the_plan_is_kept_for_a_like_state_and_redone_when_a_tensor_changes_shape_or_layout(sglang: bool) -> None:
    """A second update of the same model reuses the first one's buckets (the same layout objects); a state
    whose tensor changed shape, or became non-contiguous, is planned again. Every update arrives bit-exact."""
    scene = Scene(sglang=sglang)
    state = table_state()
    scene.push(state)
    first = scene.sender.plan(state)
    again = {name: t.clone() for name, t in state.items()}
    assert all(a is b for a, b in zip(scene.sender.plan(again), first, strict=True))
    scene.push(again, version=2)
    scene.assert_received(again, version=2)
    reshaped = dict(again, **{"t.big": torch.randn(32, 128)})  # same bytes, another shape
    assert scene.sender.plan(reshaped) != first
    scene.push(reshaped, version=3)
    scene.assert_received(reshaped, version=3)
    strided = dict(reshaped, **{"t.big": torch.randn(128, 32).t()})  # same shape, not contiguous
    kept = scene.sender.plan(reshaped)
    assert not any(a is b for a, b in zip(scene.sender.plan(strided), kept, strict=True))
    scene.push(strided, version=4)
    scene.assert_received(strided, version=4)


def test_fp8_and_wide_uints_travel_as_uint8_views_per_tensor() -> None:
    """Over gloo these dtypes cannot be broadcast as themselves; the receiver's tensor is filled in place
    through its uint8 view (the same rule as `DeviceDirectBackend`)."""
    scene = Scene(receivers=1)
    wide = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)
    state = {str(d): torch.arange(40, dtype=torch.uint8).view(d) for d in wide}
    scene.push(state, fused=False)
    scene.assert_received(state)


def test_bucket_boundaries_follow_the_bucket_size() -> None:
    """DCS's layout aligns each tensor to 64 bytes; SGLang's packs them back to back."""
    exactly = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}  # 4 x 256 B: one 1 KiB bucket
    over = {**exactly, "w4": torch.ones(1)}  # 4 B more (64 B aligned): a second bucket
    for state, buckets in ((exactly, 1), (over, 2)):
        scene = Scene(receivers=1, bucket=1024, alone=None)
        report = scene.push(state)
        assert report.buckets == buckets and len(scene.announced) == buckets
        assert sum(map(len, scene.announced)) == len(state)
        scene.assert_received(state)
    packed = Scene(receivers=1, bucket=1028, alone=None, sglang=True)  # no padding: 1028 B fit one bucket
    assert packed.push(over).buckets == 1
    packed.assert_received(over)


def test_a_tensor_larger_than_a_bucket_goes_alone_from_its_own_memory() -> None:
    big = torch.randn(1024)  # 4 KiB, the bucket is 1 KiB
    state = {"big": big, "a": torch.ones(8), "b": torch.zeros(8)}
    for sglang in (False, True):
        scene = Scene(receivers=1, bucket=1024, alone=None, sglang=sglang)
        report = scene.push(state)
        assert scene.announced[0] == ["big"] and report.buckets == 2  # sent first, while the rest is packed
        scene.assert_received(state)
        # no copy of it: the flat buffers hold the fused bucket only (they used to grow to the big tensor)
        assert scene.sender.buffer_bytes <= 2 * 1024


def test_a_non_contiguous_tensor_larger_than_a_bucket_is_packed() -> None:
    state = {"t": torch.arange(2048, dtype=torch.float32).reshape(32, 64).t()}  # 8 KiB transposed view
    scene = Scene(receivers=1, bucket=1024, alone=None)
    scene.push(state)
    assert torch.equal(scene.receivers[0].weights["t"], state["t"])


def test_empty_state_sends_nothing_and_reports_zero() -> None:
    for fused in (True, False):
        scene = Scene(receivers=1)
        report = scene.push({}, fused=fused)
        assert (report.bytes, report.tensors, report.buckets, report.broadcasts) == (0, 0, 0, 0)
        assert scene.announced == [] and scene.receivers[0].weight_version == 0


@pytest.mark.parametrize("fused", [True, False])
def test_quantized_fp32_arrives_as_bf16_within_the_bound(fused: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(300, generator=gen), "ids": torch.arange(10), "h": torch.randn(7).half()}
    scene = Scene(receivers=1)
    report = scene.push(state, fused=fused, quant=QuantizationConfig(dtype="bfloat16"))
    got = scene.receivers[0].weights
    assert got["w"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64 and got["h"].dtype == torch.float16
    relative = ((got["w"].float() - state["w"]).abs() / state["w"].abs()).max().item()
    assert relative <= relative_error_bound("bfloat16")
    assert torch.equal(got["ids"], state["ids"]) and torch.equal(got["h"], state["h"])
    assert report.bytes == 300 * 2 + 10 * 8 + 7 * 2  # what crossed the wire: w as bf16


@pytest.mark.parametrize(
    ("fused", "lie", "said"),
    [
        (True, {"a": ("float32", [40])}, "receives uint8[208] (208 bytes) but rank 0 sends uint8[80]"),  # flat sizes
        (False, {"a": ("float32", [5])}, "receives float32[5] (20 bytes) but rank 0 sends float32[4]"),
        (False, {"a": ("int32", [4])}, "receives int32[4]"),  # same bytes, another dtype
    ],
)
def test_a_receiver_told_another_shape_or_dtype_fails_named_and_keeps_its_weights(
    fused: bool, lie: Lie, said: str
) -> None:
    state = {"a": torch.ones(4), "b": torch.ones(4)}
    scene = Scene(receivers=1, bucket=4096)
    scene.push(state, fused=fused)
    with pytest.raises(WeightSyncError, match=r"broadcast #\d+ in loopback group 'g'.*" + re.escape(said)):
        scene.push({n: t * 2 for n, t in state.items()}, fused=fused, version=2, lie=lie)
    receiver = scene.receivers[0]
    assert receiver.weight_version == 1 and torch.equal(receiver.weights["a"], state["a"])  # no partial update


def test_an_unknown_dtype_is_refused_before_any_receive() -> None:
    scene = Scene(receivers=1)
    with pytest.raises(RequestRejected, match="float7"):
        scene.receivers[0].receive_bucket(["a"], ["float7"], [[4]], GROUP, 1, True)


def test_a_member_that_never_joins_or_leaves_mid_update_is_named_without_waiting_out_the_timeout() -> None:
    lonely = LoopbackBackend(LoopbackHub(), group_init_timeout_seconds=0.2)
    with pytest.raises(WeightSyncError, match=r"ranks \[1\] never joined"):
        lonely.create_group(GroupSpec("solo", "127.0.0.1", 0, 2, 0))
    scene = Scene(receivers=1)
    scene.receivers[0].destroy_group(GROUP)  # e.g. the receiver process went away
    with pytest.raises(WeightSyncError, match="rank 1 left the group"):
        asyncio.run(asyncio.wait_for(scene.sender.send_fused({"a": torch.ones(4)}, GROUP), 5))


def test_point_to_point_send_checks_the_specs() -> None:
    backends = LoopbackHub().backends(2, timeout_seconds=5.0)
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(b.create_group, GroupSpec("p", "127.0.0.1", 0, 2, r)) for r, b in enumerate(backends)]:
            f.result()
    tensors = {"x": torch.arange(6, dtype=torch.uint8).view(torch.float8_e5m2), "y": torch.ones(2, 2)}
    backends[0].send(SendRequest(tensors, dst_rank=1, group_name="p"))
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    got = backends[1].recv(RecvRequest(0, ("x", "y"), "p", {"specs": specs}))
    assert all(tensor_sha256(got[n]) == tensor_sha256(t) for n, t in tensors.items())
    backends[0].send(SendRequest(tensors, dst_rank=1, group_name="p"))
    with pytest.raises(WeightSyncError, match="expected"):
        backends[1].recv(RecvRequest(0, ("x",), "p", {"specs": specs[:1]}))


def test_the_client_records_what_the_reports_say_and_returns_their_figures() -> None:
    sent = SendReport("fused", 100, 2, 1, 1, 0.1, 0.2, 0.5)
    details = RolloutDetails(2, 3, 0.7, "g1", group_rebuilt=True, flattened=True, phases={"begin_at": 0.01})
    merged = UpdateReport(sent, details).as_dict()
    assert merged["bytes"] == 100 and merged["broadcast_seconds"] == 0.5 and merged["engines"] == 2
    assert merged["weight_version"] == 3 and merged["group_name"] == "g1" and merged["begin_at"] == 0.01
    assert merged["total_seconds"] == 0.7 and merged["group_rebuilt"] is True
    nobody = RolloutDetails(engines=0, weight_version=3, total_seconds=0.0)
    assert UpdateReport(None, nobody).as_dict() == {"engines": 0, "weight_version": 3, "total_seconds": 0.0}
    assert UpdateReport(None, ActorFwdDetails(0)).as_dict() == {"actor_fwd_groups": 0}
    before = get_metrics().get_all()["counters"]
    record_send([UpdateReport(sent), UpdateReport(None, nobody)])  # nothing sent: nothing recorded
    after = get_metrics().get_all()["counters"]
    assert after["bytes_sent"] - before["bytes_sent"] == 100
    assert after["send_operations"] - before["send_operations"] == 1
