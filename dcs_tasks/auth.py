"""Bearer-token authentication shared by DCS HTTP servers (the coordinator and `dcs receiver`).

One shared secret (`DCSConfig.auth.token`, `DCS_AUTH_TOKEN`) authenticates every call: clients send
`Authorization: Bearer <token>`. `bearer_token_matches` is the one comparison (constant time, scheme
case-insensitive as RFC 6750 and SGLang's `--api-key` check have it); `BearerAuthASGI` is a pure ASGI
middleware around it whose public paths and 401 body are the server's choice: the coordinator's are
/healthz and /metrics and `{"detail": ...}` (`coordinator.middleware`), the receiver's SGLang's
(`sglang_public`, `{"error": "Unauthorized"}`).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from dcs_tasks.httpguard import header, send_json

__all__ = ["SGLANG_UNAUTHORIZED", "BearerAuthASGI", "bearer_token_matches", "header", "sglang_public"]

# SGLang's api-key middleware lets these through without a key (probes and Prometheus scrapes), by prefix
# (so /health_generate too), and every OPTIONS request; everything else needs the key.
SGLANG_PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")
SGLANG_UNAUTHORIZED = {"error": "Unauthorized"}


def bearer_token_matches(authorization: bytes | str | None, token: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>`; the token is compared in constant time."""
    if authorization is None:
        return False
    raw = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    scheme, _, given = raw.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(given, token.encode())


def sglang_public(method: str, path: str) -> bool:
    """What SGLang serves without its api key: OPTIONS, and paths under /health, /ready, /metrics."""
    return method == "OPTIONS" or path.startswith(SGLANG_PUBLIC_PREFIXES)


class BearerAuthASGI:
    """401 with `body` unless the request carries `Authorization: Bearer <token>`, except where
    `is_public(method, path)`; non-HTTP scopes pass through."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        is_public: Callable[[str, str], bool] = sglang_public,
        body: dict[str, Any] | None = None,
    ) -> None:
        if not token:
            raise ValueError("BearerAuthASGI needs a non-empty token")
        self.app = app
        self.token = token
        self.is_public = is_public
        self.body = SGLANG_UNAUTHORIZED if body is None else body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_public(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        if not bearer_token_matches(header(scope, b"authorization"), self.token):
            await send_json(send, 401, self.body, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)
