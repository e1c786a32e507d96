"""`dcs worker` whose group bootstraps pause after the master port is reserved, before any join is sent: run as
`python -m tests.faults.paused_bootstrap_worker worker ARGS` with `PAUSE_SECONDS_ENV` set. The fault is put in
from outside (this process wraps `group_bootstrap.group_port`); DCS's own code has no hook for it."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from dcs_tasks.cli.main import main
from dcs_tasks.sync import group_bootstrap

PAUSE_SECONDS_ENV = "DCS_TEST_BOOTSTRAP_PAUSE_SECONDS"


def pause_after_port_reservation(seconds: float) -> None:
    reserve = group_bootstrap.group_port

    def paused(*args: Any, **kwargs: Any) -> int:
        port = reserve(*args, **kwargs)
        logging.getLogger(__name__).warning("port %d reserved: pausing %gs before the joins", port, seconds)
        time.sleep(seconds)
        return port

    group_bootstrap.group_port = paused  # bootstrap() looks the name up in its module at each call


if __name__ == "__main__":
    pause_after_port_reservation(float(os.environ[PAUSE_SECONDS_ENV]))
    sys.exit(main())
