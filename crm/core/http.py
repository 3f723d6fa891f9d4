"""What the two HTTP servers (the OpenRLHF reward server, the leaderboard app) share to hold under
slow, oversized and hostile clients: uvicorn's h11 protocol with the guards it lacks
(GuardedProtocol), a request head's size bound (HeadLimit), a body read with a size and a time
limit (and the ASGI middleware that applies it in front of another app), and the uvicorn
configuration with all of them, an idle timeout and a connection limit.

uvicorn 0.54 (h11) bounds only a head that arrives in pieces (h11's incomplete-event size): a
head that comes in one read of up to 256 KiB, or with thousands of fields, is taken whole. It has
no deadline for a head, a body or a write: a client that sends part of a request and stalls, or
never reads its answer, holds its connection for ever. `limit_concurrency` answers 503 to a
request that arrives past the limit, but counts only; it closes nothing, and one address may
hold every connection.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from crm.core.json_shape import JsonShapeError, check_shape

log = logging.getLogger("crm.http")

MAX_HEAD = 16 * 1024  # bytes of a request head: the target and the header fields
MAX_HEADER_FIELDS = 100
WRITE_TIMEOUT = 10.0
LOG_EVERY = 10.0  # seconds between two log lines about refused connections


class BodyTooLarge(ValueError):
    pass


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with

    - a deadline for each request's head, counted from the connection's start and from each
      response: a connection still without a whole head when it passes is closed (a body has its
      own deadline: read_body);
    - a write deadline: a connection whose answer has waited `write_timeout` seconds for the
      client to read any of it (the transport's buffer full) is dropped;
    - a share per client address: a connection past `per_address` open ones from its address
      gets 429 and is closed at once, so one address cannot take the pool.

    server_config() makes a subclass per server, with its own numbers and counts."""

    head_timeout = 30.0
    write_timeout = WRITE_TIMEOUT
    per_address = 2**31
    open_by_address: Counter = Counter()  # replaced per server
    refused = {"count": 0, "logged": 0.0}  # replaced per server
    _deadline: asyncio.TimerHandle | None = None
    _write_deadline: asyncio.TimerHandle | None = None
    _address: str | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._address = (self.client or ("?",))[0]
        self.open_by_address[self._address] += 1
        if self.open_by_address[self._address] > self.per_address:
            self._refuse_share()
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        for timer in (self._deadline, self._write_deadline):
            if timer is not None:
                timer.cancel()
        if self._address is not None:
            self.open_by_address[self._address] -= 1
            if self.open_by_address[self._address] <= 0:  # the map holds open addresses only
                del self.open_by_address[self._address]
            self._address = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_timeout, self._write_late)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

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

    def _write_late(self) -> None:
        self._write_deadline = None
        if not self.transport.is_closing():
            log.warning("%s:%s read none of its answer for %g s: connection dropped",
                        *(self.client or ("?", "?")), self.write_timeout)
        self.transport.abort()  # close() would wait to send what the client does not read

    def _refuse_share(self) -> None:
        reason = (f"more than {self.per_address} open connections from {self._address}: "
                  "close some, then retry")
        body = json.dumps({"detail": reason}).encode()
        self.transport.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
        self.transport.close()
        # one line per LOG_EVERY seconds, however many are refused: a flood must not flood the log
        self.refused["count"] += 1
        now = time.monotonic()
        if now - self.refused["logged"] >= LOG_EVERY:
            log.warning("%s 429 %s (%d connections refused so)", self._address, reason,
                        self.refused["count"])
            self.refused.update(count=0, logged=now)


class HeadLimit:
    """ASGI middleware: a request whose head (target and header fields) passes `max_bytes`, or
    holds more than `max_fields` fields, is answered 431 and its connection closed."""

    def __init__(self, app, max_bytes: int = MAX_HEAD, max_fields: int = MAX_HEADER_FIELDS):
        self.app, self.max_bytes, self.max_fields = app, max_bytes, max_fields

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = scope.get("headers") or ()
            size = len(scope.get("raw_path") or scope.get("path", "")) + len(
                scope.get("query_string") or b"") + sum(len(k) + len(v) + 4 for k, v in headers)
            if len(headers) > self.max_fields or size > self.max_bytes:
                reason = (f"a request head of {size} bytes and {len(headers)} fields: at most "
                          f"{self.max_bytes} bytes and {self.max_fields} fields")
                if scope["type"] == "websocket":
                    log.warning("%s websocket refused: %s", _client(scope), reason)
                    return await send({"type": "websocket.close", "code": 1009})
                return await refuse(scope, send, 431, reason)
        await self.app(scope, receive, send)


def server_config(app, *, read_timeout: float, keep_alive: float, connections: int,
                  per_address: int | None = None, write_timeout: float = WRITE_TIMEOUT,
                  **kwargs) -> uvicorn.Config:
    """uvicorn's Config for `app` behind HeadLimit: heads due within `read_timeout` seconds,
    answers read within `write_timeout`, idle connections closed after `keep_alive`, 503 past
    `connections` open connections, 429 past `per_address` from one address (default: all)."""
    protocol = type("Guarded", (GuardedProtocol,), {
        "head_timeout": read_timeout, "write_timeout": write_timeout,
        "per_address": per_address or connections, "open_by_address": Counter(),
        "refused": {"count": 0, "logged": 0.0}})
    return uvicorn.Config(HeadLimit(app), http=protocol, timeout_keep_alive=keep_alive,
                          limit_concurrency=connections, h11_max_incomplete_event_size=MAX_HEAD,
                          **kwargs)


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
    408, as {"detail": "..."}, and the connection closed. A body that is JSON (anything but a
    multipart form that starts with `{` or `[`) may hold at most `json_values` values nested
    `json_depth` deep (crm/core/json_shape.py), else 400: the app parses it whole, holding the
    GIL. The app then reads the same body."""

    def __init__(self, app, max_bytes: int, timeout: float, json_values: int = 10_000,
                 json_depth: int = 32):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout
        self.json_values, self.json_depth = json_values, json_depth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise BodyTooLarge(f"a request body over {self.max_bytes} bytes")
            body = await read_body(receive, self.max_bytes, self.timeout)
        except BodyTooLarge as exc:
            return await refuse(scope, send, 413, f"{exc}: refused")
        except TimeoutError:
            return await refuse(scope, send, 408,
                                f"the request body did not arrive within {self.timeout:g} s")
        headers = dict(scope.get("headers") or ())
        if (not headers.get(b"content-type", b"").lower().startswith(b"multipart/")
                and body.lstrip()[:1] in (b"{", b"[")):
            try:
                check_shape(body, self.json_depth, self.json_values)
            except JsonShapeError as exc:
                return await refuse(scope, send, 400, f"{exc}: refused")
        await self.app(scope, replayed(body, receive), send)


def replayed(body: bytes, receive):
    """An ASGI receive that gives `body` whole as the first message, then what `receive` gives
    (the disconnect, when it comes): a request read by a guard, handed on as it came."""
    delivered = False

    async def replay():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _client(scope) -> str:
    return "%s:%s" % tuple(scope.get("client") or ("?", "?"))


async def refuse(scope, send, status: int, reason: str) -> None:
    """A one-line refusal, {"detail": reason}, logged, the connection closed after it."""
    log.warning("%s %d %s %s", _client(scope), status, scope.get("path", "")[:200], reason)
    await send_json(send, status, {"detail": reason}, close=True)
