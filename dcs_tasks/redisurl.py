"""Redis URLs without Redis: the Sentinel URL form parsed (`parse_sentinel_url`) and where a URL points
(`redis_location`). Both `config` (checking `redis_url` when it is set) and `redisconn` (building clients)
use it; it imports neither redis nor them.

`sentinel://[[user]:password@]host1[:26379][,host2[:26379]...]/<master_name>[/<db>]`, with an optional
`?sentinel_password=...` when the sentinels themselves require a password (`redisconn` says more).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from dcs_tasks.errors import ConfigError

SENTINEL_SCHEME = "sentinel://"
SENTINEL_PORT = 26379
_FORM = "sentinel://[[user]:password@]host1[:26379][,host2[:26379]...]/<master_name>[/<db>]"


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed Sentinel URL: where the sentinels are and which master (and db) to use."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def _host_port(item: str, url_hint: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep:
        host, port = item, str(SENTINEL_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"Sentinel URL {url_hint}: {item!r} is not host[:port]; expected {_FORM}")
    return host, int(port)


def _split_userinfo(netloc: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, sep, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if sep else None), hosts


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`url` as a `SentinelTarget`; ConfigError naming the problem (never the password) when malformed."""
    parts = urlsplit(url)
    user, password, hosts = _split_userinfo(parts.netloc)
    hint = f"sentinel://...{parts.path}"
    if not hosts:
        raise ConfigError(f"Sentinel URL {hint} names no sentinel host; expected {_FORM}")
    sentinels = tuple(_host_port(item, hint) for item in hosts.split(",") if item)
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2:
        raise ConfigError(f"Sentinel URL {hint} must name the master (and optionally a db): expected {_FORM}")
    if len(path) == 2 and not path[1].isdigit():
        raise ConfigError(f"Sentinel URL {hint}: db {path[1]!r} is not a number; expected {_FORM}")
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ConfigError(f"Sentinel URL {hint}: unknown parameter(s) {sorted(unknown)}; only sentinel_password")
    return SentinelTarget(
        sentinels=sentinels,
        master_name=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=user,
        password=password,
        sentinel_password=query.get("sentinel_password", [None])[0],
    )


def redis_location(url: str) -> str:
    """Where a Redis URL points, without credentials (safe for error messages)."""
    if is_sentinel(url):
        target = parse_sentinel_url(url)
        hosts = ",".join(f"{host}:{port}" for host, port in target.sentinels)
        return f"sentinel {hosts} master {target.master_name!r} db {target.db}"
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}{parts.path}" if parts.hostname else url.split("@")[-1]
