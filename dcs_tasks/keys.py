"""Every Redis key DCS uses is built here, under one namespace prefix.

A key built anywhere else is a bug: it escapes the namespace and the documentation below.
Types: H = hash, S = set, Z = sorted set, L = list, K = plain string key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    namespace: str = "dcs"

    def _k(self, *parts: object) -> str:
        return ":".join((self.namespace, *(str(p) for p in parts)))

    # --- topology -------------------------------------------------------------------------------
    def object_run_lock(self, purpose: str, run_location: str) -> str:
        """A lock of a run kept in an object store (which has no flock), by purpose (`latest`, `refs`):
        `run_location` is the run's s3:// URL (workers/objlocks.py)."""
        return self._k("ckpt", "lock", purpose, run_location)

    def role_nodes(self, role: str) -> str:
        """H rank -> RoleInfo JSON of every registered node of `role`."""
        return self._k("topo", "role", role)

    def roles(self) -> str:
        """Z role name scored by first-registration order (for global ranks)."""
        return self._k("topo", "roles")

    def role_seq(self) -> str:
        """K counter giving each new role its order score."""
        return self._k("topo", "role_seq")

    def heartbeat(self, role: str, rank: int) -> str:
        """K present while the node is alive (TTL = heartbeat timeout); value = the time of the node's last beat
        that wrote its last-beat records (every single beat, a batched one once per refresh period:
        coordinator/lua/heartbeat_many.lua), "r" + the registration's time until its first beat."""
        return self._k("hb", role, rank)

    def heartbeat_role_prefix(self, role: str) -> str:
        """Prefix P such that P + str(rank) == heartbeat(role, rank) (Lua scripts build per-rank keys with it)."""
        return self._k("hb", role) + ":"

    def role_owners(self, role: str) -> str:
        """H rank -> "ip:port" identity of the node holding that rank (re-registration keeps the rank)."""
        return self._k("topo", "owner", role)

    def role_identities(self, role: str) -> str:
        """H "ip:port" identity -> rank: role_owners inverted, so a re-registration finds its rank in O(1)."""
        return self._k("topo", "ident", role)

    def role_identities_prefix(self) -> str:
        """Prefix P such that P + role == role_identities(role)."""
        return self._k("topo", "ident") + ":"

    def role_rank_hint(self, role: str) -> str:
        """K a rank R such that every rank below R has a record in role_nodes(role): where the search for the
        smallest unregistered rank starts (lowered whenever a record goes)."""
        return self._k("topo", "hint", role)

    def role_rank_hint_prefix(self) -> str:
        """Prefix P such that P + role == role_rank_hint(role)."""
        return self._k("topo", "hint") + ":"

    def role_nodes_prefix(self) -> str:
        """Prefix P such that P + role == role_nodes(role) (the dead-node sweep builds keys from stored roles)."""
        return self._k("topo", "role") + ":"

    def role_owners_prefix(self) -> str:
        """Prefix P such that P + role == role_owners(role)."""
        return self._k("topo", "owner") + ":"

    def heartbeat_prefix(self) -> str:
        """Prefix P such that P + role + ":" + str(rank) == heartbeat(role, rank)."""
        return self._k("hb") + ":"

    def node_beats(self) -> str:
        """Z "role:rank" scored by the unix time of the node's last recorded registration or heartbeat (a batched
        beat records once per refresh period, coordinator/lua/heartbeat_many.lua; the sweep removes nodes dead for
        longer than the retention and puts a live one it finds behind back)."""
        return self._k("topo", "beats")

    def role_beats(self, role: str) -> str:
        """Z rank -> for each node of `role` not in role_stale(role), a unix time at least half the TTL before the
        heartbeat key its last recorded registration or beat set runs out: a registration's or single beat's
        time, a batched beat's plus half the TTL (a node found alive with an older entry: half the TTL before its
        heartbeat key runs out): where rank assignment looks for the role's dead ranks (node_beats holds every
        role's, so looking there cost every role's dead nodes)."""
        return self._k("topo", "rbeats", role)

    def role_beats_prefix(self) -> str:
        """Prefix P such that P + role == role_beats(role)."""
        return self._k("topo", "rbeats") + ":"

    def role_stale(self, role: str) -> str:
        """Z rank scored by rank: nodes of `role` whose role_beats(role) entry aged past half the heartbeat TTL
        (moved here by rank assignment), each maybe dead: the smallest one is the first checked."""
        return self._k("topo", "stale", role)

    def role_stale_prefix(self) -> str:
        """Prefix P such that P + role == role_stale(role)."""
        return self._k("topo", "stale") + ":"

    def node_unbeaten(self) -> str:
        """Z "role:rank" scored by the unix time of the node's registration, until its first heartbeat: a node
        that never beats is removed soon after its heartbeat timeout, not after the dead-node retention."""
        return self._k("topo", "unbeaten")

    # --- weight metadata ------------------------------------------------------------------------
    def weight_meta(self) -> str:
        """L of weight-meta JSON entries, appended by senders, read by index."""
        return self._k("wmeta", "list")

    def weight_meta_base(self) -> str:
        """K absolute index of the first entry still in weight_meta (entries before it were trimmed or cleared)."""
        return self._k("wmeta", "base")

    def weight_meta_channel(self) -> str:
        """pub/sub channel announcing appends to weight_meta (wakes long-polls)."""
        return self._k("wmeta", "chan")

    def weight_meta_append(self, append_id: str) -> str:
        """K marker of one append (short TTL): a retried append with the same id is stored once."""
        return self._k("wmeta", "append", append_id)

    # --- checkpoints ----------------------------------------------------------------------------
    def ckpt_state(self, run: str, step: int) -> str:
        """H state of one checkpoint step (status, files done, commit fence)."""
        return self._k("ckpt", run, step)

    def ckpt_ended(self, run: str, step: int) -> str:
        """L a token pushed when the step ends (committed or failed), short TTL: `PendingCheckpoint.wait()` blocks
        on it between polls, so it wakes as the step ends rather than at its next poll."""
        return self._k("ckpt", run, step, "ended")

    def ckpt_inflight(self, run: str) -> str:
        """Z steps of `run` still in flight (score = start time); retention skips them."""
        return self._k("ckpt", run, "inflight")

    def ckpt_flush_failures(self, run: str) -> str:
        """H step -> JSON {"at": unix time, "reason": ...}: memory-tier steps of `run` whose copy to storage failed for
        good (the worker's flush task gave up), for the trainer to learn of them (bounded by the worker)."""
        return self._k("ckpt", run, "flushfail")

    def step_places(self, run: str) -> str:
        """H where the memory tier's steps of `run` (the base run) live: field `<step>|<rank>|<place>`, place
        `mem@<host>` (the rank's own host), `peer@<host>` (a verified peer copy), `storage`, `replicated` (every
        peer copy verified); value = the time it was recorded."""
        return self._k("ckpt", run, "places")

    def step_owners(self, run: str) -> str:
        """H which host committed each memory-tier step of `run` (the base run): field `<step>|<rank>`, value JSON
        {host, digest} (digest: SHA-256 of the step's manifest.json). A peer server accepts a copy of a step only
        when it is another host's, with that manifest (`tiers.PutCheck`)."""
        return self._k("ckpt", run, "owners")

    def memory_peers(self) -> str:
        """H the workers' peer servers: host -> JSON {address, port, domain, seen}."""
        return self._k("memory", "peers")

    def task_deliveries(self, task_id: str) -> str:
        """K redelivery counter of one Celery task (caps acks_late redelivery loops)."""
        return self._k("task", task_id, "deliveries")

    # --- weight-sync groups ---------------------------------------------------------------------
    def port_reservation(self, host: str, port: int) -> str:
        """K reserved master port on a host (TTL); value = group name."""
        return self._k("port", host, port)

    def group(self, group_name: str) -> str:
        """H record of a weight-sync process group (members, epoch, master address)."""
        return self._k("group", group_name)

    def group_epoch(self, group_name: str) -> str:
        """K monotonically increasing epoch of a group name."""
        return self._k("group", group_name, "epoch")

    def bootstrap_request(self, request_id: str) -> str:
        """K epoch given to one bootstrap request (task id or the client's request id; TTL): a redelivered
        or re-sent bootstrap gets the same epoch, hence the same group record and master port."""
        return self._k("group", "bootstrap", request_id)

    def join_claim(self, join_id: str) -> str:
        """K claim of one engine join (TTL): "sending" while its POST is in flight, then the JoinResult JSON,
        so a redelivered join never POSTs /init_weights_update_group a second time."""
        return self._k("group", "join", join_id)

    # --- workers --------------------------------------------------------------------------------
    def worker_presence(self, queue: str) -> str:
        """K present while a worker consumes `queue` (TTL refreshed by the worker)."""
        return self._k("worker", queue)

    def worker_settings(self, queue: str) -> str:
        """K JSON of the settings the worker consuming `queue` uses and a trainer must share (checkpoint root,
        staging and memory tier: `dcs_tasks.checkpoint.agreement.WorkerSettings`); TTL as worker_presence."""
        return self._k("worker-settings", queue)
