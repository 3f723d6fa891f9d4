"""crm-usl served for real: one `crm-usl` process for the module (a tiny untrained CRM on a
12-query demo benchmark, 127.0.0.1, a free port), driven through its API with gradio_client and
through its page with Debian's chromium under Playwright (`executable_path`: no browser download).

CRM_USL_SCREENSHOTS=DIR keeps the screenshots of the two tabs there; CRM_USL_CHECKPOINT and
CRM_USL_BENCH serve another CRM and benchmark of the demo's models. The README's screenshots:

    CRM_USL_SCREENSHOTS=docs CRM_USL_CHECKPOINT=outputs/demo/export \
    CRM_USL_BENCH=.cache/demo/raw/bench.jsonl pytest tests/app/test_usl_app.py -k default_then
"""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from helpers import free_port, raw_request
from scorers import export_tiny, run_cli

from crm.data.demo import BENCH_BASELINE, BENCH_MODELS, TRAIN_WORDINGS, write_demo

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
MODELS = sorted(BENCH_MODELS)
# Two criteria as the demo's users write them (a CRM trained on the demo follows them)
CRITERIA = [TRAIN_WORDINGS["concise"][0], TRAIN_WORDINGS["prose"][1]]
READ_TIMEOUT = 2  # serve.read_timeout of the served app: a stalled connection's deadline
WRITE_TIMEOUT = 2  # serve.write_timeout: how long an answer waits for a client that never reads
RESULT_AGE = 3  # serve.result_age: how long an API result waits to be read
UPLOADS, UPLOADS_PER_ADDRESS = 6, 2  # serve.uploads, serve.uploads_per_address


def wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Poll the API info route, as Gradio's own tests wait for a server (not its log line)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"crm-usl exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/gradio_api/info", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"crm-usl did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("usl")
    export = Path(os.environ.get("CRM_USL_CHECKPOINT") or export_tiny(root / "export"))
    bench = Path(os.environ.get("CRM_USL_BENCH") or root / "demo" / "bench.jsonl")
    if not bench.exists():
        write_demo(root / "demo", n_train=0, n_test=2, n_bench=12)
    url = f"http://127.0.0.1:{free_port()}"
    log = root / "server.log"
    temp = {"TMPDIR": root / "tmp", "GRADIO_TEMP_DIR": root / "gradio"}  # what it leaves behind
    for path in temp.values():
        path.mkdir()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "crm-usl"), f"checkpoint={export}",
             f"bench={bench}", f"baseline={BENCH_BASELINE}", f"port={urlsplit(url).port}",
             f"cache.dir={root / 'cache'}", f"hydra.run.dir={root / 'run'}",
             f"serve.read_timeout={READ_TIMEOUT}", f"serve.write_timeout={WRITE_TIMEOUT}",
             f"serve.result_age={RESULT_AGE}", f"serve.uploads={UPLOADS}",
             f"serve.uploads_per_address={UPLOADS_PER_ADDRESS}"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in temp.items()}})
    wait_for_server(url, proc, log)
    counts = Counter(json.loads(line)["topic"] for line in bench.read_text().splitlines())
    yield {"url": url, "root": root, "export": export, "bench": bench, "log": log, "pid": proc.pid,
           "topics": [t for t, _ in counts.most_common(2)], "all_topics": list(counts)}
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    proc.wait(timeout=60)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # the per-board CSVs and Gradio's files and directories (downloads, uploads) are deleted at
    # exit
    assert not [p for path in temp.values() for p in path.rglob("*")]


# -- the API --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(app):
    from gradio_client import Client

    return Client(app["url"], verbose=False)


