"""The paths a worker may act on: `dcs_tasks.checkpoint.trust` (the rules live with the checkpoint code, so an
in-process committer applies the same ones)."""

from __future__ import annotations

from dcs_tasks.checkpoint.trust import (
    checkpoint_root as checkpoint_root,
)
from dcs_tasks.checkpoint.trust import (
    open_staging as open_staging,
)
from dcs_tasks.checkpoint.trust import (
    replica_root as replica_root,
)
from dcs_tasks.checkpoint.trust import (
    roots_of as roots_of,
)
from dcs_tasks.checkpoint.trust import (
    run_dirs as run_dirs,
)
from dcs_tasks.checkpoint.trust import (
    trusted_run_dir as trusted_run_dir,
)
from dcs_tasks.checkpoint.trust import (
    trusted_staging_path as trusted_staging_path,
)
from dcs_tasks.checkpoint.trust import (
    trusted_step_dir as trusted_step_dir,
)
