"""crm/app/guards.py in process, on a fake ASGI app: an event stream ended at its lifetime with a
whole answer, the stream counts freed, the closed route never reaching the app. (Through the real
server: tests/app/test_usl_app.py.)"""
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


def test_the_upload_route_never_reaches_the_app():
    async def app(scope, receive, send):
        raise AssertionError("reached the app")

    guard = ServingGuard(app)
    for path in ("/gradio_api/upload", "/upload", "/gradio_api/upload_progress"):
        sent = call(guard, path, method="POST")
        assert sent[0]["status"] == 404 and b"takes no uploads" in sent[1]["body"]
