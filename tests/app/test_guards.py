"""crm/app/guards.py in process, on a fake ASGI app: an event stream ended at its lifetime with a
whole answer, the stream counts freed, the upload route taking one small file and the progress
route closed. (Through the real server: tests/app/test_usl_app.py.)"""
from __future__ import annotations

import asyncio

from crm.app.guards import ServingGuard


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


def test_the_upload_route_takes_one_small_file_and_nothing_past_the_files_held(tmp_path):
    reached = []

    async def app(scope, receive, send):
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def upload(guard, body: bytes) -> list:
        sent, chunks = [], [body[:100], body[100:]]

        async def receive():
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/gradio_api/upload",
                 "client": ("10.0.0.1", 5), "headers": []}
        asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
        return sent

    def part(name: str, size: int) -> bytes:
        return (b'--b\r\nContent-Disposition: form-data; name="files"; filename="' + name.encode()
                + b'"\r\n\r\n' + b"x" * size + b"\r\n")

    guard = ServingGuard(app, upload_bytes=1000, uploads=1, upload_folder=tmp_path)
    votes = part("votes.jsonl", 900) + b"--b--\r\n"
    assert upload(guard, votes)[0]["status"] == 200 and reached == [votes]  # handed on whole
    two = part("a.txt", 10) + part("b.txt", 10) + b"--b--\r\n"
    big = part("big.txt", 5000) + b"--b--\r\n"
    for body, message in [(two, b"takes one file"), (big, b"at most 1000 bytes")]:
        sent = upload(guard, body)
        assert sent[0]["status"] == 413 and message in sent[1]["body"]
    (tmp_path / "held").write_bytes(b"x")  # one file held: the limit
    (tmp_path / "tmp_empty").write_bytes(b"")  # Gradio's empty leftover does not count
    sent = upload(guard, votes)
    assert sent[0]["status"] == 429 and b"1 uploaded files held" in sent[1]["body"]
    assert len(reached) == 1
    sent = call(guard, "/gradio_api/upload_progress")
    assert sent[0]["status"] == 404
