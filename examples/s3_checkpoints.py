"""Checkpoints in an S3 bucket (Amazon S3 or an S3-compatible server): saved by the worker as multipart uploads,
restored by the trainer with ranged reads, both hashed on the way.

    export DCS_CHECKPOINT_DIR=s3://my-bucket/ckpt            # for `dcs up` (the worker writes) and this shell
    export DCS_S3_ENDPOINT_URL=http://127.0.0.1:9000 DCS_S3_ADDRESSING_STYLE=path   # an S3-compatible server
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...   # or any source of the standard AWS chain
    dcs up                                                   # another shell, with the same variables
    set -a; . .dcs-run/dcs.env; set +a
    python examples/s3_checkpoints.py

It saves three steps, lists them, restores the newest into the live model (`into=`) and checks it bit-exact.
Wrong credentials or a missing bucket are named errors (`StorageAccessDenied`, `StorageNotFound`).
"""

from __future__ import annotations

import argparse

import torch

from dcs_tasks import Checkpointer, DCSConfig
from dcs_tasks.storage_url import ObjectURL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="s3-example")
    args = parser.parse_args(argv)
    config = DCSConfig()
    if not isinstance(config.checkpoint.dir, ObjectURL):
        print(f"DCS_CHECKPOINT_DIR is {config.checkpoint.dir}, not an s3://bucket/prefix URL")
        return 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16))
    with Checkpointer(args.run, config) as ckpt:
        for step in (10, 20, 30):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            info = ckpt.save({"model": model.state_dict(), "step": step}, step=step).wait(120)
            print(f"step {step}: {info.path} ({info.nbytes} bytes)")
        print("committed:", [i.step for i in ckpt.list()])
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        restored = ckpt.restore(into={"model": model.state_dict(), "step": 0})  # fills the live tensors
    same = all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    print(f"restored step {restored.step} into the model; bit-exact: {same}")
    return 0 if same and restored.step == 30 else 1


if __name__ == "__main__":
    raise SystemExit(main())
