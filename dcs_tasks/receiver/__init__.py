"""The reference rollout receiver: `dcs receiver`'s HTTP server (SGLang's weight-update endpoints) and its CLI.

The in-process `WeightReceiver` it serves lives with the rest of weight sync in `dcs_tasks.sync.receiving`; the
name stays importable from here, where docs/weight_sync.md first named it."""

from dcs_tasks.sync.receiving import WeightReceiver

__all__ = ["WeightReceiver"]
