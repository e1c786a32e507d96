"""Trainer side of group bootstrap: enqueue the bootstrap task, join as rank 0, retry with backoff.

Call order: `form_group(plan)` -> (updates) -> `release(group)`. Each attempt sends its bootstrap with a
fresh request id (also its task id), so a redelivered bootstrap task returns that attempt's group again
instead of forming another (dcs_tasks/sync/group_bootstrap.py); `release` turns the group record DESTROYED.

A group counts as formed only from what SGLang's protocol gives: every engine's `POST
/init_weights_update_group` answered success (SGLang answers only after each of its TP ranks built the group)
and the trainer's own group construction completed within `group_init_timeout_seconds` (for gloo that
constructor connects the full mesh, so it completes only once every engine rank connected). For NCCL see
`dcs_tasks.backends.process_group` (the first broadcast proves it). Timeouts and port collisions are retried
`max_retries` times with exponential backoff, then raise `GroupInitError` / `PortAllocationError` naming what
failed; when the trainer's own construction failed too, the error carries its reason and every engine's, and
blames the trainer when it failed by itself (e.g. its master port taken: the engines, left without a master,
are victims), not by waiting for or losing its members. Failures no retry can fix raise at once, before any
join is sent: a backend that cannot run in this process (`check_backend`: NCCL without CUDA, a missing device,
an unknown backend -> `BackendUnavailable`) and a loopback master address with an engine on another address
(`LoopbackAddressError`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import ResultSet
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import RedisError

from dcs_tasks.backends.base import CommBackend, GroupSpec
from dcs_tasks.backoff import backoff_delay
from dcs_tasks.celery_app import TaskName, node_queue
from dcs_tasks.config import BackendType, DCSConfig, RoleInfo
from dcs_tasks.errors import BackendUnavailable, GroupInitError, PortAllocationError, WeightSyncError
from dcs_tasks.netaddr import check_master_reachable
from dcs_tasks.sync.wire import (
    BootstrapRequest,
    BootstrapResult,
    DestroyRequest,
    EngineEndpoint,
    GroupPlan,
    JoinOutcome,
    JoinResult,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActiveGroup:
    plan: GroupPlan
    result: BootstrapResult


class GroupBootstrapper:
    """Forms rollout update groups through the host's Celery worker; this process is rank 0."""

    def __init__(
        self, config: DCSConfig, celery: Celery, backend: CommBackend, group_prefix: str, master_address: str
    ) -> None:
        self.config = config
        self.celery = celery
        self.backend = backend
        self.group_prefix = group_prefix
        self.master_address = master_address

    def check_reachable(self, engines: Iterable[EngineEndpoint]) -> None:
        """`LoopbackAddressError` at once when this master address is loopback and an engine is not: it could
        never connect, and the group would only time out (then be retried)."""
        members = ((engine.node_id, engine.ip) for engine in engines)
        check_master_reachable(self.group_prefix, self.master_address, members)

    async def form_group(self, plan: GroupPlan) -> ActiveGroup:
        check_backend(self.backend.backend_type, self.backend.device_id)  # before any join is sent; not retried
        self.check_reachable(plan.engines)
        last: WeightSyncError | None = None
        for attempt in range(self.config.task.max_retries + 1):
            try:
                return await self._form_once(plan)
            except (GroupInitError, PortAllocationError) as exc:
                last = exc
                if attempt == self.config.task.max_retries:
                    break  # no wait after the last attempt
                delay = backoff_delay(
                    attempt, self.config.task.retry_delay_seconds, self.config.task.retry_backoff_max_seconds, "none"
                )
                log.warning("group formation attempt %d failed (%s); retrying in %.1fs", attempt + 1, exc, delay)
                await asyncio.sleep(delay)
        assert last is not None
        kind = type(last)
        raise kind(f"group formation failed after {self.config.task.max_retries + 1} attempts: {last}", last.member)

    async def _form_once(self, plan: GroupPlan) -> ActiveGroup:
        request_id = uuid.uuid4().hex  # one per attempt: every delivery of it forms the same group
        request = BootstrapRequest(
            group_prefix=self.group_prefix,
            master_address=self.master_address,
            plan=plan,
            backend=self.backend.backend_type,
            request_id=request_id,
        )
        result = BootstrapResult.model_validate(
            await self.run_task(TaskName.BOOTSTRAP_GROUP, request.model_dump(mode="json"), task_id=request_id)
        )
        spec = GroupSpec(
            result.group_name,
            result.master_address,
            result.master_port,
            result.world_size,
            0,
            self.backend.backend_type,
        )
        timeout = self.config.sync.group_init_timeout_seconds + 10
        joins = ResultSet([self.celery.AsyncResult(i) for i in result.join_task_ids])
        both: tuple[Any, Any] = await asyncio.gather(
            asyncio.to_thread(self.backend.create_group, spec),
            asyncio.to_thread(joins.join, timeout=timeout, propagate=False),  # one thread: result backends
            return_exceptions=True,  # are not thread-safe
        )
        created, joined = both
        group = ActiveGroup(plan, result)
        outcomes = joined if isinstance(joined, list) else [joined] * len(plan.engines)
        trainer = created if isinstance(created, BaseException) else None
        failure = _formation_failure(result.group_name, trainer, self._engine_failures(plan, outcomes))
        if failure is not None:
            await self.release(group)
            raise failure
        for engine in plan.engines:
            peer = RoleInfo(role_name="rollout", rank=engine.rank, ip=engine.ip, port=engine.port)
            for group_rank in range(engine.rank_offset, engine.rank_offset + engine.tp_size):
                self.backend.register_peer(result.group_name, group_rank, peer)
        return group

    @staticmethod
    def _engine_failures(plan: GroupPlan, outcomes: list[Any]) -> list[tuple[int, GroupInitError]]:
        """Every engine whose join failed, in blame order: unreachable engines first (order 0), then refusing
        ones (often victims), then timeouts."""
        failures: list[tuple[int, GroupInitError]] = []
        for engine, outcome in zip(plan.engines, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                failures.append(
                    (1, GroupInitError(f"join task of {engine.node_id} failed: {outcome!r}", engine.node_id))
                )
                continue
            joined = JoinResult.model_validate(outcome)
            if not joined.success:
                order = {JoinOutcome.UNREACHABLE: 0, JoinOutcome.REFUSED: 1}.get(joined.outcome, 2)
                failures.append(
                    (
                        order,
                        GroupInitError(
                            f"{joined.node_id} could not join ({joined.outcome.value}): {joined.message}",
                            joined.node_id,
                        ),
                    )
                )
        return sorted(failures, key=lambda f: f[0])

    async def run_task(self, name: TaskName, payload: dict[str, Any], task_id: str | None = None) -> Any:
        """Send task `name` to this host's worker (its node queue) and wait for its result; `GroupInitError` when
        no worker runs it in time or the broker is unreachable. It expires when this wait does: a delivery that
        comes later (a killed worker's task, restored) is dropped by the worker, not run for a trainer that gave
        up. Besides `form_group`, the client reserves a pp stage's master port with it (a group without engines)."""
        timeout = self.config.sync.group_init_timeout_seconds
        try:
            queue = node_queue(self.config.host_name)
            sent = self.celery.send_task(name.value, args=[payload], queue=queue, task_id=task_id, expires=timeout)
            return await asyncio.to_thread(sent.get, timeout=timeout)
        except (TimeoutError, CeleryTimeoutError) as exc:  # Celery 5's TimeoutError is not the builtin's subclass
            raise GroupInitError(
                f"no `dcs worker` on host {self.config.host_name} ran {name.value} within {timeout:g}s; "
                "start one (`dcs worker`) on the trainer's host"
            ) from exc
        except BROKER_ERRORS as exc:
            raise GroupInitError(
                f"cannot run {name.value}: the Celery broker / result backend is unreachable ({exc!r})"
            ) from exc

    async def release(self, group: ActiveGroup) -> None:
        """Drop the local group and enqueue its teardown (engines, port, record); does not wait for it."""
        self.backend.destroy_group(group.result.group_name)
        request = DestroyRequest(
            group_name=group.result.group_name,
            host=self.config.host_name,
            master_port=group.result.master_port,
            engines=list(group.plan.engines),
        )
        send_teardown(self.celery, request, self.config.host_name)


# What Celery's client raises when Redis (broker or result backend) is unreachable.
BROKER_ERRORS = (KombuOperationalError, RedisError, OSError)


def send_teardown(celery: Celery, request: DestroyRequest, host: str) -> None:
    """Enqueue a group's teardown, best effort: with the broker down this only logs (the port reservation
    expires by itself), so a teardown in an error path never hides the error being handled."""
    try:
        celery.send_task(TaskName.DESTROY_GROUP.value, args=[request.model_dump(mode="json")], queue=node_queue(host))
    except BROKER_ERRORS as exc:
        log.warning(
            "could not enqueue the teardown of group %s (%r); its port reservation expires", request.group_name, exc
        )


def _formation_failure(
    group_name: str, trainer: BaseException | None, failures: list[tuple[int, GroupInitError]]
) -> GroupInitError | None:
    """The error of a group that did not form, carrying the trainer's reason and every engine's. The trainer is
    blamed (`member` None, its reason first) when its own construction failed for a reason of its own (not by
    waiting for, or losing the connection to, its members) and no engine was unreachable: then the engines,
    left without a master, are its victims. Otherwise the first engine in blame order is."""
    if trainer is None and not failures:
        return None
    engines = [error for _, error in failures]
    unreachable = any(order == 0 for order, _ in failures)
    own = trainer is not None and not _caused_by_members(trainer) and not unreachable
    reasons = [str(e) for e in engines]
    if trainer is not None:
        reasons.insert(0 if own or not engines else len(reasons), f"trainer (rank 0): {trainer}")
    blamed = None if own or not engines else engines[0]
    error = GroupInitError(f"group {group_name} did not form: {'; '.join(reasons)}", blamed.member if blamed else None)
    error.__cause__ = blamed or trainer
    return error


# How torch words a rendezvous that failed because of the other members (they never came, or went away).
_MEMBER_FAILURES = ("timeout", "timed out", "connection reset", "connection refused", "closed by peer", "broken pipe")


def _caused_by_members(error: BaseException) -> bool:
    """Whether the trainer's group construction failed waiting for its members or losing them (not by itself)."""
    cause = error.__cause__ or error
    text = str(cause).lower()
    return isinstance(cause, TimeoutError) or any(words in text for words in _MEMBER_FAILURES)


def check_backend(
    backend: BackendType | str,
    device_id: int | None,
    *,
    cuda_devices: int | None = None,
    nccl_built: bool | None = None,
) -> BackendType:
    """The backend, if it can run in this process; else `BackendUnavailable` saying why and what to use.

    Checked before anything is registered or any engine is asked to join: NCCL with no CUDA device used to be
    found only by the trainer's group construction, after engines were asked to join, and each attempt then
    waited out the group-init timeout. `cuda_devices` / `nccl_built` default to what torch reports here."""
    try:
        kind = BackendType(backend)
    except ValueError:
        kind = None
    if kind not in (BackendType.GLOO, BackendType.NCCL):
        name = getattr(backend, "value", backend)
        raise BackendUnavailable(
            f"backend {name!r} cannot carry weight updates: DCS broadcasts over 'gloo' (CPU tensors) or 'nccl' "
            "(CUDA tensors); pass backend_type=BackendType.GLOO or BackendType.NCCL"
        )
    if kind is BackendType.GLOO:
        return kind
    devices = (
        cuda_devices if cuda_devices is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    )
    built = nccl_built if nccl_built is not None else dist.is_nccl_available()
    missing = [] if devices else ["sees no CUDA device (torch.cuda.is_available() is False)"]
    missing += [] if built else ["has no NCCL built in (torch.distributed.is_nccl_available() is False)"]
    if missing:
        raise BackendUnavailable(
            f"backend 'nccl' cannot run here: torch {torch.__version__} in this process {' and '.join(missing)}; "
            "on a CPU host use backend_type=BackendType.GLOO"
        )
    if device_id is not None and not 0 <= device_id < devices:
        raise BackendUnavailable(
            f"device_id {device_id} does not exist: this host has {devices} CUDA device(s), ids 0-{devices - 1}; "
            "pass one of them (or None for the current device)"
        )
    return kind
