"""Communication backends: the `CommBackend` interface, tensor fusion, the torch.distributed backend and the
in-process loopback backend (for tests)."""

from dcs_tasks.backends.base import CommBackend, CommHandle, GroupSpec, RecvRequest, SendRequest
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import FusionLayout, TensorFusion, plan_buckets
from dcs_tasks.backends.loopback import LoopbackBackend, LoopbackHub
from dcs_tasks.tensors import TensorSpec

__all__ = [
    "CommBackend",
    "CommHandle",
    "DeviceDirectBackend",
    "FusionLayout",
    "GroupSpec",
    "LoopbackBackend",
    "LoopbackHub",
    "RecvRequest",
    "SendRequest",
    "TensorFusion",
    "TensorSpec",
    "plan_buckets",
]
