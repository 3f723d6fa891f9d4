"""What the leaderboard app adds in front of Gradio against clients that hold it: its closed
routes, and its event streams bounded in number and lifetime.

Gradio serves routes the page never uses (an upload route that writes every file it is given to
disk, in a directory per request) and event streams that run until the client leaves (a session's
heartbeat, the queue's events, an API call's result). Both are refused or bounded here, before
Gradio sees the request; crm/core/http.py bounds what every request may send and take.
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter

from crm.core.http import refuse

log = logging.getLogger("crm.app")

# The page has no upload field: nothing it does posts a file.
CLOSED = re.compile(r"^(/gradio_api)?/upload(_progress)?/?$")
# Streams of events (text/event-stream) that stay open while the client waits.
STREAMS = re.compile(r"^(/gradio_api)?/(heartbeat/[^/]+|queue/data|call/[^/]+/[^/]+)/?$")


class ServingGuard:
    """ASGI middleware in front of the mounted page:

    - a closed route (Gradio's upload) is answered 404 with one line, its body never read;
    - at most `per_address` event streams from one client address and `total` in all (429 past
      them), each ended after `lifetime` seconds: a browser's EventSource reconnects, a client
      that opened thousands holds none of them for long."""

    def __init__(self, app, per_address: int = 8, total: int = 128, lifetime: float = 600.0):
        self.app, self.per_address, self.total, self.lifetime = app, per_address, total, lifetime
        self.open: Counter = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if CLOSED.match(path):
            return await refuse(scope, send, 404, "no such route: this page takes no uploads")
        if scope.get("method") == "GET" and STREAMS.match(path):
            return await self._stream(scope, receive, send)
        await self.app(scope, receive, send)

    async def _stream(self, scope, receive, send) -> None:
        address = (scope.get("client") or ("?",))[0]
        if self.open[address] >= self.per_address or sum(self.open.values()) >= self.total:
            return await refuse(scope, send, 429, (
                f"too many open event streams ({self.open[address]} from {address}, "
                f"{sum(self.open.values())} in all; at most {self.per_address} and {self.total})"))
        self.open[address] += 1
        response = {"started": False, "complete": False}

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                response["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                response["complete"] = True
            await send(message)

        try:
            async with asyncio.timeout(self.lifetime):
                await self.app(scope, receive, tracked)
        except TimeoutError:
            pass
        finally:
            self.open[address] -= 1
            if self.open[address] <= 0:  # the map holds open addresses only
                del self.open[address]
        # Ended by its lifetime (Gradio returns quietly from a cancelled stream): the stream's
        # last chunk, so that the client reads a whole answer and may reconnect.
        if response["started"] and not response["complete"]:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif not response["started"]:
            await refuse(scope, send, 503, f"the stream did not start within {self.lifetime:g} s")
