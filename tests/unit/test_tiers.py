"""The memory tier's rules (`dcs_tasks.checkpoint.store.tiers`): which steps may leave memory, where peer copies go, and
how a hostile places record is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcs_tasks.checkpoint.store.peers.stepfiles import StepRel
from dcs_tasks.checkpoint.store.tiers import eviction, memdir, owners, stepplaces
from dcs_tasks.checkpoint.store.tiers.eviction import evictable
from dcs_tasks.checkpoint.store.tiers.memdir import MemoryStep
from dcs_tasks.checkpoint.store.tiers.peerchoice import Peer, choose_peers
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import PeerCorrupt, PeerRefused
from dcs_tasks.keys import Keys
from dcs_tasks.redisconn import sync_client

ME = "hosta"


def held(*steps: int, rank: int = 0, nbytes: int = 100) -> list[MemoryStep]:
    return [MemoryStep("run", rank, s, Path(f"/m/run/step-{s:09d}"), True, nbytes) for s in steps]


def leaving(steps: list[MemoryStep], places: dict[tuple[int, int], set[str]], keep: int, over: int = 0) -> list[int]:
    return [s.step for s in evictable(steps, places, ME, keep, over)]


def test_a_step_held_nowhere_else_never_leaves_whatever_its_age() -> None:
    assert leaving(held(1, 2, 3, 4), {(s, 0): {"mem@hosta"} for s in (1, 2, 3, 4)}, keep=1, over=10_000) == []


def test_steps_beyond_keep_last_leave_once_stored_or_covered_by_a_newer_stored_step() -> None:
    places = {(1, 0): {"mem@hosta"}, (2, 0): {"mem@hosta", "storage"}, (3, 0): {"mem@hosta"}, (4, 0): {"mem@hosta"}}
    # 2 is in storage, 1 is covered by it; 3 is within keep_last=2 (3 and 4 stay)
    assert leaving(held(1, 2, 3, 4), places, keep=2) == [1, 2]


def test_a_peer_copy_counts_as_held_elsewhere_but_this_hosts_own_marks_do_not() -> None:
    places = {(1, 0): {"mem@hosta", "peer@hostb", "replicated"}, (2, 0): {"mem@hosta", "peer@hosta"}, (3, 0): set()}
    assert leaving(held(1, 2, 3), places, keep=1) == [1]


def test_the_newest_complete_step_never_leaves_even_over_budget() -> None:
    places = {(s, 0): {"mem@hosta", "storage"} for s in (1, 2)}
    assert leaving(held(1, 2), places, keep=1, over=10_000) == [1]
    partial = [*held(1), MemoryStep("run", 0, 2, Path("/m/run/step-000000002"), False, 100)]
    assert leaving(partial, places, keep=1, over=10_000) == []  # step 2 is not complete: 1 is the newest


def test_over_budget_covered_steps_within_keep_last_leave_oldest_first_until_enough_is_freed() -> None:
    places = {(s, 0): {"mem@hosta", "storage"} for s in (1, 2, 3, 4)}
    assert leaving(held(1, 2, 3, 4), places, keep=10, over=150) == [1, 2]
    assert leaving(held(1, 2, 3, 4), places, keep=10, over=0) == []


def test_a_step_being_flushed_or_copied_stays() -> None:
    places = {(1, 0): {"mem@hosta", "flushing"}, (2, 0): {"mem@hosta", "copying"}, (3, 0): {"storage"}}
    assert leaving(held(1, 2, 3, 4), places, keep=1) == [3]


def test_ranks_are_judged_apart() -> None:
    steps = held(1, 2, rank=0) + held(1, 2, rank=1)
    places = {(1, 0): {"storage"}, (1, 1): {"mem@hosta"}}
    assert [(s.step, s.rank) for s in evictable(steps, places, ME, 1, 0)] == [(1, 0)]


def peer(host: str, domain: str) -> Peer:
    return Peer(host, "10.0.0.1", 7000, domain, 0.0)


def test_peers_come_from_other_domains_one_domain_each_first() -> None:
    candidates = {h: peer(h, d) for h, d in [("a2", "rack1"), ("b1", "rack2"), ("b2", "rack2"), ("c1", "rack3")]}
    chosen = choose_peers("a1", "rack1", candidates, 2)
    assert [p.host for p in chosen] == ["b1", "c1"]  # never a2 (same rack), not b1 and b2 (same rack) together
    assert [p.host for p in choose_peers("a1", "rack1", candidates, 3)] == ["b1", "c1", "b2"]
    assert choose_peers("a1", "rack1", {"a2": peer("a2", "rack1")}, 1) == []  # none qualifies


def test_the_ring_starts_after_this_host_so_copies_spread() -> None:
    candidates = {h: peer(h, h) for h in ("h1", "h2", "h3", "h4")}
    assert [p.host for p in choose_peers("h2", "h2", candidates, 1)] == ["h3"]
    assert [p.host for p in choose_peers("h4", "h4", candidates, 2)] == ["h1", "h2"]


def test_hostile_place_fields_are_skipped() -> None:
    good = "5|0|mem@hosta"
    for bad in ["5|0", "x|0|storage", "5|0|nowhere", "5|0|mem@", "5|0|mem@a b", "1" * 30 + "|0|storage", "5|0|peer@/x"]:
        assert stepplaces._parse_field(bad) is None, bad
    assert stepplaces._parse_field(good) == (5, 0, "mem@hosta")
    assert stepplaces._parse_field(b"7|3|replicated") == (7, 3, "replicated")


def test_rel_names_a_rank_and_a_step_or_nothing() -> None:
    assert stepplaces.rel_step("run/step-000000005") == (0, 5)
    assert stepplaces.rel_step("run/rank-00003/step-000000005") == (3, 5)
    for bad in ["run", "run/rank-3/step-000000005", "a/b/c/step-000000005", "run/step-5"]:
        assert stepplaces.rel_step(bad) is None, bad
    assert stepplaces.base_and_rank("run.rank-00002") == ("run", 2)
    assert stepplaces.base_and_rank("run") == ("run", 0)


def test_a_step_that_leaves_gives_its_files_to_the_recycle_pool_and_a_writer_overwrites_one(tmp_path: Path) -> None:
    from dcs_tasks.checkpoint.format.layout import new_hasher
    from dcs_tasks.checkpoint.store.writes.durable import stream_region

    root = tmp_path / "memory"
    step_dir = root / "run" / "step-000000001"
    step_dir.mkdir(parents=True)
    (step_dir / "a.safetensors").write_bytes(b"a" * 5000)
    (step_dir / "b.safetensors").write_bytes(b"b" * 9000)
    (step_dir / "manifest.json").write_text("{}")
    memdir.remove_step(MemoryStep("run", 0, 1, step_dir, True, 14_000), root, room=14_100)
    assert not step_dir.exists()
    assert [size for size, _ in memdir._recycled(root)] == [5000, 9000]  # the manifest went first
    assert memdir.recycled_bytes(root) == 14_000

    first = memdir.take_recycled(root, 6000)  # the smallest that holds 6000 bytes, now the caller's alone
    assert first is not None and first.read_bytes() == b"b" * 9000
    assert memdir.take_recycled(root, 6000) is None  # taken: never handed out twice
    source = tmp_path / "staged"
    source.write_bytes(bytes(range(256)) * 24)  # 6144 bytes
    final = tmp_path / "out" / "c.safetensors"
    final.parent.mkdir()
    digest = stream_region(source, 0, 6144, final, "t", recycled=first)
    assert final.read_bytes() == source.read_bytes()  # overwritten in place and cut to what was written
    hasher = new_hasher()
    hasher.update(source.read_bytes())
    assert digest == hasher.hexdigest() and not first.exists()
    memdir.remove_step(MemoryStep("run", 0, 2, final.parent, True, 6144), root, room=0)  # no room: deleted
    assert not final.parent.exists() and memdir.recycled_bytes(root) == 5000


def test_a_mapped_file_is_never_recycled_nor_overwritten_in_place(tmp_path: Path) -> None:
    """A restore from memory lends the tmpfs pages (`lend.map_many`): while it maps a file, a leaving step
    deletes that file instead of recycling it, and a writer handed a recycled file a reader maps writes a new
    one; the reader's bytes never change."""
    from dcs_tasks.checkpoint.format.layout import FileEntry, new_hasher
    from dcs_tasks.checkpoint.restore import lend
    from dcs_tasks.checkpoint.store.writes.durable import stream_region

    def entry_of(path: Path) -> FileEntry:
        hasher = new_hasher()
        hasher.update(path.read_bytes())
        return FileEntry(name=path.name, size=path.stat().st_size, checksum=hasher.hexdigest())

    root = tmp_path / "memory"
    step_dir = root / "run" / "step-000000001"
    step_dir.mkdir(parents=True)
    lent, free = step_dir / "a.safetensors", step_dir / "b.safetensors"
    lent.write_bytes(b"a" * 8192)
    free.write_bytes(b"b" * 8192)
    (mapping,) = lend.map_many([(lent, entry_of(lent))], verify=True)
    memdir.remove_step(MemoryStep("run", 0, 1, step_dir, True, 16384), root, room=1 << 20)
    assert [size for size, _ in memdir._recycled(root)] == [8192]  # only the file nobody maps
    assert bytes(mapping[:8192]) == b"a" * 8192

    # a file mapped after it reached the pool (a reader that opened it just before): the writer leaves it alone
    pool_file = memdir._recycled(root)[0][1]
    (late,) = lend.map_many([(pool_file, entry_of(pool_file))], verify=True)
    claimed = memdir.take_recycled(root, 8192)
    assert claimed is not None
    source = tmp_path / "staged"
    source.write_bytes(b"c" * 8192)
    final = tmp_path / "out" / "c.safetensors"
    final.parent.mkdir()
    stream_region(source, 0, 8192, final, "t", recycled=claimed)
    assert final.read_bytes() == b"c" * 8192 and not claimed.exists()
    assert bytes(late[:8192]) == b"b" * 8192 and bytes(mapping[:8192]) == b"a" * 8192
    late.close()
    mapping.close()


