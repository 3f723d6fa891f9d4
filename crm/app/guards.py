"""What the leaderboard app adds in front of Gradio against clients that hold it: its upload
route cut to what the page uploads, its event streams bounded in number and lifetime, API results
left unread bounded in number and age, and its sessions bounded in number and idle time.

Gradio's upload route writes every file it is given to disk, in a directory per request (a flood
of many-file uploads takes the process's file descriptors); the page uploads one small file, the
votes of its calibration step, so a request may carry one file of at most `upload_bytes`, whose
body must arrive within `read_timeout` seconds. The guard keeps the paths Gradio answers for each
upload and the address that sent it: while `uploads` of those files are still held, or
`uploads_per_address` from one client address, a new one waits (429) for them to age out. The
page's own downloads lie in the same folder (each answer of the calibration step writes two) and
are never counted. (A folder of the uploads' own does not work: Gradio serves files from its
upload folder and its cache only, so the page's downloads would be refused, and allowing its
folder by `allowed_paths` would serve an uploaded HTML file inline.)
Gradio serves event streams that run until the client leaves (a session's heartbeat, the queue's
events, an API call's result), and keeps every API call's result until its caller reads it (`POST
/call/rank`, then `GET /call/rank/{event_id}`): results never read pile up. All are
refused or bounded here, before Gradio sees the request; crm/core/http.py bounds what every
request may send and take.

Gradio also keeps a state per session, made for any session id a request names and kept after
the page has gone (gradio 6.31: `StateHolder.session_data`, a copy of the page's configuration,
about 115 KB for this page, up to 10,000 sessions; the queue's `pending_messages_per_session`,
the answers not yet read, and `pending_event_ids_session`): `/queue/join`, `/run/...`, `/api/...`
and `/call/...` take the id from the request's JSON body, and an API call that names none gets a
session of its own, its event id, kept after its result is read (each holds memory until then).
Sessions bounds them (SessionGuard, behind the body's limit, reads the id) and forgets what
Gradio holds of a session idle for its lifetime, or of an API call's own once its result is read
or dropped. `/component_server` (which also makes a session, from a form too) serves components
with server functions, and the page has none: it is closed.
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
from urllib.parse import parse_qs

from crm.core.errors import excerpt
from crm.core.http import BodyTooLarge, read_body, refuse, replayed

log = logging.getLogger("crm.app")

UPLOAD = re.compile(r"^(/gradio_api)?/upload/?$")
# Routes the page does not use: upload progress (it shows none), component server functions (its
# components have none).
CLOSED = re.compile(r"^(/gradio_api)?/(upload_progress|component_server)/?$")
MULTIPART_OVERHEAD = 2048  # bytes of a one-file multipart body around the file itself
# Streams of events (text/event-stream) that stay open while the client waits.
STREAMS = re.compile(r"^(/gradio_api)?/(heartbeat/[^/]+|queue/data|call/(v2/)?[^/]+/[^/]+)/?$")
# GETs of a session's own streams: its heartbeat (the id in the path), its queue's events (the id
# in the query string).
SESSION_STREAM = re.compile(r"^(/gradio_api)?/(heartbeat/(?P<session>[^/]+)|queue/data)/?$")
CALL = re.compile(r"^(/gradio_api)?/call/(v2/)?[^/]+/?$")  # POST: an API call, answered with its event id
RESULT = re.compile(r"^(/gradio_api)?/call/(v2/)?[^/]+/(?P<event>[^/]+)/?$")  # GET: its result
# POSTs whose JSON body may name a session (`session_hash`) that Gradio then keeps a state for.
SESSION_ROUTES = re.compile(
    r"^(/gradio_api)?/(queue/join|(?P<route>run|api|call|call/v2)/(?P<api>[^/]+))/?$")
# Characters of a session id (a browser's are 11): each is a key of several maps, kept an hour.
MAX_SESSION_ID = 128


class Unread(NamedTuple):
    address: str
    since: float


class Session(NamedTuple):
    address: str
    used: float


def _address(scope) -> str:
    return (scope.get("client") or ("?",))[0]


class Sessions:
    """The page's sessions, bounded: at most `per_address` from one client address and `total` in
    all (a request that names a new one past them is refused), each forgotten (what Gradio holds
    of it dropped) once unused for `idle` seconds, unless an event of it is queued or running or
    a stream of it is open. A session is used by a request that names it and by opening its
    heartbeat or its queue's stream (a browser's page reopens them). Without `page` (tests) only
    the counts are kept."""

    def __init__(self, page=None, per_address: int = 64, total: int = 256, idle: float = 3600.0):
        self.page, self.per_address, self.total, self.idle = page, per_address, total, idle
        self.known: dict[str, Session] = {}
        self.by_address: Counter = Counter()
        self.streaming: Counter = Counter()  # session -> its open streams

    def admit(self, session: str, address: str) -> str | None:
        """None when `session` may be used (and it is marked used), else why not (one line)."""
        now = time.monotonic()
        self.expire(now)
        if session in self.known:
            self.known[session] = self.known[session]._replace(used=now)
            return None
        mine = self.by_address[address]
        if mine >= self.per_address or len(self.known) >= self.total:
            return (f"too many sessions ({mine} from {address}, {len(self.known)} in all; at most "
                    f"{self.per_address} and {self.total}): reuse an open page's, or wait until "
                    f"one has been idle {self.idle:g} s")
        self.known[session] = Session(address, now)
        self.by_address[address] += 1
        return None

    def touch(self, session: str) -> None:
        if session in self.known:
            self.known[session] = self.known[session]._replace(used=time.monotonic())

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for session in [s for s, k in self.known.items() if now - k.used > self.idle]:
            if self.busy(session):
                continue  # looked at again on the next request
            address = self.known.pop(session).address
            self.by_address[address] -= 1
            if self.by_address[address] <= 0:  # the map holds addresses with sessions only
                del self.by_address[address]
            self.forget(session)

    def busy(self, session: str) -> bool:
        """An event of the session queued or running, or one of its streams open: what Gradio
        holds of it is still in use (a running event's answer goes to its session's queue)."""
        if self.streaming[session] > 0:
            return True
        if self.page is None:
            return False
        queue = self.page._queue
        return any(e in queue.event_ids_to_events
                   for e in queue.pending_event_ids_session.get(session, ()))

    def running(self, event_id: str) -> bool:
        """An API call's event queued or running, or its result being read."""
        if self.streaming[event_id] > 0:
            return True
        return self.page is not None and event_id in self.page._queue.event_ids_to_events

    def forget(self, session: str) -> None:
        """What Gradio holds of a session: its state (its States' delete callbacks called), its
        answers not yet read and their event ids."""
        if self.page is None:
            return
        queue = self.page._queue
        queue.pending_messages_per_session.pop(session, None)
        queue.pending_event_ids_session.pop(session, None)
        holder = getattr(self.page, "state_holder", None)  # set once the page is mounted
        if holder is not None and session in holder:
            holder.delete_state(session)
            with holder.lock:
                holder.session_data.pop(session, None)
                holder.time_last_used.pop(session, None)

    def drop_result(self, event_id: str) -> None:
        """An API call's result, read or left unread past its age: the session the call made
        itself (its event id) forgotten whole; in a session the caller named, its unread answers
        dropped (the state is the session's own, forgotten when it is idle)."""
        if self.page is None:
            return
        queue = self.page._queue
        session = next((s for s, ids in queue.pending_event_ids_session.items()
                        if event_id in ids), event_id)
        if session == event_id:
            self.forget(session)
        else:
            queue.pending_messages_per_session.pop(session, None)
            queue.pending_event_ids_session.pop(session, None)


