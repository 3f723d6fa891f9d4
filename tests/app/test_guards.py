"""crm/app/guards.py in process, on a fake ASGI app: an event stream ended at its lifetime with a
whole answer, the stream counts freed, the upload route taking one small file and the progress
route closed, sessions bounded per address and in all and forgotten when idle. (Through the real
server: tests/app/test_usl_app.py; the sessions on Gradio's own store: tests/app/test_usl.py.)"""
from __future__ import annotations

import asyncio
import json
import time

from crm.app.guards import ServingGuard, SessionGuard, Sessions


async def endless_stream(scope, receive, send) -> None:
    """Gradio's heartbeat, as far as the guard sees it: it returns quietly when cancelled."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    try:
        while True:
            await send({"type": "http.response.body", "body": b"data: ALIVE\n\n", "more_body": True})
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        return


def call(guard: ServingGuard, path: str, method: str = "GET", client=("10.0.0.1", 5)) -> list:
    sent = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "client": client, "headers": []}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
    return sent


def test_a_stream_ends_at_its_lifetime_with_a_whole_answer_and_frees_its_count():
    guard = ServingGuard(endless_stream, per_address=1, total=4, lifetime=0.2)
    sent = call(guard, "/gradio_api/heartbeat/abc")
    assert sent[0]["status"] == 200 and len(sent) > 3
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert not guard.open  # freed: the address may open another
    assert call(guard, "/gradio_api/heartbeat/abc")[0]["status"] == 200


def test_the_upload_route_takes_one_small_file_and_a_share_per_address(tmp_path):
    """One small file a request, in time; past `uploads_per_address` uploaded files held from
    one address that address waits (429) while another is served, and past `uploads` everyone
    does, until a file ages out; other files beside them (the page's downloads) never count."""
    reached = []

    async def app(scope, receive, send):  # Gradio's upload route: writes the file, answers its path
        reached.append((await receive())["body"])
        path = tmp_path / f"{len(reached)}" / "votes.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps([str(path)]).encode()})

    def upload(guard, body: bytes, client="10.0.0.1", stall=False) -> list:
        sent, chunks = [], [body[:100], body[100:]]

        async def receive():
            if stall and not chunks[1:]:
                await asyncio.sleep(3600)  # the rest of the body never comes
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/gradio_api/upload",
                 "client": (client, 5), "headers": []}
        asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
        return sent

    def part(name: str, size: int) -> bytes:
        return (b'--b\r\nContent-Disposition: form-data; name="files"; filename="' + name.encode()
                + b'"\r\n\r\n' + b"x" * size + b"\r\n")

    for i in range(5):  # the page's downloads, beside the uploads
        (tmp_path / f"download{i}.csv").write_bytes(b"x")
    guard = ServingGuard(app, upload_bytes=1000, uploads=3, uploads_per_address=2,
                         read_timeout=0.2)
    guard.upload_grace = 0
    votes = part("votes.jsonl", 900) + b"--b--\r\n"
    assert upload(guard, votes)[0]["status"] == 200 and reached == [votes]  # handed on whole
    two = part("a.txt", 10) + part("b.txt", 10) + b"--b--\r\n"
    big = part("big.txt", 5000) + b"--b--\r\n"
    for body, message in [(two, b"takes one file"), (big, b"at most 1000 bytes")]:
        sent = upload(guard, body)
        assert sent[0]["status"] == 413 and message in sent[1]["body"]
    sent = upload(guard, votes, stall=True)
    assert sent[0]["status"] == 408 and b"did not arrive within 0.2 s" in sent[1]["body"]
    assert upload(guard, votes)[0]["status"] == 200
    sent = upload(guard, votes)  # 10.0.0.1's two held
    assert sent[0]["status"] == 429 and b"2 from 10.0.0.1, 2 in all" in sent[1]["body"]
    assert upload(guard, votes, client="10.0.0.2")[0]["status"] == 200
    sent = upload(guard, votes, client="10.0.0.3")  # three held in all
    assert sent[0]["status"] == 429 and b"0 from 10.0.0.3, 3 in all" in sent[1]["body"]
    (tmp_path / "1" / "votes.jsonl").unlink()  # aged out
    assert upload(guard, votes)[0]["status"] == 200
    assert len(reached) == 4
    sent = call(guard, "/gradio_api/upload_progress")
    assert sent[0]["status"] == 404


def test_sessions_are_bounded_per_address_and_in_all_and_expire_unless_in_use():
    sessions = Sessions(per_address=2, total=3, idle=0.2)
    assert sessions.admit("a1", "10.0.0.1") is None and sessions.admit("a2", "10.0.0.1") is None
    assert "too many sessions (2 from 10.0.0.1, 2 in all" in sessions.admit("a3", "10.0.0.1")
    assert sessions.admit("a1", "10.0.0.1") is None  # a known session is used again
    assert sessions.admit("b1", "10.0.0.2") is None
    assert "(0 from 10.0.0.3, 3 in all; at most 2 and 3)" in sessions.admit("c1", "10.0.0.3")
    sessions.streaming["a1"] += 1  # its heartbeat open: kept past its idle time
    time.sleep(0.25)
    assert sessions.admit("c1", "10.0.0.3") is None
    assert set(sessions.known) == {"a1", "c1"}
    assert dict(sessions.by_address) == {"10.0.0.1": 1, "10.0.0.3": 1}


def test_a_request_naming_a_session_past_the_bounds_is_refused_before_the_app():
    reached = []

    async def app(scope, receive, send):
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = SessionGuard(app, Sessions(per_address=1, total=8))

    def post(body: bytes, path: str = "/gradio_api/queue/join") -> list:
        sent, chunks = [], [body[:5], body[5:]]

        async def receive():
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "client": ("10.0.0.1", 5),
                 "headers": []}
        asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
        return sent

    first = json.dumps({"data": [], "fn_index": 1, "session_hash": "s1"}).encode()
    assert post(first)[0]["status"] == 200 and reached == [first]  # handed on whole
    second = json.dumps({"data": [], "session_hash": "s2"}).encode()
    for path in ("/gradio_api/queue/join", "/gradio_api/run/predict", "/gradio_api/call/rank"):
        sent = post(second, path)
        assert sent[0]["status"] == 429 and b"too many sessions (1 from 10.0.0.1" in sent[1]["body"]
        assert sent[1]["body"].count(b"\n") == 0
    sent = post(json.dumps({"data": [], "session_hash": "s" * 129}).encode())
    assert sent[0]["status"] == 400 and b"a session id of 129 characters" in sent[1]["body"]
    for body in (first, b'{"data": ["no session"]}', b"not json"):  # Gradio's to answer
        assert post(body)[0]["status"] == 200
    assert len(reached) == 4