def test_the_pool_is_trimmed_largest_first_to_what_the_budget_leaves_free(tmp_path: Path) -> None:
    root = tmp_path / "memory"
    for step, sizes in ((1, (3000, 5000)), (2, (4000,))):
        step_dir = root / "run" / f"step-{step:09d}"
        step_dir.mkdir(parents=True)
        for i, size in enumerate(sizes):
            (step_dir / f"f{i}.safetensors").write_bytes(b"x" * size)
        memdir.remove_step(MemoryStep("run", 0, step, step_dir, True, sum(sizes)), root, room=1 << 20)
    assert sorted(size for size, _ in memdir._recycled(root)) == [3000, 4000, 5000]  # several steps' files kept
    memdir.trim_pool(root, allowed=7500)
    assert sorted(size for size, _ in memdir._recycled(root)) == [3000, 4000]
    memdir.trim_pool(root, allowed=0)
    assert memdir._recycled(root) == []


# --- peer copies: whose they are, and that they leave first (real Redis) -------------------------------------
def _step(root: Path, rel: str, nbytes: int, peer: bool) -> None:
    step_dir = root / rel
    step_dir.mkdir(parents=True)
    (step_dir / "model.safetensors").write_bytes(b"x" * nbytes)
    seal = {"format": 1, "files": {}, **({"peer": True} if peer else {})}
    (step_dir / "seal.json").write_text(json.dumps(seal))
    (step_dir / "manifest.json").write_text("{}")


