"""bench/goodput.py's recovery figures: restore timed from this host's memory (sealed and hashed), from storage
with the page cache dropped, from a peer's memory (loopback and veth), and DCP's load."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.goodput_loop import AppState, DCPSaver, DCSSaver, Saver, Trainer, tensors_of, wait_until
from bench.goodput_stack import Stack, Veth, memory_settings
from dcs_tasks import Checkpointer
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

MiB = 1 << 20


# --- recovery --------------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """`sync; echo 1 > /proc/sys/vm/drop_caches` (root); False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def timed_restores(
    ckpt: Checkpointer, into: dict[str, Any] | None, step: int, repeats: int, before: Callable[[], object]
) -> dict[str, Any]:
    """`repeats` restores of `step` into `into` (None: into new tensors, the restored state dropped after each),
    `before()` untimed ahead of each; median and where they read. Into new tensors, also the time of a first write
    to every page of them afterwards (`first_write_s`): lent memory-tier pages are copied then (copy-on-write),
    as when training adopts them (`load_state_dict(..., assign=True)`) and its first optimizer step writes them."""
    runs, writes, locations = [], [], set()
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        restored = ckpt.restore(step=step, into=into)
        runs.append(time.perf_counter() - start)
        locations.add(str(restored.location))
        if restored.step != step:
            raise RuntimeError(f"restored step {restored.step}, not {step}")
        if into is None:
            start = time.perf_counter()
            touch_every_page(restored.state)
            writes.append(time.perf_counter() - start)
        del restored  # new tensors: freed (unmapped) before the next restore
    out = {"median_s": statistics.median(runs), "runs_s": runs, "locations": sorted(locations), "step": step}
    if writes:
        out["first_write_s"] = statistics.median(writes)
    return out


def touch_every_page(state: Any) -> None:
    """Rewrite one byte in every 4 KiB of every tensor of `state` (its own value: nothing changes but the pages)."""
    with torch.no_grad():
        for tensor in tensors_of(state):
            if tensor.numel() and tensor.is_contiguous() and tensor.device.type == "cpu":
                flat = tensor.view(-1).view(torch.uint8)
                flat[::4096] = flat[::4096].clone()


