"""A trainer rank that only holds its node (no checkpoints, no weights), as it runs on a simulated host:
`python -m tests.multihost.agent_node COORDINATOR_URL ROLE RANK`.

A `CheckpointEngineClient` configured from the `DCS_*` environment; it registers and beats through its host's
agent when one answers (dcs_tasks/hostagent.py). Driven by JSON lines on stdin, one JSON answer per line:

  {"op": "status"}   {"via_agent": bool, "registered": bool, "fallbacks": n, "renewals": n}
  {"op": "exit"}
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from dcs_tasks.client.engine import CheckpointEngineClient
from dcs_tasks.config import DCSConfig


def status(client: CheckpointEngineClient) -> dict[str, Any]:
    beats = client._beats
    assert beats is not None
    return {
        "ok": True,
        "via_agent": beats.via_agent,
        "registered": client.is_registered,
        "fallbacks": beats.fallbacks,
        "renewals": beats.renewals,
        "rank": client.rank,
    }


async def main() -> None:
    url, role, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = CheckpointEngineClient(coordinator_url=url, role=role, rank=rank, config=DCSConfig())
    await client.start()
    print(json.dumps({"ready": True, **status(client)}), flush=True)
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            if json.loads(line)["op"] == "exit":
                break
            print(json.dumps(status(client)), flush=True)
    finally:
        await client.stop()


if __name__ == "__main__":
    asyncio.run(main())