def test_the_api_equals_crm_leaderboard(app, client, tmp_path):
    """The app judges as crm-leaderboard with its defaults: the same slot-bias measurement, the
    same orders, the same warning and the same rows (every topic: the sample is drawn from the
    board's pairs)."""
    from crm.cli.leaderboard import run
    from crm.evaluation.render import slot_note

    doc = client.predict("\n".join(CRITERIA), [], api_name="/rank")
    assert set(doc) >= {"criteria", "topics", "examples", "models", "baseline", "version", "rows",
                        "slot_bias", "both_orders"}
    assert doc["criteria"] == CRITERIA and doc["baseline"] == BENCH_BASELINE
    assert sorted(doc["models"]) == MODELS and doc["topics"] == app["all_topics"]
    assert f"{app['export'].parent.name}/{app['export'].name}" in doc["version"]

    reference = run_cli("leaderboard", run, [
        f"checkpoint={app['export']}", f"bench={app['bench']}", f"baseline={BENCH_BASELINE}",
        f"criteria={json.dumps(CRITERIA)}", "progress=false"], tmp_path / "leaderboard")
    board = reference["boards"][0]
    assert doc["examples"] == reference["examples"]["used"]
    assert doc["slot_bias"] == board["slot_bias"] and doc["slot_bias"]["pairs"] > 0
    assert doc["both_orders"] == board["both_orders"]
    assert slot_note(doc) == slot_note(board)

    def rates(row):
        cells = {"overall": row["overall"], **row["topics"]}
        return {k: (c["win_rate"], c["ci_low"], c["ci_high"], c["n"]) for k, c in cells.items()}

    assert {r["model"]: rates(r) for r in doc["rows"]} == {r["model"]: rates(r)
                                                           for r in board["rows"]}
    assert [r["rank_ub"] for r in doc["rows"]] == [r["rank_ub"] for r in board["rows"]]


def test_the_api_ranks_on_every_topic_when_given_none(app, client):
    doc = client.predict("I prefer short answers.", [], api_name="/rank")
    assert doc["topics"] == app["all_topics"]
    assert doc["examples"] == len(app["bench"].read_text().splitlines())
    assert all(set(r["topics"]) == set(app["all_topics"]) for r in doc["rows"])


@pytest.mark.parametrize("criteria, topics, message", [
    ("", [], "No criteria"), (" \n\t", [], "No criteria"),
    ("x\n" * 21, [], "21 lines of criteria: at most 20"),
    ("x" * 2001, [], "2001 characters long: at most 2000"),
    ("be brief", ["no such topic"], "Unknown topics: 'no such topic'"),
    ("alpha beta gamma delta " * 80, [], "too long for this CRM")])
def test_the_api_refuses_bad_input_with_a_message(app, client, criteria, topics, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=message) as error:
        client.predict(criteria, topics, api_name="/rank")
    assert "Traceback" not in str(error.value)


# -- the page -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(app):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a board is scored on a shared 2-core machine
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(app, browser, tmp_path):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    outside = []  # requests to any host but the app's: none may be made
    page.on("request", lambda r: outside.append(r.url)
            if urlsplit(r.url).hostname not in (None, "127.0.0.1") else None)
    page.on("dialog", lambda d: outside.append(f"dialog: {d.message}"))
    yield page
    context.close()
    assert outside == []


