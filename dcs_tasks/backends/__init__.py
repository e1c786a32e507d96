"""Communication backends: the `CommBackend` interface, tensor fusion and the torch.distributed backend."""

from dcs_tasks.backends.base import CommBackend, CommHandle, GroupSpec, RecvRequest, SendRequest
from dcs_tasks.backends.device_direct import DeviceDirectBackend
from dcs_tasks.backends.fusion import FusionLayout, TensorFusion, plan_buckets
from dcs_tasks.tensors import TensorSpec

__all__ = [
    "CommBackend",
    "CommHandle",
    "DeviceDirectBackend",
    "FusionLayout",
    "GroupSpec",
    "RecvRequest",
    "SendRequest",
    "TensorFusion",
    "TensorSpec",
    "plan_buckets",
]
