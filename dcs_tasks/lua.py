"""The one way DCS runs Lua: scripts run by SHA, loaded into Redis once, then `EVALSHA` on every call (never
the whole source each time).

Every script is a module-level `LuaScript` next to the code it serves (`dcs_tasks.checkpoint.store.ledger_scripts`,
`coordinator.scripts`, `dcs_tasks.sync.group_scripts`) and is called with whichever client the caller holds - sync or
asyncio, a plain client or a pipeline - so nothing is registered per client. On NOSCRIPT (a restarted or
failed-over Redis, `SCRIPT FLUSH`) the source is loaded again and the call repeated; a pipeline loads the
scripts it queued before it executes (redis-py's `Pipeline.load_scripts`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

Args = Sequence[Any]


class LuaScript:
    """One Lua source, known to Redis by its SHA1."""

    def __init__(self, source: str) -> None:
        self.source = source
        # the name SCRIPT LOAD gives it (SHA1 as a name, not for security)
        self.sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()

    @property
    def script(self) -> str:
        """The source, under the name redis-py's pipelines read when they load queued scripts."""
        return self.source

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Args = ()) -> Any:
        """EVALSHA with `keys` and `args`; loads the source first if this server does not have it. On a
        pipeline the call is queued (and the script loaded, if needed, when the pipeline executes)."""
        if isinstance(client, redis.client.Pipeline):
            client.scripts.add(self)  # type: ignore[arg-type]  # duck-typed: .sha and .script
            return client.evalsha(self.sha, len(keys), *keys, *args)
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    async def run_async(self, client: aioredis.Redis, keys: Sequence[str], args: Args = ()) -> Any:
        """`__call__` for an asyncio client or pipeline."""
        if isinstance(client, aioredis.client.Pipeline):
            client.scripts.add(self)  # type: ignore[arg-type]
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)
