"""TensorFusion and bucketing: bit-exact round trips across dtypes, bucket limits, wire-rebuilt layouts."""

from __future__ import annotations

import torch

from dcs_tasks.backends.fusion import (
    ALIGNMENT,
    FusionLayout,
    TensorFusion,
    TensorSpec,
    pack_into,
    plan_buckets,
    unpack_views,
)


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], dtype=torch.float32)
    return {
        "w": torch.randn(3, 5, generator=g),
        "b16": torch.randn(7, generator=g).to(torch.bfloat16),
        "h": torch.randn(2, 3, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (4,), generator=g),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "special": special,
        "t": torch.randn(4, 6, generator=g).t(),  # non-contiguous
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_fuse_unfuse_is_bit_exact_for_mixed_dtypes_and_shapes() -> None:
    tensors = _mixed()
    buffer, layout = TensorFusion().fuse(tensors)
    assert buffer.dtype == torch.uint8
    back = TensorFusion().unfuse(buffer, layout)
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert _bits(back[name]) == _bits(tensor), name


def test_offsets_are_aligned_and_unfused_tensors_are_views() -> None:
    buffer, layout = TensorFusion().fuse(_mixed())
    assert all(off % ALIGNMENT == 0 for off in layout.offsets)
    views = unpack_views(buffer, layout)
    buffer.zero_()
    assert float(views["w"].abs().sum()) == 0.0


def test_layout_rebuilt_from_wire_lists_matches_sender() -> None:
    tensors = _mixed()
    fusion = TensorFusion()
    buffer, layout = fusion.fuse(tensors)
    wire = FusionLayout.from_wire(
        [s.name for s in layout.specs], [s.dtype for s in layout.specs], [list(s.shape) for s in layout.specs]
    )
    assert wire == layout
    assert buffer.numel() == wire.wire_bytes <= wire.total_bytes  # no trailing padding on the wire
    received = torch.empty(wire.total_bytes, dtype=torch.uint8)
    received[: wire.wire_bytes].copy_(buffer)
    assert _bits(unpack_views(received, wire)["i64"]) == _bits(tensors["i64"])


def test_should_fuse_follows_threshold_and_count() -> None:
    fusion = TensorFusion(threshold_bytes=1024)
    assert not fusion.should_fuse({"a": torch.zeros(1000)})
    assert fusion.should_fuse({"a": torch.zeros(200), "b": torch.zeros(200)})
    assert not fusion.should_fuse({"a": torch.zeros(10), "b": torch.zeros(10)})


def test_buckets_respect_size_and_a_big_tensor_goes_alone() -> None:
    specs = [TensorSpec(f"s{i}", "float32", (64,)) for i in range(10)]  # 256 B each
    specs.insert(4, TensorSpec("big", "float32", (1024,)))  # 4 KiB > bucket
    buckets = plan_buckets(specs, bucket_size_bytes=1024)
    assert [b.names for b in buckets][:3] == [["s0", "s1", "s2", "s3"], ["big"], ["s4", "s5", "s6", "s7"]]
    assert [n for b in buckets for n in b.names] == [s.name for s in specs]
    assert all(b.total_bytes <= 1024 for b in buckets if b.names != ["big"])


def test_pack_into_rejects_a_tensor_that_differs_from_the_layout() -> None:
    layout = FusionLayout.build([TensorSpec("a", "float32", (4,))])
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
    try:
        pack_into(buffer, layout, {"a": torch.zeros(5)})
    except ValueError as exc:
        assert "'a'" in str(exc)
    else:
        raise AssertionError("a shape mismatch must be refused")


def test_tensors_of_alone_bytes_get_their_own_bucket_whose_wire_size_is_the_tensor() -> None:
    specs = [TensorSpec("a", "float32", (10,)), TensorSpec("big", "bfloat16", (333,)), TensorSpec("b", "int8", (3,))]
    buckets = plan_buckets(specs, bucket_size_bytes=1 << 20, alone_bytes=600)
    assert [b.names for b in buckets] == [["a"], ["big"], ["b"]]
    assert buckets[1].wire_bytes == 666 and buckets[1].total_bytes == 704


def test_pack_into_a_used_buffer_is_bit_exact_and_zeroes_the_padding() -> None:
    """Packing (one copy call for the whole bucket) into a buffer that held other bytes: every tensor bit-exact
    (NaN payloads, -0.0, non-contiguous and empty tensors), the padding between tensors zero (before, it kept
    whatever the previous bucket left there), nothing past the wire bytes touched."""
    from dcs_tasks.backends.fusion import sglang_layout

    tensors = _mixed()
    for layout in (
        FusionLayout.build([TensorSpec.of(n, t) for n, t in tensors.items()], ALIGNMENT),
        sglang_layout([TensorSpec.of(n, t) for n, t in tensors.items()]),
    ):
        buffer = torch.full((layout.total_bytes + 16,), 0xAB, dtype=torch.uint8)
        view = pack_into(buffer, layout, tensors)
        assert view.data_ptr() == buffer.data_ptr() and view.numel() == layout.wire_bytes
        for name, out in unpack_views(view, layout).items():
            assert _bits(out) == _bits(tensors[name]), name
        used = torch.zeros(layout.wire_bytes, dtype=torch.bool)
        for spec, offset in zip(layout.specs, layout.offsets, strict=True):
            used[offset : offset + spec.nbytes] = True
        assert not view[~used].any(), "padding must be zero"
        assert bool((buffer[layout.wire_bytes :] == 0xAB).all())