def recovery(
    trainer: Trainer,
    savers: dict[str, Saver],
    stack: Stack,
    veth: Veth | None,
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    into = trainer.state()
    repeats = args.recovery_repeats
    memory = savers.get("memory")
    if isinstance(memory, DCSSaver):
        trainer.step()
        memory.save(trainer)
        memory.drain()
        with Checkpointer(memory.ckpt.run, memory.ckpt.config) as fresh:  # sealed files: hashed on arrival only
            out["memory"] = timed_restores(fresh, into, trainer.global_step, repeats, lambda: None)
            out["memory_new"] = timed_restores(fresh, None, trainer.global_step, repeats, lambda: None)
        hashing = memory.ckpt.config.model_copy(update={"memory_restore_verify": "hash"})
        with Checkpointer(memory.ckpt.run, hashing) as fresh:  # every byte hashed again on restore
            out["memory_hashed"] = timed_restores(fresh, into, trainer.global_step, repeats, lambda: None)
            out["memory_new_hashed"] = timed_restores(fresh, None, trainer.global_step, repeats, lambda: None)
    storage = savers.get("storage")
    if isinstance(storage, DCSSaver) and storage.last_step is not None:
        with Checkpointer(storage.ckpt.run, storage.ckpt.config) as fresh:
            dropped = drop_page_cache()
            if not dropped:
                notes.append("page cache not dropped (not root): 'storage_cold' read warm files")
            out["storage_cold"] = timed_restores(fresh, into, storage.last_step, repeats, drop_page_cache)
            out["storage_cold"]["page_cache_dropped"] = dropped
            out["storage_warm"] = timed_restores(fresh, into, storage.last_step, repeats, lambda: None)
            out["storage_cold_new"] = timed_restores(fresh, None, storage.last_step, repeats, drop_page_cache)
    dcp_saver = savers.get("dcp")
    if isinstance(dcp_saver, DCPSaver) and dcp_saver.newest() is not None:
        out["dcp_load_cold"] = dcp_load(trainer, dcp_saver.newest(), repeats)  # type: ignore[arg-type]
    if isinstance(memory, DCSSaver) and not args.no_peer:
        out.update(peer_recovery(trainer, stack, veth, args, notes))
    if "memory" in out and "storage_cold" in out:
        out["storage_cold_vs_memory"] = out["storage_cold"]["median_s"] / out["memory"]["median_s"]
    if "memory_new" in out and "storage_cold_new" in out:
        out["storage_cold_vs_memory_new"] = out["storage_cold_new"]["median_s"] / out["memory_new"]["median_s"]
    for suffix, cold in (("", "storage_cold"), ("_new", "storage_cold_new")):
        if f"memory{suffix}_hashed" in out and cold in out:
            out[f"storage_cold_vs_memory{suffix}_hashed"] = (
                out[cold]["median_s"] / out[f"memory{suffix}_hashed"]["median_s"]
            )
    return out


def dcp_load(trainer: Trainer, checkpoint: Path, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    runs = []
    for _ in range(repeats):
        drop_page_cache()
        start = time.perf_counter()
        state = {"app": AppState(trainer.model, trainer.opt)}
        dcp.load(state, checkpoint_id=str(checkpoint))
        runs.append(time.perf_counter() - start)
    return {"median_s": statistics.median(runs), "runs_s": runs, "locations": ["dcp files"], "step": None}


def peer_recovery(
    trainer: Trainer, stack: Stack, veth: Veth | None, args: argparse.Namespace, notes: list[str]
) -> dict[str, Any]:
    """Host A (memory tier, `memory_replicas` = the number of peers) saves one step; its worker copies it to each
    peer's memory; A's worker stops (A is lost); a fresh trainer on host C restores the step, pulling it from a
    peer into C's memory (verified on arrival) and reading it from there. Loopback first (peer B); then, with a
    veth, B stops too and the pull comes from peer V in the network namespace."""
    from dcs_tasks.checkpoint.store.tiers import stepplaces

    shm = stack.memory_root
    state_bytes = trainer.saved_bytes()
    run = "goodput-peer"
    peers: list[tuple[str, str, str | None]] = [("peer-loopback", "bench-peer-b", None)]
    if veth is not None:
        peers.append(("peer-veth", "bench-peer-v", veth.name))
    for _, host, netns in peers:
        extra = {"peer_host": veth.inner} if netns and veth else {}
        stack.worker(
            host, args.worker_concurrency, netns, **memory_settings(args, state_bytes, shm / f"memory-{host}", **extra)
        )
    config_a = stack.worker(
        "bench-peer-a",
        args.worker_concurrency,
        **memory_settings(args, state_bytes, shm / "memory-a", memory_replicas=len(peers)),
    )
    trainer.step()
    step = trainer.global_step
    with Checkpointer(run, config_a) as ckpt_a:
        ckpt_a.save(trainer.state(), step=step).wait(timeout=600)
    client = sync_client(config_a)
    book = stepplaces.Places(client, Keys(config_a.redis.namespace))
    wanted = {stepplaces.peer_place(host) for _, host, _ in peers}
    wait_until(
        lambda: wanted <= book.read(run).get((step, 0), set()), 600, f"peer copies {sorted(wanted)} of step {step}"
    )
    stack.stop_worker("bench-peer-a")
    config_c = stack.config("bench-peer-c", **memory_settings(args, state_bytes, shm / "memory-c"))
    memory_c = Path(config_c.host.memory_dir)
    into = trainer.state()
    out: dict[str, Any] = {}
    with Checkpointer(run, config_c) as ckpt_c:
        for key, host, _ in peers:
            out[key] = timed_restores(
                ckpt_c, into, step, args.recovery_repeats, lambda: shutil.rmtree(memory_c / run, True)
            )
            expected = f"peer:{host}"
            if out[key]["locations"] != [expected]:
                notes.append(f"{key}: restores read {out[key]['locations']}, not {expected}")
            stack.stop_worker(host)
    client.close()
    return out