def json_object(body: bytes) -> dict:
    """A JSON request body's object, parsed as Gradio parses it (json.loads: the last of
    repeated keys); {} for anything else, which Gradio refuses itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


class SessionGuard:
    """ASGI middleware behind BodyLimit (so a body arrives whole and bounded): a POST that names
    a session Sessions does not admit gets 429 with one line before Gradio makes a state for it,
    and one that names a handler (`fn_index`) or an API (the path) the page does not have 400 or
    404 (Gradio's lookups raise KeyError or FnIndexInferError: 500 and a traceback)."""

    def __init__(self, app, sessions: Sessions):
        self.app, self.sessions = app, sessions

    async def __call__(self, scope, receive, send) -> None:
        route = SESSION_ROUTES.match(scope.get("path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or route is None:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        data = json_object(body)
        handler, session = data.get("fn_index"), data.get("session_hash")
        page = self.sessions.page
        if route["route"] in ("call", "call/v2"):
            handler = None  # a call names its API by the path only
        if page is not None and handler is not None and (
                type(handler) is not int or handler not in page.fns):
            return await refuse(scope, send, 400, f"no handler {excerpt(handler)} on this page")
        if page is not None and handler is None and route["api"] is not None and route["api"] not in {
                fn.api_name for fn in page.fns.values()}:
            return await refuse(scope, send, 404, f"no API named {excerpt(route['api'])}")
        if not isinstance(session, str):
            session = None
        if session is not None and len(session) > MAX_SESSION_ID:
            return await refuse(scope, send, 400, (
                f"a session id of {len(session)} characters: at most {MAX_SESSION_ID}"))
        if session is not None:
            refused = self.sessions.admit(session, _address(scope))
            if refused is not None:
                return await refuse(scope, send, 429, refused)
        await self.app(scope, replayed(body, receive), send)


class ServingGuard:
    """ASGI middleware in front of the mounted page:

    - an upload (POST) of more than one file, or of more than `upload_bytes` (and the multipart
      framing), is refused (413) with one line, one whose body has not arrived within
      `read_timeout` seconds is cut (408), and any while `uploads` uploaded files are held, or
      `uploads_per_address` from the client's address (429); the routes the page does not use
      are closed (404);
    - at most `per_address` event streams from one client address and `total` in all (429 past
      them), each ended after `lifetime` seconds: a browser's EventSource reconnects, a client
      that opened thousands holds none of them for long;
    - at most `results_per_address` API results not yet read from one address and `results` in
      all (a new call past them: 429); a result unread after `result_age` seconds is dropped, and
      so is a result read (`sessions`: what Gradio holds of it), so an address that never reads
      frees its share and one that reads leaves nothing behind."""

    def __init__(self, app, per_address: int = 8, total: int = 128, lifetime: float = 600.0,
                 results_per_address: int = 32, results: int = 256, result_age: float = 120.0,
                 sessions: Sessions | None = None, upload_bytes: int = 16384, uploads: int = 64,
                 uploads_per_address: int = 8, read_timeout: float = 30.0):
        self.app, self.per_address, self.total, self.lifetime = app, per_address, total, lifetime
        self.upload_bytes, self.uploads = upload_bytes, uploads
        self.uploads_per_address, self.read_timeout = uploads_per_address, read_timeout
        self.uploaded: dict[Path, Unread] = {}  # an uploaded file held -> its sender, since when
        self.results_per_address, self.results, self.result_age = (results_per_address, results,
                                                                    result_age)
        self.sessions = sessions or Sessions()
        self.upload_grace = 10.0
        self.open: Counter = Counter()
        self.unread: dict[str, Unread] = {}  # event id -> its caller's address, since when

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if CLOSED.match(path):
            return await refuse(scope, send, 404, "no such route: this page does not use it")
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
        address = _address(scope)
        self._forget_uploads()
        held = len(self.uploaded)
        mine = sum(u.address == address for u in self.uploaded.values())
        if held >= self.uploads or mine >= self.uploads_per_address:
            return await refuse(scope, send, 429, (
                f"uploaded files held: {mine} from {address}, {held} in all (at most "
                f"{self.uploads_per_address} and {self.uploads}): try again once they age out"))
        try:
            body = await read_body(receive, self.upload_bytes + MULTIPART_OVERHEAD,
                                   self.read_timeout)
        except BodyTooLarge:
            return await refuse(scope, send, 413, (
                f"an upload takes one file of at most {self.upload_bytes} bytes (the votes file)"))
        except TimeoutError:
            return await refuse(scope, send, 408, (
                f"the upload did not arrive within {self.read_timeout:g} s"))
        if body.count(b'filename="') > 1:
            return await refuse(scope, send, 413, "an upload takes one file (the votes file)")
        answer = {"status": 0, "body": b""}

        async def captured(message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body" and len(answer["body"]) < 65536:
                answer["body"] += message.get("body", b"")
            await send(message)

        await self.app(scope, replayed(body, receive), captured)
        if answer["status"] == 200:  # Gradio answers with the paths it wrote
            try:
                paths = json.loads(answer["body"])
            except ValueError:
                return
            for path in paths if isinstance(paths, list) else ():
                if isinstance(path, str):
                    self.uploaded[Path(path)] = Unread(address, time.monotonic())

    def _forget_uploads(self) -> None:
        """Uploads whose file is gone (Gradio deletes each at its age) are no longer held; a
        file may still be on its way for `upload_grace` seconds (Gradio moves some after it
        answers)."""
        now = time.monotonic()
        for path in [p for p, u in self.uploaded.items()
                     if now - u.since > self.upload_grace and not p.is_file()]:
            del self.uploaded[path]

    async def _call(self, scope, receive, send) -> None:
        address = _address(scope)
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
        """Drop the results unread for `result_age` seconds, but for those still queued, running
        or being read (their answer still to be put in their session's queue, or taken)."""
        now = time.monotonic()
        for event_id in [e for e, u in self.unread.items() if now - u.since > self.result_age]:
            if not self.sessions.running(event_id):
                del self.unread[event_id]
                self.sessions.drop_result(event_id)

    def _session_of(self, scope) -> str | None:
        """The session (or, for an API call's result, the event id) a stream belongs to."""
        path = scope.get("path", "")
        result = RESULT.match(path)
        if result:
            return result["event"]
        stream = SESSION_STREAM.match(path)
        if stream is None:
            return None
        if stream["session"]:
            return stream["session"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return query.get("session_hash", [None])[-1]

    async def _stream(self, scope, receive, send) -> None:
        address = _address(scope)
        if self.open[address] >= self.per_address or sum(self.open.values()) >= self.total:
            return await refuse(scope, send, 429, (
                f"too many open event streams ({self.open[address]} from {address}, "
                f"{sum(self.open.values())} in all; at most {self.per_address} and {self.total})"))
        self.open[address] += 1
        session = self._session_of(scope)
        if session is not None:
            self.sessions.touch(session)
            self.sessions.streaming[session] += 1
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
            if session is not None:
                self.sessions.streaming[session] -= 1
                if self.sessions.streaming[session] <= 0:
                    del self.sessions.streaming[session]
            # A result read to its end: no longer unread, and nothing of it kept. One whose
            # reader left early stays unread until it has ended and aged (_expire).
            if response["complete"] and session in self.unread:
                del self.unread[session]
                self.sessions.drop_result(session)
        # Ended by its lifetime (Gradio returns quietly from a cancelled stream): the stream's
        # last chunk, so that the client reads a whole answer and may reconnect.
        if response["started"] and not response["complete"]:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif not response["started"]:
            await refuse(scope, send, 503, f"the stream did not start within {self.lifetime:g} s")
