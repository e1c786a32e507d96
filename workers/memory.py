"""The memory tier on the worker (`dcs_tasks.checkpoint.store.tiers`): what follows the commit of a memory step, the
flush of a step to storage, the copies to peer hosts, eviction, and this host's peer server.

After a memory step commits (`after_commit`): its place `mem@<host>` is recorded, and this host as its owner with
its manifest's digest (`tiers.Owners`: peers accept copies only of steps so recorded, by another host); a durable
step is sent to the flush task (copy to `checkpoint_dir` with `replica.copy_step`: every file hashed while written
and compared with the manifest, fsynced, headers checked, manifest last; then `latest`, retention and the replica as
after a storage commit); with `memory_replicas` > 0 the peer-copy task pushes the step to peers chosen by
`tiers.choose_peers` (`dcs_tasks.checkpoint.store.peerwire`: authenticated with the shared token, every file
verified on arrival); each copy's place is recorded once it verified, and `replicated` once every copy asked for
did. Every one of these ends with eviction (`tiers.evict`).

The peer server (`start_peer_server`) runs in the worker's main process while the worker lives, serving this
host's `memory_dir` to peers (receive copies of their steps, send copies to restores on other hosts), and
registers its address in Redis (`Keys.memory_peers`) every few seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import redis

from dcs_tasks.checkpoint.format.layout import MANIFEST_NAME
from dcs_tasks.checkpoint.store import peerwire, tiers
from dcs_tasks.checkpoint.store.payloads import MemoryStepRequest
from dcs_tasks.checkpoint.telemetry import record_error
from dcs_tasks.config import DCSConfig
from dcs_tasks.errors import CheckpointError, ReplicaFailed
from workers.replica import _complete, _primary_manifest, copy_step, publish_copy, relative
from workers.runtime import runtime
from workers.trust import checkpoint_root, trusted_step_dir

log = logging.getLogger(__name__)

PEER_REGISTER_SECONDS = 3.0
REDISCOVER_ROUNDS = 10  # every 30 s the host's memory steps are recorded again where Redis lacks them


def is_memory_step(config: DCSConfig, step_dir: str) -> bool:
    return tiers.enabled(config) and Path(step_dir).is_relative_to(tiers.memory_root(config))


def _memory_step(req: MemoryStepRequest) -> tuple[Path, str]:
    """(the trusted memory step directory, its path relative to memory_dir)."""
    config = runtime().config
    root = tiers.memory_root(config)
    ref = req.ref
    step_dir = trusted_step_dir(ref.step_dir, ref.run, ref.step, config, root=root)
    return step_dir, relative(step_dir, root)


def evict(run: str) -> None:
    rt = runtime()
    try:
        tiers.evict(rt.config, rt.redis, rt.keys, tiers.base_and_rank(run)[0])
    except Exception as exc:  # eviction is housekeeping: the next commit tries again
        log.warning("memory tier eviction failed: %s: %s", type(exc).__name__, exc)


def after_commit(step_dir: str, run: str, step: int, durable: bool) -> tuple[bool, bool]:
    """Record where a just-committed step lives; returns (flush it, copy it to peers)."""
    rt = runtime()
    base, rank = tiers.base_and_rank(run)
    memory = is_memory_step(rt.config, step_dir)
    flush, copy = memory and durable, memory and rt.config.memory_replicas > 0
    place = tiers.mem_place(rt.config.host_name) if memory else tiers.STORAGE
    marks = [m for m, on in ((tiers.FLUSHING, flush), (tiers.COPYING, copy)) if on]
    try:
        if memory:  # before the peer copy task is sent: the peers check it
            _record_owner(rt.config.host_name, base, step, rank, Path(step_dir))
        tiers.Places(rt.redis, rt.keys).record(base, step, rank, place, *marks)
    except redis.RedisError as exc:
        log.warning("memory tier: place of step %d of %s not recorded: %s", step, run, exc)
    evict(run)
    return flush, copy


def _record_owner(host: str, base: str, step: int, rank: int, step_dir: Path) -> None:
    """Record this host as the owner of its committed memory step (with its manifest's digest)."""
    rt = runtime()
    try:
        raw = (step_dir / MANIFEST_NAME).read_bytes()
    except OSError as exc:
        log.warning("memory tier: owner of step %d of %s not recorded: %s", step, base, exc)
        return
    tiers.Owners(rt.redis, rt.keys).record(base, step, rank, host, raw)


def flush(req: MemoryStepRequest, task_id: str) -> dict[str, Any]:
    """Copy a memory step to storage, verified; then `latest`, retention and the storage place."""
    rt = runtime()
    config, ref = rt.config, req.ref
    src, rel = _memory_step(req)
    root = checkpoint_root(config)
    dst = root
    for part in rel.split("/"):
        dst = dst / part
    started = time.monotonic()
    manifest = _primary_manifest(src)  # ReplicaFailed when the memory step is gone or corrupt
    copied = 0
    if not _complete(dst, manifest):
        copied = copy_step(src, dst, manifest, task_id, config.persist_throttle_bytes_per_second, read_back=False)
    deleted = publish_copy(dst, ref.run, ref.step, req.retention, task_id)
    base, rank = tiers.base_and_rank(ref.run)
    book = tiers.Places(rt.redis, rt.keys)
    book.record(base, ref.step, rank, tiers.STORAGE)
    book.forget(base, ref.step, rank, tiers.FLUSHING)
    seconds = time.monotonic() - started
    log.info("memory tier: step %d of %s flushed to %s (%d bytes, %.3f s)", ref.step, ref.run, dst, copied, seconds)
    evict(ref.run)
    return {"step": ref.step, "storage": str(dst), "copied_bytes": copied, "deleted": deleted, "seconds": seconds}


def peer_copy(req: MemoryStepRequest) -> dict[str, Any]:
    """Push a memory step to `memory_replicas` peers of other failure domains; records each verified copy, and
    `replicated` once all did. A peer that fails is replaced by the next eligible one."""
    rt = runtime()
    ref = req.ref
    base, rank = tiers.base_and_rank(ref.run)
    try:
        return _peer_copy(req)
    finally:
        with contextlib.suppress(redis.RedisError):  # the step may leave memory again
            tiers.Places(rt.redis, rt.keys).forget(base, ref.step, rank, tiers.COPYING)
        evict(ref.run)


def _peer_copy(req: MemoryStepRequest) -> dict[str, Any]:
    rt = runtime()
    config, ref = rt.config, req.ref
    src, rel = _memory_step(req)
    token = config.token()
    if not token:
        raise ReplicaFailed("memory_replicas needs auth_token (peer copies are authenticated with it)")
    host = config.host_name
    domain = config.failure_domain or host
    candidates = {h: p for h, p in tiers.peers(rt.redis, rt.keys).items() if h != host}
    ordered = tiers.choose_peers(host, domain, candidates, len(candidates))
    base, rank = tiers.base_and_rank(ref.run)
    book = tiers.Places(rt.redis, rt.keys)
    done: list[str] = []
    failures: list[str] = []
    domains: set[str] = set()
    for peer in ordered:
        if len(done) >= config.memory_replicas:
            break
        try:
            peerwire.push_step(
                (peer.address, peer.port),
                token,
                src,
                rel,
                timeout=config.peer_timeout_seconds,
                min_rate=config.peer_min_bytes_per_second,
                max_manifest_bytes=config.peer_max_manifest_bytes,
            )
        except CheckpointError as exc:
            failures.append(f"{peer.host}: {exc}")
            log.warning("memory tier: copy of step %d of %s to %s failed: %s", ref.step, ref.run, peer.host, exc)
            continue
        book.record(base, ref.step, rank, tiers.peer_place(peer.host))
        done.append(peer.host)
        domains.add(peer.domain)
    if len(done) >= config.memory_replicas:
        book.record(base, ref.step, rank, tiers.REPLICATED)
    else:
        record_error("checkpoint_peer_copy")
        log.error(
            "memory tier: step %d of %s has %d of %d peer copies (%s); it does not count as replicated",
            ref.step,
            ref.run,
            len(done),
            config.memory_replicas,
            "; ".join(failures) or "no eligible peer in another failure domain",
        )
    return {"step": ref.step, "peers": done, "failures": failures, "replicated": len(done) >= config.memory_replicas}


# --- the peer server --------------------------------------------------------------------------------------
class _PeerService:
    def __init__(self, config: DCSConfig, client: redis.Redis) -> None:
        self.config = config
        self.client = client
        token = config.token()
        assert token
        self.server = peerwire.PeerServer(
            tiers.memory_root(config, create=True),
            token,
            config.peer_host,
            config.peer_port,
            max_step_bytes=config.memory_tier_bytes,
            accept_put=tiers.PutCheck(client, runtime().keys, config.host_name),
            room=lambda: tiers.room(config),
            timeout=config.peer_timeout_seconds,
            handshake_seconds=config.peer_handshake_seconds,
            per_source=config.peer_connections_per_source,
            min_rate=config.peer_min_bytes_per_second,
            max_manifest_bytes=config.peer_max_manifest_bytes,
        )
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._register_loop, name="dcs-peer-register", daemon=True)

    def start(self) -> None:
        self.address = self.server.start()
        self._register()
        self._rediscover()
        self.thread.start()
        log.info("memory tier: peer server on %s:%d", *self.address)

    def _register(self) -> None:
        config = self.config
        peer = tiers.Peer(
            host=config.host_name,
            address=config.peer_advertise_host or self.address[0],
            port=self.address[1],
            domain=config.failure_domain or config.host_name,
            seen=time.time(),
        )
        tiers.register_peer(self.client, runtime().keys, peer)

    def _rediscover(self) -> None:
        """A restarted worker finds its host's memory steps again (tmpfs outlives it) and records the places Redis
        lacks (lost in a failover, say), so restores on other hosts can find them: `mem@` and the owner for its own
        steps, `peer@` for the copies it received."""
        host = self.config.host_name
        mine = {tiers.mem_place(host), tiers.peer_place(host)}
        book = tiers.Places(self.client, runtime().keys)
        held = [s for s in tiers.scan(tiers.memory_root(self.config)) if s.committed]
        for run in sorted({s.run for s in held}):
            try:
                known = book.read(run)
                for s in held:
                    if s.run == run and not known.get((s.step, s.rank), set()) & mine:
                        book.record(run, s.step, s.rank, (tiers.peer_place if s.peer else tiers.mem_place)(host))
                        if not s.peer:
                            _record_owner(host, run, s.step, s.rank, s.path)
            except redis.RedisError as exc:
                log.warning("memory tier: places of run %r not restored: %s", run, exc)
        if held and not self.thread.is_alive():  # at start
            log.info("memory tier: %d committed steps found in %s", len(held), self.config.memory_dir)

    def _register_loop(self) -> None:
        """Re-register every few seconds, and apply eviction to the whole memory root (peer copies arrive without
        a task of this worker's that would)."""
        rounds = 0
        while not self.stop_event.wait(PEER_REGISTER_SECONDS):
            rounds += 1
            try:
                self._register()
                tiers.evict(self.config, self.client, runtime().keys)
                if rounds % REDISCOVER_ROUNDS == 0:  # places lost with Redis's data come back
                    self._rediscover()
            except redis.RedisError as exc:  # Redis failing over: the registration comes back with it
                log.warning("memory tier: peer registration failed: %s", exc)
            except OSError as exc:
                log.warning("memory tier: eviction failed: %s", exc)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2 * PEER_REGISTER_SECONDS)
        try:
            tiers.unregister_peer(self.client, runtime().keys, self.config.host_name)
        except redis.RedisError:
            pass
        self.server.stop()


_service: _PeerService | None = None


def start_peer_server(config: DCSConfig) -> None:
    """Serve this host's memory tier to peers (memory tier on and a shared token set)."""
    global _service
    if not tiers.enabled(config):
        return
    if not config.token():
        log.warning("memory tier: no auth_token, so no peer server: peers can neither copy to nor read from this host")
        return
    _service = _PeerService(config, runtime().redis)
    _service.start()


def stop_peer_server() -> None:
    global _service
    if _service is not None:
        _service.stop()
        _service = None
