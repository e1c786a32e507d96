"""Colocated-update benchmark: N GiB into a `dcs receiver` app by handle, against a copy of the same bytes.

Contenders, timed round by round (each round times both once; the order alternates):
  copy       one `dst.copy_(src)` of the update's bytes on the device (CUDA: device to device; CPU: a memcpy)
  colocated  `ColocatedSender.update` (dcs_tasks/sync/colocated.py) into DCS's receiver app in another
             process: pause, begin, per bucket pack into the trainer's shared bucket + POST
             /update_weights_from_ipc_frame (the receiver opens the handle, copies into its staging), end,
             continue; the last bucket commits. CUDA: CUDA IPC; CPU: torch's shared-memory file
The receiver is `create_receiver_app` served by uvicorn in a child process (the app `dcs receiver` serves,
without the coordinator registration, which a colocated update does not use). Target, on one GPU: colocated
within 1.2x the device-to-device copy of 1 GiB. On CPU the figure is the shared-memory path against a memcpy;
the CUDA figure is then not measured, and the result says so.

    python bench/colocated.py --gib 1 --device cuda:0      # one GPU
    python bench/colocated.py --gib 0.25 --device cpu      # CPU: shared memory
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO, Row, Run, free_port, stop, wait_for_port

MiB = 1024 * 1024
GiB = 1024 * MiB

RECEIVER = """
import sys, uvicorn, torch
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.sync.receiver.server import create_receiver_app
from dcs_tasks.sync.receiving import WeightReceiver
device = torch.device(sys.argv[2])
receiver = WeightReceiver(DeviceDirectBackend(), device=device)
uvicorn.run(create_receiver_app(receiver), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def model(total: int, tensor_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`total` bytes of float32 weights in tensors of `tensor_bytes` (a model's big matrices)."""
    count = max(1, total // tensor_bytes)
    return {f"layer.{i}.weight": torch.randn(tensor_bytes // 4, device=device) for i in range(count)}


async def colocated_rounds(
    url: str, state: dict[str, torch.Tensor], device: torch.device, bucket: int, rounds: int, copy_once: object
) -> tuple[list[float], list[float]]:
    from dcs_tasks.engine_http import EngineHTTP
    from dcs_tasks.sync.colocated import ColocatedEngine, ColocatedSender

    http = EngineHTTP()
    sender = ColocatedSender(device, bucket, http, release_seconds=600, call_seconds=60)
    ours: list[float] = []
    copies: list[float] = []
    try:
        for r in range(rounds):
            order = ("copy", "colocated") if r % 2 == 0 else ("colocated", "copy")
            for what in order:
                if what == "copy":
                    copies.append(copy_once())  # type: ignore[operator]
                else:
                    t0 = time.perf_counter()
                    await sender.update(state, [ColocatedEngine("rollout_0", url, "dcs")], r + 1)
                    ours.append(time.perf_counter() - t0)
    finally:
        await http.aclose()
    return ours, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--tensor-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    record = Run("colocated")
    total = int(args.gib * GiB)
    state = model(total, args.tensor_mb * MiB, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "receiver.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), args.device], env=env, stdout=out,
                                    stderr=out, cwd=REPO)  # fmt: skip
        try:
            wait_for_port(port, 120)
            ours, copies = asyncio.run(
                colocated_rounds(
                    f"http://127.0.0.1:{port}", state, device, args.bucket_mb * MiB, args.repeats + 2, copy_once
                )
            )
        finally:
            stop(proc)
    ours, copies = ours[2:], copies[2:]  # two warm-up rounds
    ours_s, copy_s = statistics.median(ours), statistics.median(copies)
    ratio = ours_s / copy_s
    cuda = device.type == "cuda"
    what = "device-to-device copy" if cuda else "memcpy"
    print(f"{nbytes / GiB:.2f} GiB on {device}: colocated {ours_s:.3f} s ({nbytes / ours_s / 1e9:.2f} GB/s), "
          f"{what} {copy_s:.3f} s ({nbytes / copy_s / 1e9:.2f} GB/s): {ratio:.2f}x")  # fmt: skip
    notes = (
        "CUDA IPC on one GPU."
        if cuda
        else "CPU: torch's shared-memory file and a memcpy. The CUDA IPC figure (target: within 1.2x a "
        "device-to-device copy of 1 GiB) was not measured in this run."
    )
    print(notes)
    row = Row(
        what=f"colocated update of {nbytes / GiB:.2f} GiB into dcs receiver ({device.type})",
        ours=f"{ours_s:.3f} s",
        compared=f"{what} {copy_s:.3f} s",
        ratio=ratio,
        ratio_text=f"{ratio:.2f}x the copy (lower is better)",
        target="<= 1.2x a device-to-device copy (one GPU)" if cuda else "none on CPU (CUDA target not measured)",
        met=(ratio <= 1.2) if cuda else None,
    )
    figures = {"bytes": nbytes, "device": str(device), "colocated_seconds": ours, "copy_seconds": copies,
               "bucket_bytes": args.bucket_mb * MiB, "tensor_bytes": args.tensor_mb * MiB}  # fmt: skip
    record.record(figures, [row], notes=notes, out=args.out)


if __name__ == "__main__":
    main()
