"""HTTP routes of the coordinator, one APIRouter per concern."""

from coordinator.routes import nodes, ops, topology, weight_meta

ROUTERS = (nodes.router, topology.router, weight_meta.router, ops.router)
