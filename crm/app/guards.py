"""What the leaderboard app adds in front of Gradio against clients that hold it: its upload
route cut to what the page uploads, its event streams bounded in number and lifetime, and API
results left unread bounded in number and age.

Gradio's upload route writes every file it is given to disk, in a directory per request (24 x
900 distinct 1 KB files took 19,837 of 20,000 descriptors); the page uploads one small file, the
votes of its calibration step, so a request may carry one file of at most `upload_bytes`, and
while `uploads` files lie in Gradio's upload folder a new one waits (429) for them to age out.
Gradio serves event streams that run until the client leaves (a session's heartbeat, the queue's
events, an API call's result), and keeps every API call's result until its caller reads it (`POST
/call/rank`, then `GET /call/rank/{event_id}`): 2,000 results never read held 239 MB. All are
refused or bounded here, before Gradio sees the request; crm/core/http.py bounds what every
request may send and take.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from crm.core.http import refuse

log = logging.getLogger("crm.app")

UPLOAD = re.compile(r"^(/gradio_api)?/upload/?$")
CLOSED = re.compile(r"^(/gradio_api)?/upload_progress/?$")  # the page shows no upload progress
MULTIPART_OVERHEAD = 2048  # bytes of a one-file multipart body around the file itself
# Streams of events (text/event-stream) that stay open while the client waits.
STREAMS = re.compile(r"^(/gradio_api)?/(heartbeat/[^/]+|queue/data|call/(v2/)?[^/]+/[^/]+)/?$")
CALL = re.compile(r"^(/gradio_api)?/call/[^/]+/?$")  # POST: an API call, answered with its event id
RESULT = re.compile(r"^(/gradio_api)?/call/(v2/)?[^/]+/(?P<event>[^/]+)/?$")  # GET: its result


class Unread(NamedTuple):
    address: str
    since: float


class ServingGuard:
    """ASGI middleware in front of the mounted page:

    - an upload (POST) of more than one file, or of more than `upload_bytes` (and the multipart
      framing), is refused (413) with one line, and so is any while `uploads` files lie in
      `upload_folder` (429); the route of upload progress is closed (404);
    - at most `per_address` event streams from one client address and `total` in all (429 past
      them), each ended after `lifetime` seconds: a browser's EventSource reconnects, a client
      that opened thousands holds none of them for long;
    - at most `results_per_address` API results not yet read from one address and `results` in
      all (a new call past them: 429); a result unread after `result_age` seconds is dropped
      (Gradio's `queue`, the page's, holds it), so an address that never reads frees its share."""

    def __init__(self, app, per_address: int = 8, total: int = 128, lifetime: float = 600.0,
                 results_per_address: int = 32, results: int = 256, result_age: float = 120.0,
                 queue=None, upload_bytes: int = 16384, uploads: int = 64, upload_folder=None):
        self.app, self.per_address, self.total, self.lifetime = app, per_address, total, lifetime
        self.upload_bytes, self.uploads, self.upload_folder = upload_bytes, uploads, upload_folder
        self.results_per_address, self.results, self.result_age = (results_per_address, results,
                                                                    result_age)
        self.queue = queue
        self.open: Counter = Counter()
        self.unread: dict[str, Unread] = {}  # event id -> its caller's address, since when

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if CLOSED.match(path):
            return await refuse(scope, send, 404, "no such route: this page shows no upload progress")
        if UPLOAD.match(path):
            return await self._upload(scope, receive, send)
        if scope.get("method") == "GET" and STREAMS.match(path):
            return await self._stream(scope, receive, send)
        if scope.get("method") == "POST" and CALL.match(path):
            return await self._call(scope, receive, send)
        await self.app(scope, receive, send)

    async def _upload(self, scope, receive, send) -> None:
        if scope.get("method") != "POST":
            return await refuse(scope, send, 405, "an upload is a POST")
        held = self._uploads_held()
        if held >= self.uploads:
            return await refuse(scope, send, 429, (
                f"{held} uploaded files held (at most {self.uploads}): try again once they age out"))
        limit = self.upload_bytes + MULTIPART_OVERHEAD
        body, more = b"", True
        while more:  # at most `limit` bytes: read whole, then handed on as one message
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await refuse(scope, send, 413, (
                    f"an upload takes one file of at most {self.upload_bytes} bytes (the votes file)"))
        if body.count(b'filename="') > 1:
            return await refuse(scope, send, 413, "an upload takes one file (the votes file)")
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _uploads_held(self) -> int:
        """Files with content in the upload folder (Gradio's multipart parser also leaves an
        empty temporary file per upload there: those cost no disk and are removed at exit)."""
        if self.upload_folder is None:
            return 0
        held = 0
        for path in Path(self.upload_folder).rglob("*"):
            try:
                held += path.is_file() and path.stat().st_size > 0
            except OSError:  # deleted while counted
                pass
        return held

    async def _call(self, scope, receive, send) -> None:
        address = (scope.get("client") or ("?",))[0]
        self._expire()
        mine = sum(u.address == address for u in self.unread.values())
        if mine >= self.results_per_address or len(self.unread) >= self.results:
            return await refuse(scope, send, 429, (
                f"too many API results not read yet ({mine} from {address}, {len(self.unread)} in "
                f"all; at most {self.results_per_address} and {self.results}): read them "
                f"(GET .../call/<api>/<event_id>), or wait {self.result_age:g} s"))
        answer = {"status": 0, "body": b""}

        async def captured(message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body" and len(answer["body"]) < 4096:
                answer["body"] += message.get("body", b"")
            await send(message)

        await self.app(scope, receive, captured)
        if answer["status"] == 200:
            try:
                event_id = json.loads(answer["body"])["event_id"]
            except (ValueError, KeyError, TypeError):
                return
            self.unread[str(event_id)] = Unread(address, time.monotonic())

    def _expire(self) -> None:
        """Forget results unread for `result_age` seconds, and drop what Gradio holds of those
        whose run has ended (as it does when a reader disconnects)."""
        now = time.monotonic()
        for event_id in [e for e, u in self.unread.items() if now - u.since > self.result_age]:
            del self.unread[event_id]
            queue = self.queue
            if queue is None or event_id in queue.event_ids_to_events:  # still running
                continue
            session = next((s for s, ids in queue.pending_event_ids_session.items()
                            if event_id in ids), None)
            if session is not None:
                queue.pending_messages_per_session.pop(session, None)
                queue.pending_event_ids_session.pop(session, None)

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
            result = RESULT.match(scope.get("path", ""))
            if result:  # read (or its reader gone): no longer unread
                self.unread.pop(result["event"], None)
        # Ended by its lifetime (Gradio returns quietly from a cancelled stream): the stream's
        # last chunk, so that the client reads a whole answer and may reconnect.
        if response["started"] and not response["complete"]:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif not response["started"]:
            await refuse(scope, send, 503, f"the stream did not start within {self.lifetime:g} s")
