"""The one way DCS runs Lua: scripts run by SHA, loaded into Redis once, then `EVALSHA` on every call (never
the whole source each time).

Every script's source is a `.lua` file in a `lua/` folder beside the module that serves it, its KEYS and ARGV
documented at its top; the module (`dcs_tasks.checkpoint.store.ledger.ledger_scripts`, `coordinator.scripts`,
`dcs_tasks.sync.group_scripts`) reads it once, at import, into a module-level `LuaScript` (`lua_script`). A
missing file is an `InstallationError` then, not a failure at the first call. A line `--#include name.lua` is
replaced by that file of the same folder (one level: shared Lua functions, a script run inside another).

A `LuaScript` is called with whichever client the caller holds - sync or asyncio, a plain client or a pipeline - so
nothing is registered per client. On NOSCRIPT (a restarted or failed-over Redis, `SCRIPT FLUSH`) the source is
loaded again and the call repeated; a pipeline loads the scripts it queued before it executes (redis-py's
`Pipeline.load_scripts`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from dcs_tasks.errors import InstallationError

Args = Sequence[Any]
LUA_FOLDER = "lua"  # beside the module that loads the scripts
INCLUDE = "--#include "
_NAME = re.compile(r"[a-z0-9_]{1,64}\.lua")
MAX_SOURCE_BYTES = 256 * 1024  # a script file, includes counted: far above the largest (about 6 KiB)
LOADED: dict[Path, str] = {}  # every .lua file read in this process (includes too), by resolved path


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


def lua_script(module_file: str, name: str) -> LuaScript:
    """The script in file `name` of the `lua/` folder beside `module_file` (the caller's `__file__`), read now.

    Raises InstallationError when the file is missing or unreadable (a package installed without its .lua files).
    """
    return LuaScript(read_lua(Path(module_file).resolve().parent / LUA_FOLDER, name))


def read_lua(folder: Path, name: str, include: bool = True) -> str:
    """The text of `folder/name` with its `--#include other.lua` lines replaced by those files (of `folder`; an
    included file includes nothing). Records every file read in `LOADED`."""
    if not _NAME.fullmatch(name):
        raise InstallationError(f"Lua script name {name!r} is not of the form name.lua (lower case, digits, _)")
    path = folder / name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InstallationError(
            f"Lua script {path} cannot be read ({exc.strerror or exc}): DCS was installed without its .lua files; "
            "reinstall it from a wheel or checkout that ships them (pyproject.toml, [tool.setuptools.package-data])"
        ) from exc
    LOADED[path] = text
    lines = []
    for line in text.splitlines(keepends=True):
        if line.startswith(INCLUDE):
            if not include:
                raise InstallationError(f"{path}: an included Lua file includes nothing ({line.strip()!r})")
            line = read_lua(folder, line[len(INCLUDE) :].strip(), include=False)
        lines.append(line)
    source = "".join(lines)
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise InstallationError(f"Lua script {path} is over {MAX_SOURCE_BYTES} bytes with its includes")
    return source
