"""Actor -> actor_fwd / reference weight sync: groups from /get_model_update_group_ranks, meta via the coordinator.

Every participant calls `init_groups(rollout_id)` with the same `rollout_id` (rendezvous is a barrier).
The reference joins only when `ref_update_interval` is set and divides `rollout_id`. Each actor marked
`is_pp_src_rank` is rank 0 of its stage's group `update_actor_pp_{pp_rank}` (init method from the
coordinator); receivers join every stage's group at their global rank. Per update each source posts one
`WeightMeta` per bucket (then broadcasts the bucket flattened) and finally the end sentinel, every entry naming
the update's version (the source's count of updates in its group: 1, 2, ...) and the sentinel naming its group;
a receiver commits update v once the sentinels of v from all `train_pp_size` groups arrived, so a partial update
is never applied. The meta log is shared and stages run independently: a receiver skips entries of groups it is
not in, drops entries of older versions (`dcs_weight_meta_dropped_total{reason="stale"}`), keeps the entries of
the next `MAX_VERSIONS_AHEAD` versions (meta only: their broadcasts wait in the senders' groups) for the calls
that receive them, and refuses an entry further ahead or without a version (`WeightMetaVersionError`). So one
stage's bucket of update v+1 read before another stage's end of v is never taken into v.

Preconditions are checked, not assumed. An actor that is not a source rank sits the update out when its
stage has a source, and raises `SyncPreconditionError` (saying what metadata to set) when its stage has none.
A receiver that asks before every stage's source actor registered waits for them (`wait_for_sources`,
bounded; `ActorWaitTimeout` names the stages still missing) instead of joining no group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dcs_tasks.backends.base import CommBackend, GroupSpec
from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.config import BackendType
from dcs_tasks.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import (
    ActorWaitTimeout,
    DCSTimeoutError,
    SyncPreconditionError,
    WeightMetaVersionError,
    WeightSyncError,
)
from dcs_tasks.metrics import get_metrics
from dcs_tasks.models import GroupRanksResponse, WeightMeta
from dcs_tasks.sync.receiving import WeightReceiver
from dcs_tasks.sync.sender import ActorFwdDetails, BucketSender, UpdateReport
from dcs_tasks.sync.wire import QuantizationConfig

log = logging.getLogger(__name__)

MAX_VERSIONS_AHEAD = 3
"""Updates past the one being received whose weight-meta entries a receiver keeps (names, dtypes, shapes only;
their broadcasts wait in the senders' groups until received). An entry further ahead is refused."""


def needs_ref_update(rollout_id: int, ref_update_interval: int | None) -> bool:
    return ref_update_interval is not None and rollout_id % ref_update_interval == 0


def _parse_tcp(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def stage_specs(ranks: GroupRanksResponse, rollout_id: int, backend: BackendType) -> dict[str, GroupSpec]:
    """The GroupSpec this node uses in every pp stage's group (named with the rollout id)."""
    specs = {}
    for stage, url in sorted(ranks.pp_groups.items()):
        host, port = _parse_tcp(url)
        name = f"{stage}-r{rollout_id}"
        specs[stage] = GroupSpec(name, host, port, ranks.world_size, ranks.global_rank, backend)
    return specs


def stage_group(pp_rank: int) -> str:
    """The coordinator's name for pp stage `pp_rank`'s group (key of `GroupRanksResponse.pp_groups`)."""
    return f"update_actor_pp_{pp_rank}"


def missing_stages(ranks: GroupRanksResponse) -> list[str]:
    """The stages of `train_pp_size` whose source actor has not registered (no entry in `pp_groups`)."""
    return [stage_group(i) for i in range(ranks.train_pp_size) if stage_group(i) not in ranks.pp_groups]


async def wait_for_sources(
    api: CoordinatorAPI, role: str, rank: int, need_ref: bool, timeout_seconds: float, poll_seconds: float = 0.5
) -> GroupRanksResponse:
    """This receiver's group ranks once every pp stage's source actor registered. Asking earlier used to
    answer no group at all: the receiver joined nothing and the actor's group init timed out later. Waits
    at most `timeout_seconds`, then `ActorWaitTimeout` names the stages still missing."""
    deadline = time.monotonic() + timeout_seconds
    logged = False
    while True:
        ranks = await api.model_update_group_ranks(role, rank, need_ref)
        missing = missing_stages(ranks)
        left = deadline - time.monotonic()
        if not missing:
            return ranks
        if left <= 0:
            raise ActorWaitTimeout(
                f"{role} rank {rank} waited {timeout_seconds:g}s for the source actor of {', '.join(missing)} to "
                f"register (an actor started with metadata={{'is_pp_src_rank': True, 'pp_rank': N}}; "
                f"train_pp_size {ranks.train_pp_size}, from actor rank 0's 'pp_size'); registered sources: "
                f"{', '.join(sorted(ranks.pp_groups)) or 'none'}; start the actor(s) or raise wait_timeout_s"
            )
        if not logged:
            log.info("%s rank %d waits up to %.0fs for the source actor of %s", role, rank, left, ", ".join(missing))
            logged = True
        await asyncio.sleep(min(poll_seconds, left))


async def join_all(backend: CommBackend, specs: list[GroupSpec]) -> None:
    """Join every group concurrently (each rendezvous waits for all its members)."""
    await asyncio.gather(*(asyncio.to_thread(backend.create_group, spec) for spec in specs))


class ActorFwdSender:
    """Actor side: broadcast this pp stage's part of the weights to actor_fwd (and reference)."""

    def __init__(self, api: CoordinatorAPI, sender: BucketSender, pp_rank: int) -> None:
        self.api = api
        self.sender = sender
        self.pp_rank = pp_rank
        self.spec: GroupSpec | None = None
        self.version = 0  # updates sent in the current group: the version its next entries carry, less one

    async def init_group(self, specs: dict[str, GroupSpec], rank: int | None, is_source: bool) -> bool:
        """Join this stage's group as its rank 0; False (nothing to send) for an actor that is not the source of
        its stage while another is. `SyncPreconditionError` when the stage has no source at all."""
        stage = stage_group(self.pp_rank)
        mine = specs.get(stage)
        if not is_source:
            if mine is not None:
                log.info("actor rank %s is not the source of pp stage %d; it sends nothing", rank, self.pp_rank)
                return False
            raise SyncPreconditionError(
                f"actor rank {rank} has no metadata is_pp_src_rank=True and no actor is registered as the source of "
                f"pp stage {self.pp_rank} (registered sources: {', '.join(sorted(specs)) or 'none'}), so there is no "
                f"group to send in: register the actor with metadata={{'is_pp_src_rank': True}} (with PP > 1 also "
                "'pp_rank' and 'pp_size'; one source rank per pp stage)"
            )
        if mine is None:
            raise WeightSyncError(
                f"the coordinator lists no group for pp stage {self.pp_rank} though actor rank {rank} is its source "
                f"(registered sources: {', '.join(sorted(specs)) or 'none'}): was this rank taken over by another "
                "node? restart this actor"
            )
        previous, self.spec = self.spec, None
        await asyncio.to_thread(self.sender.backend.create_group, mine)  # before dropping `previous`: the
        if previous is not None and previous.group_name != mine.group_name:  # master store stays bound
            self.sender.backend.destroy_group(previous.group_name)
        self.spec = mine
        self.version = 0
        return True

    async def update(self, state: Mapping[str, torch.Tensor], quant: QuantizationConfig | None = None) -> UpdateReport:
        if self.spec is None:
            return UpdateReport(None, ActorFwdDetails(actor_fwd_groups=0))
        group_name = self.spec.group_name
        self.version += 1  # spent even if this update fails: receivers drop the rest of it as stale
        version = self.version

        async def announce(index: int, layout: FusionLayout, last: bool) -> None:
            meta = WeightMeta(
                names=layout.names,
                dtypes=[s.dtype for s in layout.specs],
                shapes=[list(s.shape) for s in layout.specs],
                group_name=group_name,
                version=version,
            )
            await self.api.send_weight_meta(meta)

        sent = await self.sender.send_fused(state, group_name, announce, quant)
        await self.api.send_weight_meta(WeightMeta.end(version, closes=group_name))
        return UpdateReport(sent, ActorFwdDetails(actor_fwd_groups=1))


class ActorFwdReceiver:
    """actor_fwd / reference side: follow the weight-meta log and receive each bucket it announces."""

    def __init__(
        self,
        api: CoordinatorAPI,
        receiver: WeightReceiver,
        timeout_seconds: float,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.api = api
        self.receiver = receiver
        self.timeout_seconds = timeout_seconds
        self.model = model
        self.train_pp_size = 1
        self.meta_index = 0
        self.group_names: list[str] = []
        self.next_update = 1  # the senders' version of the update the next `recv_weight` receives
        self._ahead: dict[int, list[WeightMeta]] = {}  # entries of later updates read meanwhile, in log order

    async def init_groups(self, ranks: GroupRanksResponse, specs: dict[str, GroupSpec]) -> None:
        """Snapshot the meta log's end *before* the rendezvous barrier, then join every stage's group."""
        self.meta_index = await self.api.weight_meta_end()  # answers are capped: ask for the end itself
        backend = self.receiver.backend
        self.receiver.abort()
        for name in self.group_names:
            backend.destroy_group(name)
        self.group_names = [spec.group_name for spec in specs.values()]
        self.next_update, self._ahead = 1, {}  # senders count their updates afresh in the new groups
        await join_all(backend, list(specs.values()))
        self.train_pp_size = ranks.train_pp_size

    async def recv_weight(self) -> int:
        """Receive one whole update; returns the new version. DCSTimeoutError if it does not end in time,
        WeightMetaVersionError for an entry it must not take (see the module's docstring)."""
        deadline = time.monotonic() + self.timeout_seconds
        update = _Update(self.receiver.weight_version + 1, self.next_update)
        try:
            for meta in self._ahead.pop(update.sent_as, []):
                await self._take(meta, update)
            while len(update.ended) < self.train_pp_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DCSTimeoutError(
                        f"weight update v{update.version} did not complete within {self.timeout_seconds:g}s "
                        f"({update.received} buckets, {len(update.ended)}/{self.train_pp_size} stages ended)"
                    )
                await self._read(update, left)
        except BaseException:
            self.receiver.abort()
            if update.received or update.ended:  # the rest of this update is stale now
                self.next_update = update.sent_as + 1
            raise
        self.next_update = update.sent_as + 1
        self.receiver.commit(update.version)
        self.apply_weights()
        return update.version

    async def _read(self, update: _Update, left: float) -> None:
        """One answer of the log from `meta_index`: take its entries until `update` ends."""
        # one answer is capped (entries, bytes); a capped one (batch.more) is continued from its next_index
        # (== meta_index once its entries are consumed) at the next turn, which answers at once
        batch = await self.api.recv_weight_meta(self.meta_index, wait_timeout_s=min(left, 5.0))
        if batch.first_index > self.meta_index:  # trimmed or cleared before we read them
            missed = batch.first_index - self.meta_index
            if update.received or update.ended or self._ahead:
                raise WeightSyncError(
                    f"weight update v{update.version}: {missed} weight-meta entries were dropped from the log before "
                    f"this receiver read them (raise weight_meta_max_entries); "
                    f"keeping v{self.receiver.weight_version}"
                )
            log.warning("skipping %d weight-meta entries dropped from the log before this receiver read them", missed)
            self.meta_index = batch.first_index
        for meta in batch.entries:
            self.meta_index += 1
            await self._take(meta, update)
            if len(update.ended) >= self.train_pp_size:
                return  # what follows in this answer is read again by the next call

    async def _take(self, meta: WeightMeta, update: _Update) -> None:
        """Receive `meta`'s bucket into `update`, count its end, keep it for a later update, or drop it."""
        group = meta.closes if meta.is_end else meta.group_name
        if group is not None and group not in self.group_names:
            return  # another group's entry
        if meta.version is None:
            raise WeightMetaVersionError(
                f"weight update v{update.version}: a weight-meta entry of group {group or 'unnamed'} carries no "
                "version (written by a DCS release before versioned entries): upgrade the actors' DCS; "
                f"keeping v{self.receiver.weight_version}"
            )
        if meta.version < update.sent_as:
            get_metrics().record_weight_meta_dropped("stale")
            log.warning(
                "dropped a weight-meta entry of update %d of %s (receiving %d)", meta.version, group, update.sent_as
            )
            return
        if meta.version > update.sent_as:
            if meta.version - update.sent_as > MAX_VERSIONS_AHEAD:
                raise WeightMetaVersionError(
                    f"weight update v{update.version}: group {group} announced update {meta.version} while this "
                    f"receiver still receives update {update.sent_as} of its groups (at most {MAX_VERSIONS_AHEAD} "
                    f"ahead are kept): a pp stage ran too far ahead; keeping v{self.receiver.weight_version}"
                )
            self._ahead.setdefault(meta.version, []).append(meta)
            return
        if meta.is_end:
            update.ended.add(meta.closes or "")
            return
        await asyncio.to_thread(
            self.receiver.receive_bucket, meta.names, meta.dtypes, meta.shapes, meta.group_name, update.version, True
        )
        update.received += 1

    def apply_weights(self) -> None:
        """Copy the receiver's committed weights into `model` (`recv_weight` does it after each commit). The
        names must match the model's state dict exactly: a silent partial load (strict=False) would leave the
        model on old weights with no error."""
        if self.model is None:
            return
        with torch.no_grad():
            result = self.model.load_state_dict(self.receiver.weights, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise WeightSyncError(
                f"v{self.receiver.weight_version} does not match the model: missing {result.missing_keys[:5]} "
                f"(of {len(result.missing_keys)}), unexpected {result.unexpected_keys[:5]} "
                f"(of {len(result.unexpected_keys)}); the receiver holds the weights, the model is not fully updated"
            )


@dataclass
class _Update:
    """The update one `recv_weight` receives: its version here (`version`, the receiver's count), the senders'
    version of it in the current groups (`sent_as`), buckets received, and the groups whose sentinel arrived."""

    version: int
    sent_as: int
    received: int = 0
    ended: set[str] = field(default_factory=set)
