"""The OpenRLHF reward server under hostile and oversized input (issue 35), through the real
server on 127.0.0.1: each request bounded before expensive work, nothing user-sized on the event
loop, the fit cache bounded, stalled connections closed. Sizes are the issue's; the time bounds
are generous ones the issue sets (a loaded 2-core machine)."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from scorers import tiny_scorer
from test_adapters import PROMPT, post

from crm.inference.reward import CRMReward
from crm.rl.openrlhf import Limits, RequestError, make_server, samples_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CRITERIA = ["concise answer", "is friendly"]
LABEL = {"criteria": CRITERIA, "reference": "beta reply"}
SMALL = {"query": [PROMPT + "alpha reply<|im_end|>"], "prompts": [PROMPT], "labels": [LABEL]}
FIT_CACHE = 1000
READ_TIMEOUT = 2.0
CONNECTIONS = 48
MB = 2**20


def rss_mb(pid: int | None = None) -> float:
    for line in open(f"/proc/{pid or os.getpid()}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server():
    """The server in this process (its RSS is this process's), its limits raised to 2 M
    characters so that a 1.5 MB query is split rather than refused and to 4,096 samples a
    request (issue 35's sizes), a short read timeout, one address allowed past the connection
    limit (which the tests reach)."""
    reward = CRMReward(tiny_scorer(), "reference", cache_size=FIT_CACHE)
    limits = Limits.of(reward, 2_000_000, items=4096, read_timeout=READ_TIMEOUT,
                       connections=CONNECTIONS, per_address=CONNECTIONS + 1)
    running = make_server(reward, "127.0.0.1", 0, batch_wait=0.01, limits=limits).start()
    assert post(running.url, SMALL)[0] == 200  # warm-up: the first forward
    yield reward, running.url
    running.close()


def test_small_requests_are_answered_while_an_adversarial_query_is_split(server):
    """1.5 MB queries built against the end-piece search (the issue's: a short prompt whose end
    repeats through the query; and a periodic 1.5 MB prompt cut by one character) are split on
    a worker thread in linear time; small requests sent meanwhile are each answered within 1 s."""
    _, url = server
    end = PROMPT[-30:]
    periodic = "ab" * 750_000
    # the periodic query's longest end piece is one period short: the search reads it all
    adversarial = {"query": ["\ufffd" + end * 50_000, "\ufffd" + periodic[:-2] + "b" + "x" * 9],
                   "prompts": [PROMPT, periodic], "labels": [CRITERIA, CRITERIA]}  # no reference
    assert len(adversarial["query"][0]) > 1.5e6
    big: list = []
    sender = threading.Thread(target=lambda: big.append(post(url, adversarial, timeout=60)))
    started = time.perf_counter()
    sender.start()
    latencies = []
    while sender.is_alive() and len(latencies) < 100:
        t0 = time.perf_counter()
        assert post(url, SMALL, timeout=10)[0] == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    sender.join(timeout=60)
    # both rows split (the refusal comes after every row): the reference is missing
    assert big and big[0][0] == 400 and "needs a reference answer" in big[0][1]["error"]
    assert time.perf_counter() - started < 30
    assert latencies and max(latencies) < 1.0, latencies


def test_5mb_of_criteria_is_refused_at_once_in_a_short_line(server, caplog):
    """5 MB of criteria (as a list, and as a label's JSON text) is refused before any
    tokenization: within 1 s, RSS growing under 50 MB, an answer and a log line under 4 KB that
    quote at most ~200 characters of it."""
    reward, url = server
    criteria = "be kind " * (5 * MB // 8)
    bodies = [json.dumps({**SMALL, "labels": [{"criteria": [criteria], "reference": "b"}]}).encode(),
              json.dumps({**SMALL, "labels": [json.dumps({"criteria": criteria})]}).encode()]
    post(url, bodies[0])  # warm-up: the allocator's first 5 MB
    before, sequences = rss_mb(), reward.scorer.counts["sequences"]
    for body in bodies:
        with caplog.at_level(logging.WARNING, logger="crm.rl.openrlhf"):
            caplog.clear()
            t0 = time.perf_counter()
            status, answer = post(url, body)
            elapsed = time.perf_counter() - t0
        assert status == 400 and elapsed < 1.0
        assert "row 0: the label holds" in answer["error"] and "--max-chars" in answer["error"]
        assert len(json.dumps(answer)) < 4096 and answer["error"].count("be kind") < 30
        assert all(len(r.getMessage()) < 4096 for r in caplog.records)
    assert rss_mb() - before < 50
    assert reward.scorer.counts["sequences"] == sequences


def test_distinct_refused_labels_keep_the_fit_cache_and_rss_bounded(server):
    """10 requests of 4,096 distinct labels each (every row but the last fits the CRM; the last
    one's criteria do not, so the request is refused after the fit check, 4,095 new fits cached)
    grow RSS by under 16 MB after warm-up, and the fit cache holds at most its size."""
    reward, url = server
    too_long = " ".join(["alpha beta gamma delta"] * 300)  # fits the characters, not the tokens

    def body(n: int) -> bytes:
        labels = [{"criteria": [f"criterion {n} {i}"], "reference": "b"} for i in range(4095)]
        labels.append({"criteria": [too_long], "reference": "b"})
        return json.dumps({"query": [PROMPT + "alpha"] * 4096, "prompts": [PROMPT] * 4096,
                           "labels": labels}).encode()

    # made before measuring: the client shares the process. The allocator's arenas (one per
    # thread that parses or scores) settle within 3-4 such requests, then RSS stays flat.
    bodies = [body(n) for n in range(14)]
    for warm in bodies[:4]:
        assert post(url, warm, timeout=60)[0] == 400
    before = rss_mb()
    for refused in bodies[4:]:
        status, answer = post(url, refused, timeout=60)
        assert status == 400 and "row 4095: the criteria and query take" in answer["error"]
    assert len(reward._fits) <= FIT_CACHE
    assert rss_mb() - before < 16


@pytest.mark.parametrize("body", [
    b"[" * 10_000 + b"]" * 10_000,  # past the parser's own recursion limit
    b'{"query": ' + b"[" * 20 + b"]" * 20 + b"}",  # parsed, then past the depth limit
    json.dumps({**SMALL, "labels": ["{" + '"criteria": [' * 5000 + "]" * 5000 + "}"]}).encode(),
    b'{"query": [' + b"9" * 5000 + b"]}",  # a number past Python's digit limit
], ids=["nested-10000", "nested-20", "label-json-nested", "huge-number"])
def test_nested_or_unreadable_json_is_a_400(server, body):
    status, answer = post(server[1], body)
    assert status == 400
    assert "Traceback" not in answer["error"] and len(answer["error"]) < 400


def test_refusals_quote_a_short_excerpt_of_the_value():
    """Every message that names a value cuts it (the label checks of crm/rl/labels.py and the
    reward's own), whatever the size under the character limit."""
    limits = Limits(chars=100_000)
    for label in ({"criteria": {"x": "y" * 90_000}}, {"criteria": ["y" * 90_000, 5],
                                                      "reference": "b"}):
        body = {"query": [PROMPT + "a"], "prompts": [PROMPT], "labels": [label]}
        try:
            samples = samples_of(body, "reference", limits)
            CRMReward(tiny_scorer(), "reference")(
                [s.query for s in samples], [s.response for s in samples],
                criteria=[s.criteria for s in samples], reference=[s.reference for s in samples])
        except (RequestError, ValueError) as exc:
            assert "yyyy" in str(exc) and len(str(exc)) < 600
        else:
            raise AssertionError("not refused")


def test_stalled_connections_are_closed_and_the_connection_limit_holds(server):
    """Connections that send part of a head, or a head and part of a body, and stall are closed
    within the read timeout (the second after a 408); while CONNECTIONS of them are open a new
    request gets 503 at once, and once they are closed it is served."""
    _, url = server
    address = urlsplit(url)
    head = (f"POST {address.path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
            "Content-Type: application/json\r\n").encode()
    def connect(data: bytes) -> socket.socket:
        s = socket.create_connection((address.hostname, address.port), timeout=10)
        s.sendall(data)
        return s

    # heads whose bodies stall first (past the limit, a whole head is answered 503 at once)
    bodies = [connect(head + b'Content-Length: 100\r\n\r\n{"query"') for _ in range(8)]
    time.sleep(0.3)
    heads = [connect(head) for _ in range(CONNECTIONS - len(bodies))]
    time.sleep(0.3)  # accepted: the server holds CONNECTIONS connections
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(SMALL).encode()), timeout=10)
    assert refused.value.code == 503
    t0 = time.perf_counter()
    answers = []
    for s in bodies + heads:
        data = b""
        while chunk := s.recv(4096):  # until the server closes it (or the 10 s socket timeout)
            data += chunk
        answers.append(data)
        s.close()
    assert time.perf_counter() - t0 < READ_TIMEOUT + 4
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers[:len(bodies)])
    assert not any(answers[len(bodies):])
    assert post(url, SMALL)[0] == 200
