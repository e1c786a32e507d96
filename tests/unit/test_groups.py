"""Pure rank maths of the control plane (no services needed)."""

from __future__ import annotations

import pytest

from coordinator.groups import (
    GroupRoleError,
    global_rank,
    model_update_group_ranks,
    pp_groups,
    rank_span,
    role_order,
)
from dcs_tasks.config import RoleInfo
from dcs_tasks.models import GroupRanksResponse


def actor(rank: int, **meta: object) -> RoleInfo:
    return RoleInfo(role_name="actor", rank=rank, ip=f"10.0.0.{rank + 1}", metadata=dict(meta))


def test_role_order_puts_configured_roles_first() -> None:
    assert role_order(None, ["rollout", "actor"]) == ["rollout", "actor"]
    assert role_order(["actor", "critic"], ["rollout", "actor"]) == ["actor", "critic", "rollout"]


def test_global_rank_sums_earlier_world_sizes() -> None:
    order = ["actor", "rollout", "reference"]
    sizes = {"actor": 4, "rollout": 2, "reference": 1}
    assert global_rank(order, sizes, "actor", 3) == 3
    assert global_rank(order, sizes, "rollout", 1) == 5
    assert global_rank(order, sizes, "reference", 0) == 6
    with pytest.raises(KeyError):
        global_rank(order, sizes, "critic", 0)


def test_rank_span_is_the_live_count_when_dense_and_keeps_a_dead_nodes_slot() -> None:
    assert rank_span([]) == 0
    assert rank_span([0, 1, 2]) == 3
    assert rank_span([0, 2]) == 3  # rank 1 died: rank 2 keeps its place
    order = ["actor", "rollout"]
    spans = {"actor": rank_span([0, 2]), "rollout": rank_span([0, 1])}
    live = [global_rank(order, spans, "actor", r) for r in (0, 2)] + [
        global_rank(order, spans, "rollout", r) for r in (0, 1)
    ]
    assert live == [0, 2, 3, 4] and len(set(live)) == len(live)


def test_group_ranks_of_each_role() -> None:
    actors = {0: actor(0, pp_size=4)}

    def ranks(role: str, rank: int, need_ref: bool) -> GroupRanksResponse:
        return model_update_group_ranks(role, rank, need_ref, num_actor_fwd=2, num_reference=3, actors=actors)

    a = ranks("actor", 0, True)
    assert (a.global_rank, a.world_size, a.train_pp_size) == (0, 6, 4)
    f = ranks("actor_fwd", 1, False)
    assert (f.global_rank, f.world_size) == (2, 3)
    r = ranks("reference", 2, True)
    assert (r.global_rank, r.world_size) == (5, 6)


def test_pp_size_defaults_to_one_without_actor_zero() -> None:
    answer = model_update_group_ranks("actor_fwd", 0, False, num_actor_fwd=1, num_reference=0, actors={})
    assert answer.train_pp_size == 1 and answer.pp_groups == {}


@pytest.mark.parametrize(("role", "need_ref"), [("rollout", False), ("critic", True), ("reference", False)])
def test_roles_outside_the_group_are_rejected(role: str, need_ref: bool) -> None:
    with pytest.raises(GroupRoleError, match=role):
        model_update_group_ranks(role, 0, need_ref, num_actor_fwd=1, num_reference=1, actors={})


def test_pp_groups_from_source_ranks_only() -> None:
    actors = {
        0: actor(0, is_pp_src_rank=True, pp_rank=0, master_port=11000),
        1: actor(1, is_pp_src_rank=False, pp_rank=0, master_port=11001),
        2: actor(2, is_pp_src_rank=True, pp_rank=1, master_address="10.9.9.9", master_port=11002),
    }
    assert pp_groups(actors) == {
        "update_actor_pp_0": "tcp://10.0.0.1:11000",
        "update_actor_pp_1": "tcp://10.9.9.9:11002",
    }


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"is_pp_src_rank": True}, "master_port"),
        ({"is_pp_src_rank": True, "master_port": "x"}, "master_port"),
        ({"is_pp_src_rank": True, "master_port": 1, "pp_rank": -1}, "pp_rank"),
    ],
)
def test_bad_pp_metadata_names_the_node(meta: dict[str, object], message: str) -> None:
    with pytest.raises(GroupRoleError, match=f"actor_0.*{message}|{message}.*actor_0"):
        pp_groups({0: actor(0, **meta)})
