"""JSON request bodies must be Unicode text: a string holding a lone surrogate is refused where the body is read.

JSON's escape `\\ud800` (or the bytes ED A0 80, which `json.loads` of bytes decodes with 'surrogatepass') gives
a Python str holding a lone UTF-16 surrogate. Pydantic's plain `str` accepts it, and it fails only later, where
the text is encoded as UTF-8 (a Redis argument, a size check, an answer): a 500 with a traceback. Every DCS HTTP
server (the coordinator, `dcs receiver`) routes with `StrictJSONRoute`, which refuses such a body before the
route's validation runs, as a `RequestValidationError` naming where the string is (the coordinator's 422; the
receiver's SGLang-shaped 400), so the answer is the same whichever path a request takes (`coordinator.hotpaths`
uses `lone_surrogate_in`).

The check costs a byte scan for the usual body: only a body with non-ASCII bytes or a `\\u` escape is parsed
again and walked. Reading the body first, the route answers one the client stops sending as FastAPI does (400,
`read_body`), never with an unhandled `ClientDisconnect`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

BODY_UNREAD = "There was an error parsing the body"  # FastAPI's 400 for a declared body it could not read
MESSAGE = "the string {text} holds a lone surrogate, which is not Unicode text: send strings as valid UTF-8"


def lone_surrogate(value: Any) -> tuple[tuple[str | int, ...], str] | None:
    """(where, the string's first 40 characters as `ascii()` writes them) of the first string (a dict key or any
    value, at any depth) in parsed JSON `value` holding a lone surrogate, or None. Iterative: no recursion."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if _broken(item):
                return where, ascii(item[:40])
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _broken(key):
                    return (*where, ascii(key[:40])), ascii(key[:40])
                stack.append(((*where, key), child))
        elif isinstance(item, list):
            stack.extend(((*where, i), child) for i, child in enumerate(item))
    return None


def _broken(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_in(raw: bytes) -> tuple[tuple[str | int, ...], str] | None:
    """`lone_surrogate` of JSON body `raw`; None at once for a body of ASCII without a `\\u` escape (the usual one)
    and for a body that is not JSON (the route's own parsing names that)."""
    if raw.isascii() and b"\\u" not in raw:
        return None
    try:
        return lone_surrogate(json.loads(raw))
    except (ValueError, RecursionError):
        return None


def surrogate_error(found: tuple[tuple[str | int, ...], str]) -> RequestValidationError:
    """The validation error for a body `lone_surrogate_in` flagged: loc ("body", *where), FastAPI's shape."""
    where, text = found
    error = {"type": "string_unicode", "loc": ("body", *where), "msg": MESSAGE.format(text=text), "input": text}
    return RequestValidationError([error])


async def read_body(request: Request) -> bytes:
    """The request's body; when the client goes before sending all of it, the 400 FastAPI answers for a declared
    body it could not read (not an unhandled `ClientDisconnect`: a 500 in the metrics and a traceback in the
    log). For every handler that reads a body before FastAPI does."""
    try:
        return await request.body()
    except ClientDisconnect as exc:
        raise HTTPException(status_code=400, detail=BODY_UNREAD) from exc


class StrictJSONRoute(APIRoute):
    """An `APIRoute` whose declared JSON body is refused (`surrogate_error`) when a string in it holds a lone
    surrogate. Routes that read the raw body themselves (no declared body) validate it on their own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def strict_handler(request: Request) -> Response:
            found = lone_surrogate_in(await read_body(request))
            if found is not None:
                raise surrogate_error(found)
            return await handler(request)

        return strict_handler
