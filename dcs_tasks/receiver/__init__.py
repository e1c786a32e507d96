"""Receiving side of weight sync: the in-process `WeightReceiver` and the reference rollout receiver server."""

from dcs_tasks.receiver.weights import WeightReceiver

__all__ = ["WeightReceiver"]
