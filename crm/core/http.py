"""What the two HTTP servers (the OpenRLHF reward server, the leaderboard app) share to hold under
slow and oversized requests: a deadline on each request's head, a body read with a size and a
time limit (and the ASGI middleware that applies it in front of another app), and the uvicorn
configuration with both, an idle timeout and a connection limit.

uvicorn 0.54 (h11) bounds a request head's size (16 KiB) and closes an idle kept-alive connection
(`timeout_keep_alive`), but has no deadline for a head or a body: a client that sends part of a
request and stalls holds its connection for ever. `limit_concurrency` answers 503 to a request
that arrives past the limit, but counts only; it closes nothing.
"""
from __future__ import annotations

import asyncio
import json
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("crm.http")


class BodyTooLarge(ValueError):
    pass


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head, counted from the
    connection's start and from each response: a connection still without a whole head when it
    passes is closed. (A body has its own deadline: read_body.)"""

    head_timeout = 30.0  # set per server: head_deadline_protocol()
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_late(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request in progress
        if waiting and not self.transport.is_closing():
            log.warning("%s:%s sent no whole request head within %g s: connection closed",
                        *(self.client or ("?", "?")), self.head_timeout)
            self.transport.close()


def server_config(app, *, read_timeout: float, keep_alive: float, connections: int,
                  **kwargs) -> uvicorn.Config:
    """uvicorn's Config for `app`: heads due within `read_timeout` seconds, idle connections
    closed after `keep_alive`, 503 past `connections` open connections."""
    protocol = type("HeadDeadline", (HeadDeadlineProtocol,), {"head_timeout": read_timeout})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive,
                          limit_concurrency=connections, **kwargs)


async def read_body(receive, max_bytes: int, timeout: float) -> bytes:
    """An ASGI request's whole body. Past `max_bytes`: BodyTooLarge (the rest left unread); not
    all there within `timeout` seconds: TimeoutError."""
    parts, size, more = [], 0, True
    async with asyncio.timeout(timeout):
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > max_bytes:
                raise BodyTooLarge(f"a request body over {max_bytes} bytes")
    return b"".join(parts)


async def send_json(send, status: int, payload: dict, close: bool = False) -> None:
    """A whole JSON response; `close`: the connection closes after it (a body left unread)."""
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": int(status), "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """ASGI middleware: each HTTP request's body is read whole (at most `max_bytes`, within
    `timeout` seconds) before the app sees it, else 413 (at once when Content-Length says so) or
    408, as {"detail": "..."}, and the connection closed. The app then reads the same body."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise BodyTooLarge(f"a request body over {self.max_bytes} bytes")
            body = await read_body(receive, self.max_bytes, self.timeout)
        except BodyTooLarge as exc:
            return await self._refuse(scope, send, 413, f"{exc}: refused")
        except TimeoutError:
            return await self._refuse(scope, send, 408,
                                      f"the request body did not arrive within {self.timeout:g} s")
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, send, status: int, reason: str) -> None:
        client = "%s:%s" % tuple(scope.get("client") or ("?", "?"))
        log.warning("%s %d %s %s", client, status, scope.get("path", "")[:200], reason)
        await send_json(send, status, {"detail": reason}, close=True)
