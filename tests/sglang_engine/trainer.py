"""A reference trainer written the way SGLang's own clients push weights (no DCS code), as a subprocess.

    python -m tests.sglang_engine.trainer SPEC.json

SPEC: {"sglang_dir", "engines": [{"url", "tp"}], "api_key", "group_name", "tensors": safetensors path,
"flattened": bool, "sessions": bool, "weight_version": str | null, "destroy": bool}. It is rank 0 of the
update group through SGLang's `init_custom_process_group` (so it hosts the TCPStore), POSTs
/init_weights_update_group to every engine (rank_offset 1, then 1 + tp of the engines before), opens a
session where asked, POSTs one /update_weights_from_distributed per engine while broadcasting the tensors
(an update with "die_after": k exits the process with status 3 after k broadcasts: a trainer crash)
(one broadcast per tensor in order, or SGLang's `FlattenedTensorBucket` as one uint8 broadcast), closes the
session, and prints one JSON object: every HTTP answer as [status, body].
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

from tests.sglang_engine.serve import STUBBED, sglang_path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post_all(engines: list[dict[str, Any]], http: httpx.Client, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """POST to every engine concurrently (the calls block until the collective they start completes)."""
    answers: list[Any] = [None] * len(engines)

    def call(i: int) -> None:
        try:
            response = http.post(f"{engines[i]['url']}{path}", json=bodies[i], timeout=120)
            answers[i] = [response.status_code, response.json()]
        except Exception as exc:
            answers[i] = [0, repr(exc)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(engines))]
    for thread in threads:
        thread.start()
    answers.append(threads)
    return answers


def _join(answers: list[Any]) -> list[Any]:
    for thread in answers.pop():
        thread.join(180)
    return answers


def _import_sglang(sglang_dir: str) -> tuple[Any, Any]:
    sys.path[:0] = sglang_path(sglang_dir)
    from tests.sglang_engine.stubs import install_stubs

    install_stubs(STUBBED)
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return init_custom_process_group, FlattenedTensorBucket


def _join_group(spec: dict[str, Any], http: httpx.Client, init_group: Any) -> tuple[Any, list[Any]]:
    """Rank 0 through SGLang's init_custom_process_group while every engine's init call runs."""
    engines, group = spec["engines"], spec["group_name"]
    port, world = _free_port(), 1 + sum(e["tp"] for e in engines)
    offsets = [1 + sum(e["tp"] for e in engines[:i]) for i in range(len(engines))]
    init = [
        dict(master_address="127.0.0.1", master_port=port, rank_offset=o, world_size=world, group_name=group,
             backend="gloo")
        for o in offsets
    ]  # fmt: skip
    pending = _post_all(engines, http, "/init_weights_update_group", init)
    pg = init_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=world,
        rank=0,
        group_name=group,
        timeout=timedelta(seconds=120),  # a broadcast nobody receives fails instead of waiting 30 min
    )
    return pg, _join(pending)


def _send(spec: dict[str, Any], update: dict[str, Any], http: httpx.Client, pg: Any, bucket_cls: Any) -> list[Any]:
    """One /update_weights_from_distributed per engine while the tensors are broadcast (unless `broadcast` is
    false: for an engine expected to refuse before receiving). `body` entries override the request body."""
    tensors = load_file(update["tensors"])
    names = update.get("order") or list(tensors)  # safetensors files do not keep insertion order
    body: dict[str, Any] = {
        "names": names,
        "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(tensors[n].shape) for n in names],
        "group_name": spec["group_name"],
        "weight_version": update.get("weight_version"),
    }
    if update.get("flattened"):
        body["load_format"] = "flattened_bucket"
    body.update(update.get("body", {}))
    pending = _post_all(spec["engines"], http, "/update_weights_from_distributed", [body] * len(spec["engines"]))
    if update.get("broadcast", True):
        if update.get("flattened"):
            bucket = bucket_cls(named_tensors=[(n, tensors[n]) for n in names])
            torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        else:
            for i, name in enumerate(names):
                if i == update.get("die_after"):  # a trainer crashing mid-update
                    time.sleep(1.0)
                    os._exit(3)
                torch.distributed.broadcast(tensors[name], src=0, group=pg)
    return _join(pending)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """SPEC as in the module doc; `updates` (a list of {tensors, flattened, broadcast, body, weight_version})
    may replace the single `tensors` update; their answers are under `updates`."""
    init_group, bucket_cls = _import_sglang(spec["sglang_dir"])
    engines, group = spec["engines"], spec["group_name"]
    headers = {"Authorization": f"Bearer {spec['api_key']}"} if spec.get("api_key") else {}
    http = httpx.Client(headers=headers)
    out: dict[str, Any] = {}
    pg, out["init"] = _join_group(spec, http, init_group)
    if spec.get("sessions"):
        out["begin"] = _join(_post_all(engines, http, "/begin_weight_update", [{}] * len(engines)))
    if "tensors" in spec:
        single = {k: spec[k] for k in ("tensors", "flattened", "weight_version") if k in spec}
        out["update"] = _send(spec, single, http, pg, bucket_cls)
    out["updates"] = [_send(spec, update, http, pg, bucket_cls) for update in spec.get("updates", [])]
    if spec.get("sessions"):
        out["end"] = _join(_post_all(engines, http, "/end_weight_update", [{}] * len(engines)))
    if spec.get("destroy", True):
        out["destroy"] = _join(
            _post_all(engines, http, "/destroy_weights_update_group", [{"group_name": group}] * len(engines))
        )
        torch.distributed.destroy_process_group(pg)
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
