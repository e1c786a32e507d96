"""Actor -> rollout weight updates over SGLang's weight-update HTTP API.

Per update: live rollout nodes from the coordinator -> plan (world size, rank offsets) -> reuse the group
if the engine set (rank, ip, port, gpus) is unchanged, else form a new one -> per bucket, POST
/update_weights_from_distributed to every engine while broadcasting the bucket; the last bucket carries
`flush_cache=True` so receivers commit. When every engine takes flat buckets (DCS receivers), one request
with `bucket_sizes` announces the whole update instead, so the meta costs one round trip per update.
`weight_version` rises by one per successful update, starting above every engine's committed version
when a group forms (so a restarted trainer never goes back). Any failure drops the group (the next update
rebuilds it over the nodes then alive) and raises `WeightSyncError` naming the engine when one is to blame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import httpx
import torch

from dcs_tasks.backends.fusion import FusionLayout
from dcs_tasks.client.coordinator_api import CoordinatorAPI
from dcs_tasks.errors import WeightSyncError
from dcs_tasks.sync.bootstrap_client import ActiveGroup, GroupBootstrapper
from dcs_tasks.sync.models import (
    DCS_FUSED_FORMAT,
    EngineEndpoint,
    GroupPlan,
    QuantizationConfig,
    UpdateWeightsFromDistributedRequest,
)
from dcs_tasks.sync.planning import plan_rollout_group
from dcs_tasks.sync.sender import Announce, AnnounceAll, BucketSender

BLAME_TIMEOUT_SECONDS = 3.0


class RolloutUpdater:
    """Pushes a state dict to every live rollout engine; one instance per trainer process."""

    def __init__(
        self,
        api: CoordinatorAPI,
        bootstrapper: GroupBootstrapper,
        sender: BucketSender,
        timeout_seconds: float,
        rollout_role: str = "rollout",
    ) -> None:
        self.api = api
        self.bootstrapper = bootstrapper
        self.sender = sender
        self.rollout_role = rollout_role
        self.weight_version = 0
        self.group: ActiveGroup | None = None
        self._http = httpx.AsyncClient(timeout=timeout_seconds)

    async def aclose(self) -> None:
        if self.group is not None:
            await self.bootstrapper.release(self.group)
            self.group = None
        await self._http.aclose()

    async def plan(self) -> GroupPlan:
        topology = await self.api.topology(self.rollout_role)
        return plan_rollout_group(topology.nodes.get(self.rollout_role, {}).values())

    async def update(
        self, state: Mapping[str, torch.Tensor], quant: QuantizationConfig | None = None
    ) -> dict[str, Any]:
        """One full update; returns its metrics (bytes, buckets, seconds per phase, GB/s, version)."""
        started = time.perf_counter()
        plan = await self.plan()
        if not plan.engines:
            await self._drop_group()
            return {"engines": 0, "weight_version": self.weight_version, "total_seconds": 0.0}
        rebuilt = await self._ensure_group(plan)
        bootstrap_seconds = time.perf_counter() - started
        assert self.group is not None
        group, version = self.group, self.weight_version + 1
        try:
            if group.plan.flattened:  # DCS receivers: one request announces the whole update
                stats = await self.sender.send(
                    state, group.result.group_name, quant=quant, announce_all=self._announce_all(group, version)
                )
            else:  # SGLang: one request per bucket, one broadcast per tensor
                stats = await self.sender.send(
                    state, group.result.group_name, self._announcer(group, version), quant, flattened=False
                )
        except WeightSyncError as exc:
            await self._drop_group()
            member = exc.member or await self._blame(group.plan)
            raise WeightSyncError(f"update v{version} failed (member: {member or 'unknown'}): {exc}", member) from exc
        except BaseException:
            await self._drop_group()
            raise
        self.weight_version = version
        metrics: dict[str, Any] = stats.as_dict()
        metrics.update(
            engines=len(plan.engines),
            weight_version=version,
            group_name=group.result.group_name,
            group_rebuilt=rebuilt,
            flattened=group.plan.flattened,
            bootstrap_seconds=bootstrap_seconds,
            total_seconds=time.perf_counter() - started,
        )
        return metrics

    async def _ensure_group(self, plan: GroupPlan) -> bool:
        current = self.group
        if (
            current is not None
            and current.plan.signature == plan.signature
            and self.sender.backend.has_group(current.result.group_name)
        ):
            return False
        await self._drop_group()
        self.group = await self.bootstrapper.form_group(plan)
        self.weight_version = max(self.weight_version, *await self._engine_versions(plan))
        return True

    async def _engine_versions(self, plan: GroupPlan) -> list[int]:
        """Engines' committed versions, so a restarted trainer keeps versions rising (0 where unknown): GET
        /get_weight_version (DCS receivers, older SGLang), else /model_info (newer SGLang). SGLang's version is a
        string ("default" before any update); anything but an integer counts as 0."""

        async def one(engine: EngineEndpoint) -> int:
            for path in ("/get_weight_version", "/model_info"):
                try:
                    response = await self._http.get(f"{engine.url}{path}", timeout=2.0)
                    if response.is_success:
                        return int(response.json()["weight_version"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
            return 0

        return list(await asyncio.gather(*(one(e) for e in plan.engines)))

    async def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            await self.bootstrapper.release(group)

    def _announce_all(self, group: ActiveGroup, version: int) -> AnnounceAll:
        async def announce(layouts: list[FusionLayout]) -> None:
            specs = [spec for layout in layouts for spec in layout.specs]
            body = UpdateWeightsFromDistributedRequest(
                names=[s.name for s in specs],
                dtypes=[s.dtype for s in specs],
                shapes=[list(s.shape) for s in specs],
                group_name=group.result.group_name,
                weight_version=str(version),
                flush_cache=True,
                load_format=DCS_FUSED_FORMAT,
                bucket_sizes=[len(layout.specs) for layout in layouts],
            )
            await asyncio.gather(*(self._post(e, body) for e in group.plan.engines))

        return announce

    def _announcer(self, group: ActiveGroup, version: int) -> Announce:
        async def announce(index: int, layout: FusionLayout, last: bool) -> None:
            body = UpdateWeightsFromDistributedRequest(
                names=layout.names,
                dtypes=[s.dtype for s in layout.specs],
                shapes=[list(s.shape) for s in layout.specs],
                group_name=group.result.group_name,
                weight_version=str(version) if last else None,  # SGLang publishes a named version at once
                flush_cache=last,
                load_format=None,
            )
            await asyncio.gather(*(self._post(e, body) for e in group.plan.engines))

        return announce

    async def _blame(self, plan: GroupPlan) -> str | None:
        """The first engine that does not answer GET /health within BLAME_TIMEOUT_SECONDS (None if all answer).
        Any HTTP answer counts as alive: SGLang's /health runs a one-token generation, which can take a second
        and may fail while an update is failing."""
        for engine in plan.engines:
            try:
                await self._http.get(f"{engine.url}/health", timeout=BLAME_TIMEOUT_SECONDS)
            except httpx.HTTPError:
                return engine.node_id
        return None

    async def _post(self, engine: EngineEndpoint, body: UpdateWeightsFromDistributedRequest) -> None:
        url = f"{engine.url}/update_weights_from_distributed"
        try:
            response = await self._http.post(url, json=body.model_dump(mode="json"))
        except httpx.HTTPError as exc:
            raise WeightSyncError(
                f"rollout engine {engine.node_id} at {engine.url} failed: {exc!r}", engine.node_id
            ) from exc
        if not response.is_success:
            raise WeightSyncError(
                f"rollout engine {engine.node_id} refused the update ({response.status_code}): {response.text[:500]}",
                engine.node_id,
            )
