"""The one exponential backoff every DCS retry loop uses (task retries, group formation, engine probes, the
coordinator client).

`delay(failures)` is `min(cap, base * 2**failures)`, then jittered: "equal" jitter draws from [d/2, d] (keeps
a floor so a retry is never immediate, spreads a fleet that failed together), "full" from [0, d], "none"
returns d itself (a single caller whose timing tests and logs rely on a fixed schedule).
"""

from __future__ import annotations

import random
from typing import Literal

Jitter = Literal["none", "equal", "full"]
JITTERS: tuple[Jitter, ...] = ("none", "equal", "full")


def backoff_delay(failures: int, base: float, cap: float, jitter: Jitter = "equal") -> float:
    """Seconds to wait before the retry that follows `failures` failures (0: the first retry waits ~`base`).

    Raises ValueError for a negative `failures`, `base` or `cap`, or an unknown `jitter`, naming which."""
    if failures < 0:
        raise ValueError(f"failures must be >= 0, got {failures}")
    if base < 0 or cap < 0:
        raise ValueError(f"base and cap must be >= 0 seconds, got base={base}, cap={cap}")
    if jitter not in JITTERS:
        raise ValueError(f"jitter must be one of {', '.join(JITTERS)}, got {jitter!r}")
    # 2**1100 would not convert to a float (OverflowError); 2**1000 * base already exceeds any real cap
    delay = min(cap, base * (2 ** min(failures, 1000)))
    if jitter == "equal":
        return delay / 2 + random.uniform(0, delay / 2)
    if jitter == "full":
        return random.uniform(0, delay)
    return delay