def test_over_budget_peer_copies_leave_first_whatever_their_age_and_leave_no_directory(
    dcs_config: DCSConfig, tmp_path: Path
) -> None:
    root = tmp_path / "memory"
    root.mkdir(mode=0o700)
    size = 256 << 10
    for step in (1, 2):  # this host's own steps, held nowhere else: they may not leave
        _step(root, f"mine/step-{step:09d}", size, peer=False)
    for step in (5, 6, 7):  # copies pushed by peers; no places recorded for them at all
        _step(root, f"theirs/rank-00001/step-{step:09d}", size, peer=True)
    config = dcs_config.model_copy(update={"memory_dir": root, "memory_tier_bytes": 3 * size, "node_name": ME})
    client = sync_client(config)
    try:
        eviction.evict(config, client, Keys(config.redis.namespace))
    finally:
        client.close()
    assert sorted(p.name for p in (root / "mine").iterdir()) == ["step-000000001", "step-000000002"]
    assert not (root / "theirs").exists()  # every copy left, and the run and rank directories with them
    assert memdir.used_bytes(root) <= config.memory.budget_bytes


def test_a_put_is_accepted_only_for_another_hosts_step_with_its_recorded_manifest(dcs_config: DCSConfig) -> None:
    client = sync_client(dcs_config)
    keys = Keys(dcs_config.redis.namespace)
    try:
        owners.Owners(client, keys).record("run", 3, 1, "hostb", b'{"manifest": 1}')
        rel = StepRel("run", 3, 1)
        owners.PutCheck(client, keys, ME)(rel, b'{"manifest": 1}')  # host b's step, its manifest: accepted
        with pytest.raises(PeerRefused, match="not the one host hostb committed"):
            owners.PutCheck(client, keys, ME)(rel, b'{"manifest": 2}')
        with pytest.raises(PeerRefused, match="this host's own step"):
            owners.PutCheck(client, keys, "hostb")(rel, b'{"manifest": 1}')
        with pytest.raises(PeerRefused, match="no host recorded"):
            owners.PutCheck(client, keys, ME)(StepRel("run", 4, 1), b'{"manifest": 1}')
        with pytest.raises(PeerCorrupt):
            owners.pull_check(client, keys)(rel, b'{"manifest": 2}')
        owners.pull_check(client, keys)(StepRel("run", 9), b"{}")  # no record: taken on its checksums
    finally:
        client.close()


def test_a_place_recorded_with_clearing_replaces_the_mark_in_one_transaction(dcs_config: DCSConfig) -> None:
    """A peer copy that ends records `replicated` and drops `copying` together (a reader once saw both)."""
    client = sync_client(dcs_config)
    book = stepplaces.Places(client, Keys(dcs_config.redis.namespace))
    try:
        book.record("run", 2, 0, "mem@hosta", stepplaces.COPYING, stepplaces.FLUSHING)
        book.record("run", 2, 0, "peer@hostb")
        book.record("run", 2, 0, stepplaces.REPLICATED, clearing=(stepplaces.COPYING,))
        assert book.read("run")[(2, 0)] == {"mem@hosta", "peer@hostb", stepplaces.REPLICATED, stepplaces.FLUSHING}
        book.record("run", 2, 0, stepplaces.STORAGE, clearing=(stepplaces.FLUSHING,))
        assert book.read("run")[(2, 0)] == {"mem@hosta", "peer@hostb", stepplaces.REPLICATED, stepplaces.STORAGE}
    finally:
        client.close()
