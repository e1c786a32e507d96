"""The memory tier on one host (`memory_tier_bytes`): each step is committed in `memory_dir` first, storage gets
every Nth step (and `durable=True` ones), restore reads memory first and names it, a killed trainer and a restarted
worker find the memory steps again, a full budget sends steps to storage and evicts only steps held elsewhere, and a
restore at another world size reads memory copies. What the worker's code does is run by an in-process committer
(`inline`); a killed trainer, a restarted worker and peer copies between hosts run against real `dcs worker`s."""

from __future__ import annotations

import os
import shutil
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import SecretStr

from dcs_tasks import Checkpointer
from dcs_tasks.checkpoint.format.layout import step_dir_name
from dcs_tasks.checkpoint.restore.reader import step_dirs
from dcs_tasks.checkpoint.restore.sharded import rank_dir_name
from dcs_tasks.checkpoint.store.tiers import memdir, peerchoice, stepplaces
from dcs_tasks.checkpoint.store.tiers.seal import SEAL_NAME, read_seals
from dcs_tasks.config import DCSConfig
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client
from tests.checkpoint_support import (
    Inline,
    assert_same_state,
    ckpt_config,
    dcs_ckpt,
    start_worker,
    training_state,
    wait_until,
)
from tests.helpers.preloaded import python_module
from tests.helpers.procs import child_env
from tests.helpers.shm import shm_dir

pytestmark = pytest.mark.integration

MiB = 1 << 20


def memory_config(base: DCSConfig, tmp_path: Path, **overrides: Any) -> DCSConfig:
    values: dict[str, Any] = {
        "memory_tier_bytes": 64 * MiB,
        "memory_dir": shm_dir(tmp_path) / "memory",
        "memory_keep_last": 2,
        "storage_every_steps": 4,
        "file_shard_bytes": MiB,
        "incremental_saves": False,
    }
    return ckpt_config(base, tmp_path, **{**values, **overrides})


def memory_steps(config: DCSConfig, run: str, rank: int | None = None) -> list[int]:
    run_dir = Path(config.host.memory_dir) / run
    return [s for s, _ in step_dirs(run_dir / rank_dir_name(rank) if rank is not None else run_dir)]


def storage_steps(config: DCSConfig, run: str, rank: int | None = None) -> list[int]:
    run_dir = Path(config.checkpoint.dir) / run
    return [s for s, _ in step_dirs(run_dir / rank_dir_name(rank) if rank is not None else run_dir)]


def places(config: DCSConfig, run: str) -> dict[tuple[int, int], set[str]]:
    client = sync_client(config)
    try:
        return stepplaces.Places(client, Keys(config.redis.namespace)).read(run)
    finally:
        client.close()


def test_steps_commit_in_memory_and_every_nth_reaches_storage(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = memory_config(dcs_config, tmp_path)
    committer = inline(config)
    states = {s: training_state(seed=s, width=256) for s in range(1, 9)}
    try:
        with Checkpointer("mem", config, celery_app=committer) as ckpt:
            pendings = {}
            for step, state in states.items():
                pendings[step] = ckpt.save(state, step=step)
                info = pendings[step].wait(timeout=120)
                assert step in memory_steps(config, "mem")  # restorable from memory once the save completes
                # what completed is the memory copy (a durable step's storage copy may not be there yet)
                assert info.path == Path(config.host.memory_dir) / "mem" / step_dir_name(step) and not info.removed
            wait_until(lambda: storage_steps(config, "mem") == [4, 8], 120, "steps 4 and 8 in storage")
            # the newest two stay; older ones leave once step 8, newer and in storage, covers them
            wait_until(lambda: memory_steps(config, "mem") == [7, 8], 60, "memory to hold steps 7 and 8")
            info = pendings[4].wait(timeout=10)  # gone from memory: its storage copy answers
            assert info.path == Path(config.checkpoint.dir) / "mem" / step_dir_name(4) and not info.removed
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (8, "memory")
            assert_same_state(restored.state, states[8])
            assert ckpt.restore(step=4).location == "primary"  # only storage holds it now
            assert_same_state(ckpt.restore(step=4).state, states[4])
        found = places(config, "mem")
        assert found[(8, 0)] == {"mem@testhost", "storage"}
        assert found[(7, 0)] == {"mem@testhost"}
        assert (5, 0) not in found  # it left memory, and storage never had it
        lines = {int(line.split()[0]): line for line in dcs_ckpt(config, "list", "--run", "mem").stdout.splitlines()}
        assert "memory+primary" in lines[8] and "mem@testhost storage" in lines[8]
        assert "memory" in lines[7] and "primary" not in lines[7]
        assert "primary" in lines[4] and "memory" not in lines[4]
    finally:
        committer.close()


def test_a_durable_save_and_the_time_rule_reach_storage(dcs_config: DCSConfig, tmp_path: Path, inline: Inline) -> None:
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000, storage_every_seconds=3600.0)
    committer = inline(config)
    state = training_state(seed=3, width=128)
    try:
        with Checkpointer("ondemand", config, celery_app=committer) as ckpt:
            ckpt.save(state, step=1).wait(timeout=120)
            ckpt.save(state, step=2, durable=True).wait(timeout=120)
            wait_until(lambda: storage_steps(config, "ondemand") == [2], 120, "step 2 in storage")
            ckpt._last_durable -= 3600  # an hour since the last step sent to storage
            ckpt.save(state, step=3).wait(timeout=120)
            wait_until(lambda: storage_steps(config, "ondemand") == [2, 3], 120, "step 3 in storage (time rule)")
    finally:
        committer.close()


TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from dcs_tasks import Checkpointer
    from dcs_tasks.config import DCSConfig
    from tests.checkpoint_support import training_state

    ckpt = Checkpointer("killed", DCSConfig())
    for step in (1, 2, 3):
        ckpt.save(training_state(seed=step, width=256), step=step).wait(timeout=120)
    print("saved", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_trainer_restores_from_its_hosts_memory(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000)
    worker = start_worker(config, tmp_path)
    # the trainer is forked from the forkserver that imported torch (tests/helpers/preloaded.py)
    log = tmp_path / "trainer.log"
    trainer = python_module("tests.helpers.code_main", TRAINER, log=log, env=child_env(config))
    try:
        wait_until(lambda: "saved" in trainer.output() or trainer.poll() is not None, 120, "the trainer's 3 saves")
        assert trainer.poll() is None and "saved" in trainer.output().splitlines(), trainer.output()
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert storage_steps(config, "killed") == []  # nothing reached storage: memory only
        with Checkpointer("killed", config) as ckpt:
            assert [info.step for info in ckpt.list()] == [1, 2, 3]  # the README's `if ckpt.list(): restore()`
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (3, "memory")
            assert_same_state(restored.state, training_state(seed=3, width=256))
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=30)
        worker.discard()


def test_a_restarted_worker_finds_its_memory_steps_again(dcs_config: DCSConfig, tmp_path: Path) -> None:
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000, auth_token=SecretStr("memory-tier-token"))
    worker = start_worker(config, tmp_path)
    states = {s: training_state(seed=10 + s, width=128) for s in (1, 2)}
    try:
        with Checkpointer("restart", config) as ckpt:
            for step, state in states.items():
                ckpt.save(state, step=step).wait(timeout=120)
        worker.kill()  # kill -9: tmpfs keeps the steps
        client = sync_client(config)
        client.delete(Keys(config.redis.namespace).step_places("restart"))  # Redis lost where they live
        client.close()
        worker = start_worker(config, tmp_path, name="worker2")
        wait_until(lambda: (2, 0) in places(config, "restart"), 60, "the restarted worker to record step 2 again")
        assert places(config, "restart")[(2, 0)] == {"mem@testhost"}
        with Checkpointer("restart", config) as ckpt:
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (2, "memory")
            assert_same_state(restored.state, states[2])
            ckpt.save(states[1], step=3).wait(timeout=120)  # the restarted worker serves new saves
            assert memory_steps(config, "restart") == [1, 2, 3]  # held nowhere else: none may leave
    finally:
        worker.discard()