def screenshot(page, name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    page.screenshot(path=path, full_page=True)
    keep = os.environ.get("CRM_USL_SCREENSHOTS")
    if keep:  # a 256-colour palette: a third of the size, for the repository
        from PIL import Image

        Path(keep).mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("RGB").quantize(256).save(Path(keep) / name, optimize=True)


# Gradio's Dataframe is a virtual grid: read it through its ARIA roles.
def column_names(page, selector: str) -> list[str]:
    return page.locator(f"{selector} [role=columnheader]").evaluate_all(
        "cells => cells.map(c => c.title)")


def body_rows(page, selector: str) -> list[list[str]]:
    rows = page.locator(f"{selector} [role=row][data-index]")
    return [[c.strip() for c in rows.nth(i).locator("[role=gridcell]").all_inner_texts()]
            for i in range(rows.count())]


def row_count(page, selector: str) -> int:
    """Rows of data (a virtual grid renders only those in view)."""
    return int(page.locator(f"{selector} [role=grid]").get_attribute("aria-rowcount")) - 1


def generate(page, expect) -> None:
    page.locator("#generate").click()
    expect(page.locator("#board-info")).to_contain_text("# Examples")


def test_the_page_default_then_customized_board(app, page, tmp_path):
    from playwright.sync_api import expect

    page.goto(app["url"])
    expect(page.locator("#default-table")).to_contain_text("Rank (UB)")
    default_models = {row[2] for row in body_rows(page, "#default-table")}
    assert default_models == set(MODELS)
    screenshot(page, "usl_default.png", tmp_path)

    page.get_by_role("tab", name="Customizable leaderboard").click()
    page.get_by_role("button", name="Clear all").click()
    boxes = page.locator("#topics input[type=checkbox]")
    expect(boxes.first).not_to_be_checked()
    assert all(not boxes.nth(i).is_checked() for i in range(boxes.count()))
    for topic in app["topics"]:
        page.locator("#topics label").filter(has_text=f"{topic} (").click()
    page.locator("#criteria textarea").fill("\n".join(CRITERIA))
    generate(page, expect)
    topics_shown = [t for t in app["all_topics"] if t in app["topics"]]  # the benchmark's order
    columns = ["Rank", "Rank (UB)", "Model", "Overall (%)", "95% CI", *topics_shown]
    assert column_names(page, "#board") == columns
    rows = body_rows(page, "#board")
    # best first; equal win rates share a rank ("1, 2, 2, 4")
    rates = [float(r[3]) for r in rows]
    assert rates == sorted(rates, reverse=True)
    assert [int(r[0]) for r in rows] == [1 + sum(other > rate for other in rates) for rate in rates]
    assert {r[2] for r in rows} == set(MODELS)
    screenshot(page, "usl_custom.png", tmp_path)

    with page.expect_download() as download:
        page.locator("#download").click()
    with open(download.value.path(), newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert table[0] == columns and len(table) == 9
    assert [r[2] for r in table[1:]] == [r[2] for r in rows]

    # the drill-down: a model's examples, its response beside the baseline's
    page.get_by_text("Why does a model rank where it does?").click()
    page.locator("#drill-model input").click()
    page.get_by_role("option", name=rows[0][2]).click()
    expect(page.locator("#drill")).to_contain_text("P(win)")
    expect(page.locator("#drill")).to_contain_text("P(tie)")
    assert row_count(page, "#drill") == sum(
        1 for line in app["bench"].read_text().splitlines()
        if json.loads(line)["topic"] in app["topics"])

    # the link reproduces the board in a fresh page
    href = page.locator("#share a").get_attribute("href")
    assert href.startswith("?criteria=")
    fresh = page.context.new_page()
    fresh.goto(app["url"] + "/" + href)
    expect(fresh.locator("#board-info")).to_contain_text("# Examples")
    assert column_names(fresh, "#board") == columns
    assert body_rows(fresh, "#board") == rows
    assert fresh.locator("#criteria textarea").input_value() == "\n".join(CRITERIA)
    fresh.close()


def test_the_page_calibrates_the_board_with_your_votes(app, page, tmp_path):
    """After a board: the suggested pairs one at a time, the board recomputed with PPI intervals
    and rank sets after each answer (timed here, from the click to the new board in the page);
    the votes download as crm-leaderboard's votes file and upload again."""
    from playwright.sync_api import expect

    from crm.evaluation.leaderboard import select
    from crm.evaluation.user_votes import read_votes

    page.goto(app["url"])
    page.get_by_role("tab", name="Customizable leaderboard").click()
    page.locator("#criteria textarea").fill("\n".join(CRITERIA))
    generate(page, expect)  # every topic: the fixture's 12 queries x 8 models
    page.get_by_text("Calibrate with your votes").click()
    expect(page.locator("#vote-pair")).to_contain_text("Your criteria")
    answers = ["a", "b", "tie", "a", "skip"] * 5  # 20 votes: PPI's minimum
    seconds, shown_lines = [], []
    for answered, choice in enumerate(answers, start=1):
        # the responses keep their lines: a bulleted answer does not read as prose
        shown_lines += [page.locator(f"#response-{side}").inner_text().count("\n- ")
                        for side in "ab"]
        started = time.perf_counter()
        page.locator(f"#vote-{choice}").click()
        expect(page.locator("#vote-status")).to_contain_text(f"{answered} pairs answered")
        seconds.append(time.perf_counter() - started)
    expect(page.locator("#vote-status")).to_contain_text(
        "20 votes, 25 pairs answered; prediction-powered intervals from 20 of your votes, with "
        "the CRM's error")
    assert max(shown_lines) >= 2  # one of the 50 responses shown has two bullets or more
    print(f"browser: click to recomputed board, s: median {sorted(seconds)[12]:.3f}, "
          f"max {max(seconds):.3f}")
    assert sorted(seconds)[12] < 1.0 and max(seconds) < 2.0
    assert column_names(page, "#board")[:7] == ["Rank", "Rank (UB)", "Rank set", "Model",
                                                "Overall (%)", "95% CI", "Votes"]
    rows = body_rows(page, "#board")
    assert sum(int(r[6]) for r in rows) == 20 and {r[3] for r in rows} == set(MODELS)

    saved = tmp_path / "votes.jsonl"
    saved.write_bytes(votes_download(page).read_bytes())
    lines = [json.loads(x) for x in saved.read_text().splitlines()]
    assert len(lines) == 20 and sum(x["verdict"] == "tie" for x in lines) == 5
    assert len(read_votes(saved, select(app["bench"], BENCH_BASELINE)).used) == 20

    # another browser (its own storage) starts without votes; the file brings them back
    other = page.context.browser.new_context(viewport={"width": 1280, "height": 900})
    fresh = other.new_page()
    fresh.goto(app["url"])
    fresh.get_by_role("tab", name="Customizable leaderboard").click()
    fresh.locator("#criteria textarea").fill("\n".join(CRITERIA))
    generate(fresh, expect)
    fresh.get_by_text("Calibrate with your votes").click()
    expect(fresh.locator("#vote-status")).to_contain_text("No votes yet")
    with fresh.expect_file_chooser() as chooser:
        fresh.locator("#votes-upload").click()
    chooser.value.set_files(str(saved))
    expect(fresh.locator("#vote-status")).to_contain_text("20 votes, 0 pairs answered")
    assert body_rows(fresh, "#board") == rows
    other.close()


def votes_download(page) -> Path:
    with page.expect_download() as download:
        page.locator("#votes-download").click()
    return Path(download.value.path())


def test_the_page_keeps_your_votes_across_boards_and_reloads(app, page):
    """10 votes; the same board generated again, then the page reloaded (a new session, as
    after the server forgot an idle one): the 10 are still there, on the board and in the
    download. They are kept per criteria set: a board under other criteria has none."""
    from playwright.sync_api import expect

    mine = "I like answers that get to the point."  # this test's own criteria set

    def open_board(criteria: str) -> None:
        page.get_by_role("tab", name="Customizable leaderboard").click()
        page.locator("#criteria textarea").fill(criteria)
        page.locator("#generate").click()

    page.goto(app["url"])
    open_board(mine)
    expect(page.locator("#board-info")).to_contain_text("# Examples")
    page.get_by_text("Calibrate with your votes").click()
    for answered, choice in enumerate(["a", "b", "tie", "a", "b"] * 2, start=1):
        page.locator(f"#vote-{choice}").click()
        expect(page.locator("#vote-status")).to_contain_text(f"{answered} pairs answered")
    voted = {(v["idx"], v["model"], v["verdict"])
             for v in map(json.loads, votes_download(page).read_text().splitlines())}
    assert len(voted) == 10

    kept = "10 votes kept from before under these criteria, 10 pairs answered"
    page.locator("#generate").click()  # the same board again
    expect(page.locator("#vote-status")).to_contain_text(kept)
    open_board("I like answers with a list of steps.")  # other criteria: none of these votes
    expect(page.locator("#vote-status")).to_contain_text("No votes yet")
    page.reload()
    open_board(mine)
    page.get_by_text("Calibrate with your votes").click()
    expect(page.locator("#vote-status")).to_contain_text(kept)
    assert {(v["idx"], v["model"], v["verdict"])
            for v in map(json.loads, votes_download(page).read_text().splitlines())} == voted


def test_the_page_contrast_and_similarity(app, page):
    from playwright.sync_api import expect

    page.goto(app["url"])
    page.get_by_role("tab", name="Customizable leaderboard").click()
    page.locator("#criteria textarea").fill("I prefer short answers.")
    page.locator("#contrast textarea").fill("I prefer long, detailed answers.")
    page.locator("#describe textarea").fill("I ask about cooking and recipes")
    generate(page, expect)
    expect(page.locator("#board-info")).to_contain_text("most similar to")
    expect(page.get_by_text("Kendall tau between the two rankings")).to_be_visible()
    assert len(body_rows(page, "#contrast-left")) == len(body_rows(page, "#contrast-right")) == 8


def test_the_page_shows_bad_input_as_text(app, page):
    from playwright.sync_api import expect

    page.goto(app["url"])
    page.get_by_role("tab", name="Customizable leaderboard").click()
    page.locator("#generate").click()  # empty criteria
    expect(page.locator("#status")).to_contain_text("Cannot rank: No criteria")
    page.get_by_role("button", name="Clear all").click()
    page.locator("#criteria textarea").fill("be brief")
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("No topic selected")

    page.get_by_role("button", name="Select all").click()
    evil = '<img src=x onerror="window.__xss = 1">'
    page.locator("#criteria textarea").fill(f"be brief\n{evil}")
    generate(page, expect)
    expect(page.locator("#board-info")).to_contain_text(evil)  # shown as text
    assert page.locator("#board-info img").count() == 0
    assert page.evaluate("window.__xss") is None
    assert "Traceback" not in page.content()


# -- hostile and oversized requests (issue 35) ------------------------------------------------------

def test_the_http_layer_refuses_a_50mb_body_and_any_upload_but_the_votes_file(app):
    """A 50 MB body is refused (413) from its Content-Length, before a byte of it is read; the
    upload route takes the page's one upload, the votes file: a file over max_upload (16 KiB) or
    several files in a request get a one-line 413 and nothing is written; upload progress and
    component server functions (which the page does not use) are closed (404)."""
    head = (f"POST /gradio_api/call/rank HTTP/1.1\r\nHost: {urlsplit(app['url']).netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * 2**20}\r\n\r\n").encode()
    t0 = time.perf_counter()
    answer = raw_request(app["url"], head + b'{"data": ["' + b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"over 1048576 bytes" in answer
    assert time.perf_counter() - t0 < 5
    def files() -> set:
        return {p for p in (app["root"] / "gradio").rglob("*") if p.is_file()}

    before = files()
    upload = httpx.post(f"{app['url']}/gradio_api/upload",
                        files={"files": ("big.txt", b"x" * 32768, "text/plain")}, timeout=30)
    assert upload.status_code == 413 and "at most 16384 bytes" in upload.json()["detail"]
    for route in ("/gradio_api/upload", "/upload"):
        upload = httpx.post(f"{app['url']}{route}", timeout=30,
                            files=[("files", (f"{i}.txt", b"x" * 1000, "text/plain"))
                                   for i in range(50)])
        assert upload.status_code == 413 and "takes one file" in upload.json()["detail"]
    progress = httpx.get(f"{app['url']}/gradio_api/upload_progress", timeout=30)
    assert progress.status_code == 404
    component = httpx.post(f"{app['url']}/gradio_api/component_server", timeout=30, json={
        "data": None, "component_id": 1, "fn_name": "ls", "session_hash": "made-up"})
    assert component.status_code == 404 and "does not use it" in component.json()["detail"]
    assert not {p for p in files() - before if p.name != "leaderboard.csv"}  # boards' downloads only


def test_json_bombs_are_refused_before_gradio_parses_them(app):
    """1 MiB of `[],[],...` or of deep nesting through /rank: a one-line 400 at once."""
    for body in [b'{"data": [' + b"[]," * 300_000 + b"[]]}",
                 b'{"data": [' + b"[" * 40 + b"]" * 40 + b"]}"]:
        t0 = time.perf_counter()
        answer = httpx.post(f"{app['url']}/gradio_api/call/rank", content=body, timeout=30,
                            headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and time.perf_counter() - t0 < 5
        assert "JSON with over 10000 values" in answer.text or "nested deeper" in answer.text


def api_call(url: str, data: list) -> str:
    """/rank called over raw HTTP as any script may (no client to check or fill the inputs):
    the event stream of its answer."""
    event = httpx.post(f"{url}/gradio_api/call/rank", content=json.dumps({"data": data}),
                       headers={"Content-Type": "application/json"}, timeout=30)
    assert event.status_code == 200, event.text
    return httpx.get(f"{url}/gradio_api/call/rank/{event.json()['event_id']}", timeout=120).text


@pytest.mark.parametrize("data, message", [
    ([5, []], "The criteria must be text, not int."),
    ([{"a": 1}, []], "The criteria must be text, not dict."),
    (["be brief\ud800", []], "a lone surrogate"),
    (["be brief", [7]], "Topics must be a list of topic names"),
    (["be brief"], "rank: 1 of its 2 inputs given"),
    ([], "rank: 0 of its 2 inputs given"),
], ids=["number", "object", "surrogate", "topic-number", "one-input", "no-input"])
def test_api_mistakes_are_messages_to_the_user(app, data, message):
    answer = api_call(app["url"], data)
    assert "event: error" in answer and message in answer, answer


def connect_from(url: str, source: str) -> socket.socket:
    address = urlsplit(url)
    return socket.create_connection((address.hostname, address.port), timeout=10,
                                    source_address=(source, 0))


def test_stalled_connections_are_closed_within_the_read_timeout(app):
    """A part of a head, or a head and part of a body (an API call's, an upload's), then
    nothing: the server closes each within serve.read_timeout (the second after a 408)."""
    netloc = urlsplit(app["url"]).netloc
    head = f"POST /gradio_api/call/rank HTTP/1.1\r\nHost: {netloc}\r\n".encode()
    upload = (f"POST /gradio_api/upload HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: "
              "multipart/form-data; boundary=b\r\nContent-Length: 300\r\n\r\n--b\r\n").encode()
    results = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda data=data: results.append(raw_request(app["url"], data)))
               for data in [head] * 10 + [head + b"Content-Length: 100\r\n\r\n{"] * 10
               + [upload] * 5]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=READ_TIMEOUT + 15)
    assert len(results) == 25 and time.perf_counter() - t0 < READ_TIMEOUT + 8
    assert sorted(r[:12] for r in results) == [b""] * 10 + [b"HTTP/1.1 408"] * 15


def test_uploads_are_held_per_address_and_the_pages_downloads_never_count(app):
    """More files than serve.uploads in Gradio's folder, as the page's downloads leave them:
    an upload is still taken. serve.uploads_per_address from one client address, as a reverse
    proxy on 127.0.0.1 names it (X-Forwarded-For): its next gets a one-line 429 while another
    address uploads."""
    downloads = [app["root"] / "gradio" / f"download-{i}" / "leaderboard.csv"
                 for i in range(UPLOADS + 1)]
    for path in downloads:
        path.parent.mkdir()
        path.write_text("Rank,Model\n")

    def post(address: str, n: int) -> httpx.Response:
        vote = json.dumps({"idx": "x", "model": "y", "verdict": "win", "n": n}) + "\n"
        return httpx.post(f"{app['url']}/gradio_api/upload", timeout=30,
                          headers={"X-Forwarded-For": address},
                          files={"files": ("votes.jsonl", vote.encode(), "application/json")})

    try:
        assert [post("10.9.0.1", n).status_code for n in range(UPLOADS_PER_ADDRESS)] == [
            200] * UPLOADS_PER_ADDRESS
        refused = post("10.9.0.1", UPLOADS_PER_ADDRESS)
        assert refused.status_code == 429
        assert f"{UPLOADS_PER_ADDRESS} from 10.9.0.1" in refused.json()["detail"]
        assert post("10.9.0.2", 0).status_code == 200
    finally:
        for path in downloads:
            path.unlink()
            path.parent.rmdir()


def test_one_address_holds_a_share_of_connections_and_streams(app):
    """64 silent connections from 127.0.0.3 (serve.per_address): its next gets a one-line 429
    at once. 8 heartbeat streams from 127.0.0.2 (serve.streams_per_address): its ninth gets 429.
    Meanwhile 127.0.0.1 is served."""
    held = [connect_from(app["url"], "127.0.0.3") for _ in range(64)]
    try:
        time.sleep(0.5)  # accepted
        with connect_from(app["url"], "127.0.0.3") as extra:
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 429") and b"more than 64 open connections" in answer
        assert httpx.get(f"{app['url']}/gradio_api/info", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()
    netloc = urlsplit(app["url"]).netloc
    streams = []
    try:
        for i in range(8):
            s = connect_from(app["url"], "127.0.0.2")
            s.sendall(f"GET /gradio_api/heartbeat/s{i} HTTP/1.1\r\nHost: {netloc}\r\n\r\n".encode())
            assert s.recv(4096).startswith(b"HTTP/1.1 200")  # streaming
            streams.append(s)
        answer = raw_request(app["url"], f"GET /gradio_api/heartbeat/s9 HTTP/1.1\r\nHost: "
                                         f"{netloc}\r\n\r\n".encode(), source="127.0.0.2")
        assert answer.startswith(b"HTTP/1.1 429") and b"too many open event streams" in answer
        assert httpx.get(f"{app['url']}/gradio_api/info", timeout=10).status_code == 200
    finally:
        for s in streams:
            s.close()


def test_a_client_that_never_reads_is_dropped(app):
    """Pipelined requests for the page, never read: once its answers fill the buffers the
    connection is dropped within serve.write_timeout."""
    address = urlsplit(app["url"])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((address.hostname, address.port))
    s.setblocking(False)
    request = f"GET / HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode() * 200
    dropped, deadline = None, time.monotonic() + WRITE_TIMEOUT + 20
    try:
        while time.monotonic() < deadline:
            try:
                s.send(request)
            except BlockingIOError:  # the server reads no more: its answers wait
                pass
            except OSError as exc:
                dropped = exc
                break
            time.sleep(0.2)
    finally:
        s.close()
    assert isinstance(dropped, (ConnectionResetError, BrokenPipeError)), dropped
    assert httpx.get(f"{app['url']}/gradio_api/info", timeout=10).status_code == 200


def page_call(url: str, api_name: str, data: list) -> str:
    """One of the page's own (private) handlers called through Gradio's queue, as the browser
    calls it, with whatever inputs: the session's event stream."""
    config = httpx.get(f"{url}/config", timeout=30).json()
    fn = next(d for d in config["dependencies"] if d.get("api_name") == api_name)
    session = f"test-{api_name}-{time.monotonic_ns()}"
    joined = httpx.post(f"{url}/gradio_api/queue/join", timeout=30, json={
        "data": data, "fn_index": fn["id"], "session_hash": session, "event_data": None,
        "trigger_id": None})
    assert joined.status_code == 200, joined.text
    return httpx.get(f"{url}/gradio_api/queue/data", params={"session_hash": session},
                     timeout=120).text


@pytest.mark.parametrize("api_name, data, message", [
    ("generate", ["be brief", "", 5, "", 5, {}], "an input this page cannot read"),
    ("generate", ["be brief", "", [], "cooking", "abc", {}], "an input this page cannot read"),
    ("generate", [7, "", [], "", 5, {}], "Cannot rank:** No topic selected"),
    ("drill", [["x"], None], "is not in the list of choices"),
], ids=["topics-number", "k-text", "criteria-number", "model-list"])
def test_the_pages_own_handlers_answer_wrong_types_in_one_line(app, api_name, data, message):
    answer = page_call(app["url"], api_name, data)
    assert '"error": null' not in answer and "Traceback" not in answer
    assert message in answer, answer


def test_api_results_never_read_are_bounded_per_address_and_expire(app):
    """32 /rank calls from 127.0.0.4 whose results it never reads (serve.results_per_address):
    its next call gets a one-line 429 while 127.0.0.1 is served; once they are RESULT_AGE
    seconds old they are dropped and 127.0.0.4 may call again."""
    def call(http) -> httpx.Response:
        return http.post(f"{app['url']}/gradio_api/call/rank", timeout=30,
                         json={"data": ["General user preference", []]})

    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4")) as http:
        t0 = time.monotonic()
        assert [call(http).status_code for _ in range(32)] == [200] * 32
        refused = call(http)
        assert refused.status_code == 429 and "not read yet (32 from 127.0.0.4" in refused.text
        assert "event: complete" in api_call(app["url"], ["General user preference", []])
        time.sleep(max(0.0, RESULT_AGE + 0.3 - (time.monotonic() - t0)))
        assert call(http).status_code == 200
