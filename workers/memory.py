"""The memory tier's peer server on the worker (`dcs_tasks.checkpoint.store.tiers`). What follows the commit of a
memory step (its place and owner, the flush to storage, the copies to peers, eviction) is the library's
(`dcs_tasks.checkpoint.tiering`, in the order of `dcs_tasks.checkpoint.aftercommit`), run by this worker's tasks
(`workers/ckpt_tasks.py`).

The peer server (`start_peer_server`) runs in the worker's main process while the worker lives, serving this
host's `memory_dir` to peers (receive copies of their steps, send copies to restores on other hosts), and
registers its address in Redis (`Keys.memory_peers`) every few seconds.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from dcs_tasks.checkpoint import tiering
from dcs_tasks.checkpoint.store.peers import transfer
from dcs_tasks.checkpoint.store.tiers import eviction, memdir, owners, peerchoice, stepplaces
from dcs_tasks.config import DCSConfig
from workers.runtime import runtime

log = logging.getLogger(__name__)

PEER_REGISTER_SECONDS = 3.0
REDISCOVER_ROUNDS = 10  # every 30 s the host's memory steps are recorded again where Redis lacks them


# --- the peer server --------------------------------------------------------------------------------------
class _PeerService:
    def __init__(self, config: DCSConfig, client: redis.Redis) -> None:
        self.config = config
        self.client = client
        token = config.token()
        assert token
        self.server = transfer.PeerServer(
            memdir.memory_root(config, create=True),
            token,
            config.peer.host,
            config.peer.port,
            max_step_bytes=config.memory.budget_bytes,
            accept_put=owners.PutCheck(client, runtime().keys, config.host_name),
            room=lambda: memdir.room(config),
            timeout=config.peer.timeout_seconds,
            handshake_seconds=config.peer.handshake_seconds,
            per_source=config.peer.connections_per_source,
            min_rate=config.peer.min_bytes_per_second,
            rate_window=config.peer.rate_window_seconds,
            max_manifest_bytes=config.peer.max_manifest_bytes,
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
        peer = peerchoice.Peer(
            host=config.host_name,
            address=config.peer.advertise_host or self.address[0],
            port=self.address[1],
            domain=config.memory.failure_domain or config.host_name,
            seen=time.time(),
        )
        peerchoice.register_peer(self.client, runtime().keys, peer)

    def _rediscover(self) -> None:
        """A restarted worker finds its host's memory steps again (tmpfs outlives it) and records the places Redis
        lacks (lost in a failover, say), so restores on other hosts can find them: `mem@` and the owner for its own
        steps, `peer@` for the copies it received."""
        host = self.config.host_name
        mine = {stepplaces.mem_place(host), stepplaces.peer_place(host)}
        book = stepplaces.Places(self.client, runtime().keys)
        held = [s for s in memdir.scan(memdir.memory_root(self.config)) if s.committed]
        for run in sorted({s.run for s in held}):
            try:
                known = book.read(run)
                for s in held:
                    if s.run == run and not known.get((s.step, s.rank), set()) & mine:
                        book.record(
                            run, s.step, s.rank, (stepplaces.peer_place if s.peer else stepplaces.mem_place)(host)
                        )
                        if not s.peer:
                            tiering.record_owner(runtime(), host, run, s.step, s.rank, s.path)
            except redis.RedisError as exc:
                log.warning("memory tier: places of run %r not restored: %s", run, exc)
        if held and not self.thread.is_alive():  # at start
            log.info("memory tier: %d committed steps found in %s", len(held), self.config.host.memory_dir)

    def _register_loop(self) -> None:
        """Re-register every few seconds, and apply eviction to the whole memory root (peer copies arrive without
        a task of this worker's that would)."""
        rounds = 0
        while not self.stop_event.wait(PEER_REGISTER_SECONDS):
            rounds += 1
            try:
                self._register()
                eviction.evict(self.config, self.client, runtime().keys)
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
            peerchoice.unregister_peer(self.client, runtime().keys, self.config.host_name)
        except redis.RedisError:
            pass
        self.server.stop()


_service: _PeerService | None = None


def start_peer_server(config: DCSConfig) -> None:
    """Serve this host's memory tier to peers (memory tier on and a shared token set)."""
    global _service
    if not memdir.enabled(config):
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