def test_a_full_budget_sends_the_step_to_storage_and_evicts_only_covered_steps(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    state = training_state(seed=5, width=256)
    with Checkpointer("probe", memory_config(dcs_config, tmp_path, memory_tier_bytes=0)) as probe:
        step_bytes = probe._layout(probe._flatten(state)).nbytes
    config = memory_config(
        dcs_config, tmp_path, memory_tier_bytes=int(step_bytes * 2.5), memory_keep_last=5, storage_every_steps=1000
    )
    committer = inline(config)
    try:
        with Checkpointer("full", config, celery_app=committer) as ckpt:
            ckpt.save(state, step=1).wait(timeout=120)
            ckpt.save(state, step=2).wait(timeout=120)
            assert memory_steps(config, "full") == [1, 2]  # neither may leave: nothing else holds them
            ckpt.save(state, step=3).wait(timeout=120)  # does not fit: storage only
            assert storage_steps(config, "full") == [3] and 3 not in memory_steps(config, "full")
            # step 3 in storage covers step 1, which leaves; step 2 stays (the newest in memory)
            wait_until(lambda: memory_steps(config, "full") == [2], 60, "step 1 to leave memory")
            ckpt.save(state, step=4).wait(timeout=120)  # fits again
            # step 2 leaves too: covered by step 3 in storage, and the budget keeps room for the next save
            wait_until(lambda: memory_steps(config, "full") == [4], 60, "step 2 to leave memory")
            assert storage_steps(config, "full") == [3]
            assert ckpt.restore().location == "memory"
            for step, where in ((3, "primary"), (4, "memory")):
                restored = ckpt.restore(step=step)
                assert restored.location == where
                assert_same_state(restored.state, state)
    finally:
        committer.close()


def test_a_restore_at_another_world_size_reads_memory_copies(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000)
    committer = inline(config)
    full = torch.arange(4096 * 8, dtype=torch.float32).reshape(4096, 8)
    try:
        ranks = [Checkpointer("resharded", config, rank=r, world_size=2, celery_app=committer) for r in range(2)]
        pending = [c.save({"w": full.chunk(2)[c.rank].clone()}, step=1, sharding={"w": 0}) for c in ranks]
        for p in pending:
            p.wait(timeout=120)
        for c in ranks:
            c.close()
        assert memory_steps(config, "resharded", 0) == [1] and storage_steps(config, "resharded", 0) == []
        with Checkpointer("resharded", config, celery_app=committer) as single:
            restored = single.restore()
            assert restored.location == "memory"
            assert torch.equal(restored.state["w"], full)
    finally:
        committer.close()


TOKEN = "memory-tier-peers-token"


def host_config(base: DCSConfig, tmp_path: Path, host: str, **overrides: Any) -> DCSConfig:
    """Host `host` of a fleet on this machine: its own node queue and memory directory, the shared storage."""
    values: dict[str, Any] = {
        "node_name": host,
        "memory_dir": shm_dir(tmp_path) / f"memory-{host}",
        "auth_token": SecretStr(TOKEN),
        "memory_replicas": 1,
        "storage_every_steps": 1000,
    }
    return memory_config(base, tmp_path, **{**values, **overrides})


def registered(config: DCSConfig) -> set[str]:
    client = sync_client(config)
    try:
        return set(peerchoice.peers(client, Keys(config.redis.namespace)))
    finally:
        client.close()


def test_steps_are_copied_to_a_peer_and_a_lost_hosts_rank_restores_from_it(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    small = {s: training_state(seed=20 + s, width=128) for s in (1, 2)}
    big = training_state(seed=23, width=1024)  # more than host b's whole budget: b refuses to hold it
    with Checkpointer("probe", memory_config(dcs_config, tmp_path, memory_tier_bytes=0)) as probe:
        small_bytes = probe._layout(probe._flatten(small[1])).nbytes
    a = host_config(dcs_config, tmp_path, "hosta")
    b = host_config(dcs_config, tmp_path, "hostb", memory_tier_bytes=3 * small_bytes)
    workers = {"a": start_worker(a, tmp_path, name="worker-a"), "b": start_worker(b, tmp_path, name="worker-b")}
    try:
        wait_until(lambda: registered(a) == {"hosta", "hostb"}, 60, "both peer servers to register")
        with Checkpointer("peer", a) as ckpt:
            for step, state in small.items():
                ckpt.save(state, step=step).wait(timeout=120)
            wait_until(lambda: "replicated" in places(a, "peer").get((2, 0), set()), 120, "step 2 to replicate")
            assert places(a, "peer")[(2, 0)] == {"mem@hosta", "peer@hostb", "replicated"}
            copy, own = (
                Path(b.host.memory_dir) / "peer" / "step-000000002",
                Path(a.host.memory_dir) / "peer" / "step-000000002",
            )
            assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in own.iterdir())
            assert all((copy / p.name).read_bytes() == p.read_bytes() for p in own.iterdir() if p.name != SEAL_NAME)
            for step_dir in (own, copy):  # each host sealed its own copy once its bytes verified
                stamps = read_seals(step_dir)
                assert stamps and all(s.holds((step_dir / n).stat()) for n, s in stamps.items())

            ckpt.save(big, step=3).wait(timeout=120)  # committed in a's memory, refused by b: not replicated
            wait_until(lambda: "copying" not in places(a, "peer").get((3, 0), {"copying"}), 120, "step 3's copy")
            assert places(a, "peer")[(3, 0)] == {"mem@hosta"}
            assert ckpt.restore().step == 3  # host a itself still restores it
        assert storage_steps(a, "peer") == []

        # host a is lost (its worker killed, its memory gone): a replacement rank on host c restores the newest
        # step that is complete somewhere, step 2, from host b's memory
        workers["a"].kill()
        shutil.rmtree(a.host.memory_dir)
        c = host_config(dcs_config, tmp_path, "hostc")
        with Checkpointer("peer", c) as replacement:
            restored = replacement.restore()
            assert (restored.step, restored.location) == (2, "peer:hostb")
            assert_same_state(restored.state, small[2])
            assert replacement.restore(step=2).location == "memory"  # now in host c's memory too
    finally:
        for worker in workers.values():
            worker.discard()


def _mapped_files() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


def test_a_restore_from_memory_lends_the_pages_and_they_keep_their_bytes_while_the_step_leaves(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """Without `into=`, a memory-tier restore's tensors are copy-on-write views of the step's tmpfs files (no
    copy: that is what makes recovery from memory fast). Writing to them leaves the step as committed; when the
    step leaves memory and newer saves of the same size reuse the tier's pages, the lent files are not among
    them: the restored tensors keep their bytes."""
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1, memory_keep_last=1)
    committer = inline(config)
    states = {s: training_state(seed=20 + s, width=256) for s in (1, 2, 3, 4)}
    try:
        with Checkpointer("lent", config, celery_app=committer) as ckpt:
            ckpt.save(states[1], step=1).wait(timeout=120)
            restored = ckpt.restore()
            assert (restored.step, restored.location) == (1, "memory")
            assert str(Path(config.host.memory_dir) / "lent" / "step-000000001") in _mapped_files()
            assert_same_state(restored.state, states[1])
            weight = restored.state["model"]["0.weight"]
            before = weight.clone()
            weight.add_(1.0)  # the caller's copy of the page; the step keeps its bytes
            assert_same_state(ckpt.restore(step=1).state, states[1])
            weight.copy_(before)
            for step in (2, 3, 4):
                ckpt.save(states[step], step=step).wait(timeout=120)
            wait_until(lambda: memory_steps(config, "lent") == [4], 120, "steps 1-3 to leave memory")
            wait_until(lambda: storage_steps(config, "lent") == [1, 2, 3, 4], 120, "every step in storage")
            lent_lines = [line for line in _mapped_files().splitlines() if "/lent/step-000000001/" in line]
            assert lent_lines and all(line.endswith("(deleted)") for line in lent_lines)  # deleted, not recycled
            assert memdir.RECYCLE_DIR not in _mapped_files()
            assert memdir.recycled_bytes(memdir.memory_root(config)) > 0  # steps 2 and 3 were recycled meanwhile
            assert_same_state(restored.state, states[1])  # what was lent never changed
            assert_same_state(ckpt.restore(step=4).state, states[4])
    finally:
        committer.close()


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the memory-tier files a restore hashes (`lend._check` of a lent file, or `verified.read_scatter`, the
    hashed read into `into=`), recorded as it runs."""
    from dcs_tasks.checkpoint.restore import lend
    from dcs_tasks.checkpoint.store.reads import verified

    hashed: list[str] = []
    check, scatter = lend._check, verified.read_scatter

    def counting(path: Path, entry: Any, mapping: Any) -> None:
        hashed.append(path.name)
        check(path, entry, mapping)

    def reading(files: list[Any], verify: bool, progress: Any = None) -> None:
        hashed.extend(path.name for path, _, _ in files)
        scatter(files, verify, progress)

    monkeypatch.setattr(lend, "_check", counting)
    monkeypatch.setattr(verified, "read_scatter", reading)
    return hashed


def _flip_a_byte(path: Path, at: int) -> None:
    os.chmod(path, 0o644)  # sealed 0444; root could write anyway, the chmod alone already breaks the seal
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("into", [False, True], ids=["new-tensors", "into"])
def test_a_sealed_memory_step_is_not_hashed_again_and_any_later_change_is_still_caught(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool, inline: Inline
) -> None:
    """A memory-tier file was hashed on its way in; the commit seals it (read-only, its stamp in `seal.json`), and
    a restore that finds the stamp unchanged does not hash it again. A write to the file after that (here: chmod
    and one flipped byte, as a stray writer would) moves the stamp, so that restore hashes it, finds the
    mismatch and falls back to the previous step, warning."""
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000)
    committer = inline(config)
    states = {s: training_state(seed=40 + s, width=512) for s in (1, 2)}  # 3 MiB: 3 files of 1 MiB
    try:
        with Checkpointer("sealed", config, celery_app=committer) as ckpt:
            for step, state in states.items():
                ckpt.save(state, step=step).wait(timeout=120)
            step_dir = Path(config.host.memory_dir) / "sealed" / "step-000000002"
            files = sorted(p.name for p in step_dir.glob("*.safetensors"))
            assert len(files) > 1 and sorted(read_seals(step_dir)) == files
            assert all((step_dir / name).stat().st_mode & 0o777 == 0o444 for name in files)

            hashed = _count_hashes(monkeypatch)
            target = training_state(seed=0, width=512) if into else None
            restored = ckpt.restore(into=target)
            assert (restored.step, restored.location, hashed) == (2, "memory", [])
            assert_same_state(restored.state, states[2])

            biggest = max(files, key=lambda name: (step_dir / name).stat().st_size)
            _flip_a_byte(step_dir / biggest, 4096)
            with pytest.warns(RuntimeWarning, match="step 2"):
                restored = ckpt.restore(into=training_state(seed=0, width=512) if into else None)
            assert restored.step == 1 and sorted(hashed) == (files if into else [biggest])
            assert_same_state(restored.state, states[1])
    finally:
        committer.close()


def test_memory_restore_verify_hash_hashes_every_file_and_a_bad_seal_record_only_costs_the_hash(
    dcs_config: DCSConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: Inline
) -> None:
    config = memory_config(dcs_config, tmp_path, storage_every_steps=1000)
    committer = inline(config)
    state = training_state(seed=50, width=256)
    try:
        with Checkpointer("hashed", config, celery_app=committer) as ckpt:
            ckpt.save(state, step=1).wait(timeout=120)
        step_dir = Path(config.host.memory_dir) / "hashed" / "step-000000001"
        files = sorted(p.name for p in step_dir.glob("*.safetensors"))
        hashed = _count_hashes(monkeypatch)
        with Checkpointer(
            "hashed", config.model_copy(update={"memory_restore_verify": "hash"}), celery_app=committer
        ) as ckpt:
            assert_same_state(ckpt.restore().state, state)
        assert sorted(hashed) == files

        seal = step_dir / SEAL_NAME
        good = seal.read_bytes()
        for bad in (
            b"\xff not json",
            b"[]",
            b'{"format":1,"files":{"x":[true,1,2,3]}}',
            b"{" * 100_000,
            b" " * (2 << 20),
        ):
            seal.write_bytes(bad)
            hashed.clear()
            with Checkpointer("hashed", config, celery_app=committer) as ckpt:
                restored = ckpt.restore()
            assert (restored.step, sorted(hashed)) == (1, files), bad[:40]
            assert_same_state(restored.state, state)
        seal.write_bytes(good)
        hashed.clear()
        with Checkpointer("hashed", config, celery_app=committer) as ckpt:
            assert_same_state(ckpt.restore().state, state)
        assert hashed == []
    finally:
        committer.close()


def test_an_inline_committer_copies_its_memory_steps_to_a_peer_worker(
    dcs_config: DCSConfig, tmp_path: Path, inline: Inline
) -> None:
    """An in-process committer on host a (no peer server of its own) pushes each memory step to the peer server of
    host b's real `dcs worker`, as a worker's peer-copy task does; once host a is lost, host c restores from b."""
    state = training_state(seed=31, width=128)
    a = host_config(dcs_config, tmp_path, "hosta")
    b = host_config(dcs_config, tmp_path, "hostb")
    worker = start_worker(b, tmp_path, name="worker-b")
    try:
        wait_until(lambda: registered(a) == {"hostb"}, 60, "host b's peer server to register")
        with Checkpointer("inpeer", a, celery_app=inline(a)) as ckpt:
            ckpt.save(state, step=1).wait(timeout=120)
            wait_until(lambda: "replicated" in places(a, "inpeer").get((1, 0), set()), 120, "step 1 to replicate")
            assert places(a, "inpeer")[(1, 0)] == {"mem@hosta", "peer@hostb", "replicated"}
        shutil.rmtree(a.host.memory_dir)  # host a is lost
        with Checkpointer("inpeer", host_config(dcs_config, tmp_path, "hostc")) as replacement:
            restored = replacement.restore()
            assert (restored.step, restored.location) == (1, "peer:hostb")
            assert_same_state(restored.state, state)
    finally:
        worker.discard()
