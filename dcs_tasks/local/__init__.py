"""DCS on one machine: `LocalStack` (behind `dcs up`) and the end-to-end demo (behind `dcs demo`)."""

from __future__ import annotations

from dcs_tasks.local.procs import LocalStackError
from dcs_tasks.local.stack import LocalStack

__all__ = ["LocalStack", "LocalStackError"]
