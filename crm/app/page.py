"""The USL web page (Gradio): a default leaderboard, a customizable one, and the same as JSON.

Every handler runs through Gradio's queue. Boards are served by crm.app.service.Leaderboards,
which bounds the model's concurrency itself: Gradio's limits apply per event, and only the
service knows whether a request needs the model or is served from the cache; a cached board must
not queue behind a scoring. Gradio's own queue is bounded too (`queue_size`): beyond it the page
says the server is full.

User text reaches the page only escaped (html.escape), as text in text boxes and tables, or
URL-encoded in the link: criteria holding HTML or script are shown, never run. Expected errors
(BoardError) are shown as a message; anything else is logged with its traceback on the server and
the page gets a one-line notice.

The page is served by uvicorn with the guards of crm/core/http.py (Gradio's own launch sets none):
each request's head (at most 16 KiB) and body due within `read_timeout` seconds, an answer the
client does not read dropped after `write_timeout`, idle connections closed after `keep_alive`,
503 past `connections` and 429 past `per_address` from one address, bodies over `max_body` bytes
refused (413) and JSON bodies past 10,000 values or 32 levels (400) before Gradio reads them; and
with crm/app/guards.py's: Gradio's upload route cut to the page's one upload (one file of at most
`max_upload` bytes a request, the votes file of about 250 votes at 16 KiB, due within
`read_timeout`; none while `uploads` uploaded files are held, or `uploads_per_address` from the
client's address, counted from the paths Gradio answered, so that the page's downloads beside
them never count), event streams at most `streams_per_address` per address and `streams` in all,
each ended after `stream_lifetime` seconds; API results not yet read at most
`results_per_address` per address and `results` in all (429 past them), each dropped when unread
after `result_age` seconds (and once read); sessions (the state Gradio keeps for each page a
browser opens, or any session id a request names) at most `sessions_per_address` per address and
`sessions` in all (429 past them), each forgotten once idle `session_age` seconds. The files
Gradio keeps (CSV downloads, uploads) are deleted once `file_age` seconds old and at exit (with
the empty directories and temporary files Gradio leaves: GradioServer), and the per-board CSVs and
votes files are bounded (MAX_CSV files each) and deleted at exit. Gradio's REST routes run only
the page's unqueued handlers (a queued one there would skip the queue and its bound).
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import csv
import html
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlencode

# Before gradio is imported: no usage report and no version check to outside hosts.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import gradio as gr
from gradio.utils import get_upload_folder
import pandas as pd
import uvicorn
from fastapi import FastAPI

from crm.app.calibrate import SUGGESTED, Calibration, restored, sides, stored, write_votes
from crm.app.config import HttpLimits
from crm.app.guards import ServingGuard, SessionGuard, Sessions
from crm.app.service import BoardError, Leaderboards
from crm.core.files import write_kept
from crm.core.http import BodyLimit, server_config
from crm.evaluation.leaderboard import DEFAULT_CRITERIA
from crm.evaluation.render import interval, rank_set, slot_note, tau_sentence

log = logging.getLogger("crm.app")

TITLE = "User-centric Subjective Leaderboard"
# Fonts bundled with gradio and served by this server, then the system's: the page loads with no
# request to any other host (gradio's GoogleFont would fetch from Google).
THEME = gr.themes.Default(
    font=[gr.themes.LocalFont("Source Sans Pro"), "ui-sans-serif", "system-ui", "sans-serif"],
    font_mono=[gr.themes.LocalFont("IBM Plex Mono"), "ui-monospace", "monospace"])
CSS = """
.usl-chart {font-size: 0.9em; max-width: 760px}
.usl-row {display: grid; grid-template-columns: 9em 1fr 4.5em; align-items: center; gap: 0.5em;
          margin: 2px 0}
.usl-name {overflow: hidden; text-overflow: ellipsis; white-space: nowrap; text-align: right}
.usl-track {position: relative; height: 1.1em; background: var(--neutral-100)}
.usl-fill {position: absolute; left: 0; top: 0; bottom: 0; background: var(--primary-400)}
.usl-ci {position: absolute; top: 45%; height: 2px; background: var(--neutral-800)}
.usl-even {position: absolute; left: 50%; top: -2px; bottom: -2px; border-left: 1px dashed
           var(--neutral-500)}
"""
URL_KEYS = ("criteria", "contrast", "topics", "describe", "k")
CALIBRATE_HELP = (
    "The intervals above take the CRM's verdict for yours. Judge the pairs below under your "
    "criteria (30-100 is plenty) and the board is recomputed after each answer with intervals "
    "that carry the CRM's own error (prediction-powered inference) and the ranks each model can "
    "hold. The pairs are a random sample spread over the models and topics: skip any you cannot "
    "judge, but do not pick. Your votes stay in this page and the file you download; upload it "
    "again to continue.")
DEFAULT_K = 20
MAX_CSV = 256  # per-board CSV files kept (the oldest deleted first)
MAX_MESSAGE = 300  # characters of an error message that may quote an input


# -- rendering a board ----------------------------------------------------------------------------

def table(doc: dict) -> pd.DataFrame:
    """Rank, Rank (UB), Model, Overall (%), its interval, then one column per topic (win rate %)."""
    level = f"{100 * doc['interval']['level']:.0f}% CI"
    calibrated = doc["interval"]["method"] == "ppi"
    rows = []
    for row in doc["rows"]:
        overall = row["overall"]
        rows.append({"Rank": row["rank"], "Rank (UB)": row["rank_ub"],
                     **({"Rank set": rank_set(row)} if calibrated else {}), "Model": row["model"],
                     "Overall (%)": _pct(overall["win_rate"]), level: interval(overall),
                     **({"Votes": overall["votes"]} if calibrated else {}),
                     **{t: _pct(row["topics"][t]["win_rate"]) for t in doc["topics"]}})
    return pd.DataFrame(rows)


def _pct(rate: float | None) -> float | None:
    return None if rate is None else round(100 * rate, 1)


def text(value: str) -> str:
    """`value` as literal text inside Markdown: every ASCII sign becomes an HTML entity, so
    neither HTML nor Markdown (links, emphasis, table bars) in it can take effect."""
    return "".join(c if c.isalnum() or c.isspace() or ord(c) > 127 else f"&#{ord(c)};"
                   for c in value)


def verbatim(value: str) -> str:
    """`value` as literal text (`text`) that keeps its lines and their indentation: a bulleted
    answer must not read as prose."""
    def line(raw: str) -> str:
        body = raw.lstrip(" ")
        return "&#160;" * (len(raw) - len(body)) + text(body)

    return "  \n".join(line(raw) for raw in value.split("\n"))


def info(doc: dict) -> str:
    """The line "Version | # Examples | # Models | Baseline" and the criteria the board ranks by."""
    e = text
    lines = ["| Version | # Examples | # Models | Baseline |", "|---|---|---|---|",
             f"| {e(doc['version'])} | {doc['examples']} | {len(doc['models'])} | "
             f"{e(doc['baseline'])} |", "", "Ranked under: "
             + " · ".join(f"“{e(c)}”" for c in doc["criteria"])]
    if "similar_to" in doc:
        lines.append(f"on the {doc['examples']} queries most similar to "
                     f"“{e(doc['similar_to'])}”")
    if doc.get("both_orders"):
        lines += ["", "Each pair judged in both orders, averaged"]
    if slot_note(doc):  # crm-leaderboard's warning, in its words
        lines += ["", f"**{e(slot_note(doc))}**"]
    return "\n".join(lines)


def trust(doc: dict) -> str:
    """What the board's intervals rest on, in a few words."""
    notes = [r["overall"]["interval_note"] for r in doc["rows"] if "interval_note" in r["overall"]]
    if doc["interval"]["method"] != "ppi":
        return text(notes[0]) if notes else "the intervals assume the CRM's verdict is yours"
    used = doc["votes"]["used"]
    return (f"prediction-powered intervals from {used} of your votes"
            + (f" ({text(notes[0])})" if notes else ", with the CRM's error"))


def chart(doc: dict) -> str:
    """Overall win rates as bars, each with its interval, and the 50% line (plain HTML: no
    plotting library on the server or in the page)."""
    bars = []
    for row in doc["rows"]:
        o = row["overall"]
        rate = 100 * (o["win_rate"] or 0)
        span = ""
        if o["ci_low"] is not None:
            low, high = 100 * o["ci_low"], 100 * o["ci_high"]
            span = f'<span class="usl-ci" style="left:{low:.1f}%;width:{high - low:.1f}%"></span>'
        bars.append(f'<div class="usl-row"><span class="usl-name">{html.escape(row["model"])}'
                    f'</span><span class="usl-track"><span class="usl-fill" style="width:'
                    f'{rate:.1f}%"></span>{span}<span class="usl-even"></span></span>'
                    f'<span>{rate:.1f}%</span></div>')
    level = 100 * doc["interval"]["level"]
    return (f'<div class="usl-chart" role="img" aria-label="Overall win rate per model">'
            f'<p>Overall win rate against {html.escape(doc["baseline"])}, with its {level:.0f}% '
            f'interval (dashed: 50%); {trust(doc)}</p>'
            f'{"".join(bars)}</div>')


def write_csv(frame: pd.DataFrame, directory: Path, keep: int = MAX_CSV) -> Path:
    """leaderboard.csv in a directory named after the table's contents (one file per board); the
    `keep` most recently written are kept."""
    return write_kept(frame.to_csv(index=False, quoting=csv.QUOTE_MINIMAL), directory,
                      "leaderboard.csv", keep)


def link(criteria, contrast, topics, describe: str, k: int) -> str:
    """The query string that reproduces a board (lines joined by newlines)."""
    params = {"criteria": "\n".join(criteria)}
    if contrast:
        params["contrast"] = "\n".join(contrast)
    if describe:
        params.update(describe=describe, k=str(k))
    else:
        params["topics"] = "\n".join(topics)
    return "?" + urlencode(params, quote_via=quote)


def shared_k(text: str) -> int:
    """A link's k: a plain decimal number, else DEFAULT_K (isdigit() alone takes "²", and 5,000
    digits, both of which int() refuses)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else DEFAULT_K


# -- the page -------------------------------------------------------------------------------------

def build(service: Leaderboards, default: dict, queue_size: int = 64,
          file_age: int = HttpLimits.file_age) -> gr.Blocks:
    """The page. `default` is the default board (DEFAULT_CRITERIA over every topic).

    Its handlers return {component: value}: a component left out keeps what it shows."""
    topics = list(service.topic_counts)
    csv_dir = Path(tempfile.mkdtemp(prefix="crm-usl-"))
    atexit.register(shutil.rmtree, csv_dir, ignore_errors=True)

    with gr.Blocks(title=TITLE, analytics_enabled=False,
                   delete_cache=(file_age, file_age)) as page:
        gr.Markdown(f"# {TITLE}\nLLMs ranked by a Customizable Reward Model for *your* "
                    f"criteria: each model's answer to every benchmark query is judged against "
                    f"{text(service.selection.baseline)}'s.")
        with gr.Tabs() as tabs:
            with gr.Tab("Default leaderboard", id="default"):
                gr.Markdown(info(default))
                gr.Dataframe(table(default), interactive=False, elem_id="default-table")
                gr.HTML(chart(default))
            with gr.Tab("Customizable leaderboard", id="custom"):
                with gr.Row():
                    with gr.Column():
                        chosen = gr.CheckboxGroup(
                            [(f"{t} ({n})", t) for t, n in service.topic_counts.items()],
                            value=topics, label="Topics (examples)", elem_id="topics")
                        with gr.Row():
                            select_all = gr.Button("Select all", size="sm")
                            clear_all = gr.Button("Clear all", size="sm")
                        describe = gr.Textbox(
                            label="Or describe what you use an LLM for (ranks on the most "
                                  "similar queries instead of the ticked topics)",
                            lines=2, max_length=service.limits.chars, elem_id="describe")
                        k = gr.Slider(1, len(service.records), value=min(DEFAULT_K,
                                      len(service.records)), step=1,
                                      label="Most similar queries")
                    with gr.Column():
                        criteria = gr.Textbox(label="Preference criteria (one criterion per line)",
                                              lines=5, elem_id="criteria")
                        contrast = gr.Textbox(
                            label="Contrast criteria (optional): a second ranking side by side, "
                                  "with the Kendall tau between the two", lines=2,
                            elem_id="contrast")
                        button = gr.Button("Generate leaderboard", variant="primary",
                                           elem_id="generate")
                status = gr.Markdown(elem_id="status")
                board_info = gr.Markdown(elem_id="board-info")
                board = gr.Dataframe(interactive=False, elem_id="board")
                board_chart = gr.HTML()
                with gr.Row():
                    download = gr.DownloadButton("Download CSV", visible=False, size="sm",
                                                 elem_id="download")
                    share = gr.Markdown(elem_id="share")
                with gr.Group(visible=False) as versus_group:
                    versus_info = gr.Markdown()
                    with gr.Row():
                        left = gr.Dataframe(interactive=False, elem_id="contrast-left")
                        right = gr.Dataframe(interactive=False, elem_id="contrast-right")
                with gr.Accordion("Why does a model rank where it does? Its examples", open=False):
                    model = gr.Dropdown([], label="Model", elem_id="drill-model")
                    drill_status = gr.Markdown()
                    examples = gr.Dataframe(interactive=False, wrap=True, max_height=600,
                                            elem_id="drill")
                with gr.Accordion("Calibrate with your votes", open=False, elem_id="calibrate"):
                    gr.Markdown(CALIBRATE_HELP)
                    vote_status = gr.Markdown(elem_id="vote-status")
                    vote_pair = gr.Markdown(elem_id="vote-pair")
                    with gr.Row():
                        response_a = gr.Markdown(elem_id="response-a")
                        response_b = gr.Markdown(elem_id="response-b")
                    with gr.Row():
                        answers = {choice: gr.Button(label, elem_id=f"vote-{choice.lower()}")
                                   for choice, label in (("A", "A is better"), ("B", "B is better"),
                                                         ("tie", "Tie"), ("skip", "Skip"))}
                    with gr.Row():
                        votes_file = gr.DownloadButton("Download your votes (JSONL)",
                                                       visible=False, size="sm",
                                                       elem_id="votes-download")
                        votes_upload = gr.UploadButton("Upload votes", file_types=[".jsonl"],
                                                       size="sm", elem_id="votes-upload")
                state = gr.State()
                calibration = gr.State()
                # The votes per criteria set, in the browser: kept across boards, reloads and the
                # server forgetting an idle session. Gradio encrypts them with a secret the page
                # itself sends, which hides nothing from their owner: a fixed one keeps them
                # readable after a restart. Keyed by the benchmark: votes name its pairs.
                bench_id = service.fingerprints["bench"][:16]
                votes_store = gr.BrowserState({}, storage_key=f"crm-usl-votes-{bench_id}",
                                              secret=f"crm-usl-votes-{bench_id}")

        def generate(criteria_text, contrast_text, chosen_topics, describe_text, k_value,
                     store=None, progress=gr.Progress()) -> dict:
            """The customizable board; a BoardError leaves the board as it was, with the message."""
            def report(done, total):
                progress((done, total), desc="The CRM is judging the benchmark", unit="queries")

            try:
                criteria_set = service.criteria(criteria_text)
                contrast_set = service.criteria(contrast_text, "contrast criteria") if (
                    contrast_text or "").strip() else ()
                choice = service.choose(chosen_topics, describe_text, k_value)
                doc = service.board(criteria_set, choice, report)
                versus = (service.contrast(criteria_set, contrast_set, choice, report)
                          if contrast_set else None)
            except BoardError as exc:
                return {status: f"**Cannot rank:** {text(str(exc))}"}
            except Exception:
                log.exception("generate failed")
                return {status: "**Internal error:** the server logged it; please report it."}
            frame = table(doc)
            query = link(criteria_set, contrast_set, choice.topics, choice.describe, k_value)
            votes, answered = restored(store, criteria_set, lambda idx, name: (
                idx in service.records and name in service.models))
            queue = service.suggestions(criteria_set, choice, SUGGESTED)
            fresh = Calibration(tuple(x for x in queue if (x["idx"], x["model"]) not in votes),
                                votes, answered)
            shown = {status: "", board_info: info(doc), board: frame, board_chart: chart(doc),
                     download: gr.update(value=str(write_csv(frame, csv_dir)), visible=True),
                     share: f"[Link to this board]({query})", **contrast_view(versus),
                     model: gr.update(choices=list(service.models), value=None), examples: None,
                     state: (criteria_set, choice), calibration: fresh,
                     votes_file: gr.update(visible=False), **pair_view(fresh),
                     vote_status: "No votes yet: the board's intervals take the CRM for you."}
            if votes:  # this criteria set's votes, as they were: the board calibrated with them
                shown.update(recalibrate(fresh, (criteria_set, choice), store, kept=True))
            return shown

        def pair_view(current: Calibration) -> dict:
            if not current.queue:
                return {vote_pair: "No more suggested pairs for this board.", response_a: "",
                        response_b: ""}
            line = current.queue[0]
            shown_a, shown_b = sides(line)
            return {vote_pair: ("**Your criteria:** " + " · ".join(f"“{text(c)}”"
                                                                   for c in line["criteria"])
                                + f"\n\n**Query:** {verbatim(line['prompt'])}"),
                    response_a: f"**A**\n\n{verbatim(shown_a)}",
                    response_b: f"**B**\n\n{verbatim(shown_b)}"}

        def recalibrate(current: Calibration, board_state, store, kept: bool = False) -> dict:
            """The board again with PPI intervals and rank sets from the votes so far (`kept`:
            those the browser kept for these criteria, brought back with a new board)."""
            started = time.perf_counter()
            doc = service.calibrated(*board_state, current.votes)
            frame = table(doc)
            seconds = time.perf_counter() - started
            return {board_info: info(doc), board: frame, board_chart: chart(doc),
                    download: gr.update(value=str(write_csv(frame, csv_dir)), visible=True),
                    calibration: current, **pair_view(current),
                    votes_file: gr.update(value=str(write_votes(
                        current.votes, csv_dir, board_state[0], service.selection.fingerprint)),
                                          visible=True),
                    votes_store: stored(store, board_state[0], current),
                    vote_status: (f"{len(current.votes)} votes"
                                  + (" kept from before under these criteria" if kept else "")
                                  + f", {current.answered} pairs answered; {trust(doc)}. Board "
                                  f"recomputed in {seconds:.2f} s.")}

        def answer(choice: str) -> Callable:
            def handle(current: Calibration | None, board_state, store) -> dict:
                if current is None or board_state is None:
                    return {vote_status: "Generate a board first."}
                try:
                    return recalibrate(current.answer(choice), board_state, store)
                except BoardError as exc:
                    return {vote_status: f"**Cannot recompute:** {text(str(exc))}"}
            return handle

        def upload(path, current: Calibration | None, board_state, store) -> dict:
            if current is None or board_state is None:
                return {vote_status: "Generate a board first, then upload its votes."}
            try:
                return recalibrate(current.with_votes(service.read_votes(path, board_state[0])),
                                   board_state, store)
            except BoardError as exc:
                return {vote_status: f"**Cannot use the votes:** {text(str(exc))}"}

        def contrast_view(versus: dict | None) -> dict:
            if versus is None:
                return {versus_group: gr.update(visible=False), versus_info: "", left: None,
                        right: None}
            first, second = versus["boards"]
            sides = [pd.DataFrame([{"Rank": r["rank"], "Model": r["model"],
                                    "Overall (%)": _pct(r["overall"]["win_rate"])}
                                   for r in b["rows"]]) for b in (first, second)]
            return {versus_group: gr.update(visible=True),
                    versus_info: tau_sentence(versus["kendall_tau"]),
                    left: sides[0], right: sides[1]}

        def drill(model_name, board_state) -> dict:
            if not model_name or board_state is None:
                return {drill_status: ""}
            try:
                rows = service.examples(*board_state, model_name)
            except BoardError as exc:
                return {drill_status: f"**Cannot show examples:** {text(str(exc))}"}
            except Exception:
                log.exception("drill-down failed")
                return {drill_status: "**Internal error:** the server logged it; please report it."}
            return {examples: pd.DataFrame([{"Query": r["query"], "Response": r["response"],
                                             "Baseline": r["baseline"], "P(win)": r["p_win"],
                                             "P(tie)": r["p_tie"],
                                             "Verdict": r["result"], "Topic": r["topic"]}
                                            for r in rows]),
                    drill_status: ""}

        def from_url(store, request: gr.Request, progress=gr.Progress()) -> dict:
            """A shared link: fill the form from the query string and generate."""
            params = dict(request.query_params) if request else {}
            if not any(key in params for key in URL_KEYS):
                return gr.skip()  # every output as it is
            picked = [t for t in params.get("topics", "").split("\n") if t] or topics
            k_value = shared_k(params.get("k", ""))
            form = {criteria: params.get("criteria", ""), contrast: params.get("contrast", ""),
                    chosen: [t for t in picked if t in topics],
                    describe: params.get("describe", ""),
                    k: max(1, min(k_value, len(service.records))),
                    tabs: gr.update(selected="custom")}
            return {**form, **generate(form[criteria], form[contrast], picked, form[describe],
                                       k_value, store, progress)}

        boards = dict(concurrency_limit=None, concurrency_id="boards")
        calibration_outputs = [vote_status, vote_pair, response_a, response_b, votes_file,
                               calibration, votes_store]
        board_outputs = [status, board_info, board, board_chart, download, share, versus_group,
                         versus_info, left, right, model, examples, state, *calibration_outputs]
        recalibrated = [board_info, board, board_chart, download, *calibration_outputs]
        for choice, button_of in answers.items():
            button_of.click(answer(choice), [calibration, state, votes_store], recalibrated,
                            api_visibility="private", **boards)
        votes_upload.upload(upload, [votes_upload, calibration, state, votes_store], recalibrated,
                            api_visibility="private", **boards)
        select_all.click(lambda: topics, outputs=chosen, queue=False, api_visibility="private")
        clear_all.click(lambda: [], outputs=chosen, queue=False, api_visibility="private")
        button.click(generate, [criteria, contrast, chosen, describe, k, votes_store], board_outputs,
                     api_visibility="private", show_progress_on=[board], **boards)
        model.change(drill, [model, state], [examples, drill_status], api_visibility="private",
                     **boards)
        page.load(from_url, votes_store, [criteria, contrast, chosen, describe, k, tabs,
                                          *board_outputs],
                  api_visibility="private", **boards)
        gr.api(_rank_endpoint(service), api_name="rank", **boards)
    # api_open=False: Gradio's REST routes (/run/..., /api/...) would run a queued handler
    # directly, past the queue and its bound; the page calls them only for its unqueued buttons.
    page.queue(max_size=queue_size, default_concurrency_limit=None, api_open=False)
    _one_line_input_errors(page)
    return page


def _one_line_input_errors(page: gr.Blocks) -> None:
    """An API call with too few inputs, or an input its component cannot read (a number where a
    list of topics belongs, a value outside a dropdown's choices), gets a one-line message:
    Gradio's own checks raise errors that the caller sees as {"error": null} (show_error=False)
    and the log as a traceback."""
    check, preprocess = page.validate_inputs, page.preprocess_data

    def validate_inputs(block_fn, inputs) -> None:
        if len(inputs) < len(block_fn.inputs):
            raise gr.Error(f"{block_fn.name}: {len(inputs)} of its {len(block_fn.inputs)} inputs "
                           "given", print_exception=False)
        check(block_fn, inputs)

    async def preprocess_data(block_fn, inputs, state, explicit_call=False):
        try:
            return await preprocess(block_fn, inputs, state, explicit_call)
        except gr.Error as exc:  # Gradio's own ("not in the list of choices"): no traceback
            raise gr.Error(" ".join(str(exc.message).split())[:MAX_MESSAGE],
                           print_exception=False) from None
        except Exception as exc:
            raise gr.Error(f"{block_fn.name}: an input this page cannot read "
                           f"({type(exc).__name__})", print_exception=False) from None

    page.validate_inputs, page.preprocess_data = validate_inputs, preprocess_data


def _rank_endpoint(service: Leaderboards) -> Callable:
    def rank(criteria: str, topics: list[str]) -> dict:
        """The leaderboard as JSON. criteria: one criterion per line; topics: the topics to rank
        on, empty for all. Returns the rows of leaderboard.json with their 95% intervals."""
        if isinstance(topics, str):  # one topic, not a list of its letters
            topics = [topics]
        try:
            return service.board(service.criteria(criteria), service.choose(topics or None))
        except BoardError as exc:
            raise gr.Error(str(exc), print_exception=False) from None
        except Exception:
            log.exception("rank failed")
            raise gr.Error("Internal error: the server logged it.", print_exception=False) from None

    return rank


def default_board(service: Leaderboards, criteria=DEFAULT_CRITERIA) -> dict:
    return service.board(tuple(criteria), service.choose(None))


class GradioServer(uvicorn.Server):
    """uvicorn serving a mounted Gradio page. A page's streams (session heartbeats, queue
    events) run until the page says stop: at shutdown they are ended first, as Gradio's own
    close() does, so that the shutdown waits for no client.

    Gradio deletes the files it keeps once `file_age` seconds old (and at exit), but not the
    directory each lies in (one per file's content: a board's CSV, a votes file); its multipart
    parser leaves an empty temporary file per upload at the top of its folder, and each page
    makes an empty `vibe_edit_history` directory there (for editing a page's code, which this
    server does not run). Every `file_age` seconds the empty directories and temporary files
    unchanged that long are removed, and at exit the empty ones made there since the app was made
    (`started_at`; a second earlier, for the file system's clock), and `vibe_edit_history` if
    empty."""

    def __init__(self, config: uvicorn.Config, page: gr.Blocks, gradio_app, file_age: float,
                 started_at: float):
        super().__init__(config)
        self.page, self.gradio_app, self.file_age = page, gradio_app, file_age
        self.started_at = started_at  # before the app was made
        self.thread: threading.Thread | None = None  # launch(block=False)'s
        self.sweeper: asyncio.Task | None = None

    def stop(self, timeout: float = 30) -> None:
        """Shut a server launch(block=False) started down, and wait for it."""
        self.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.file_age)
            await asyncio.to_thread(remove_empty, Path(get_upload_folder()),
                                    until=time.time() - self.file_age)

    async def shutdown(self, sockets=None) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        self.page._queue.close()
        self.page.is_running = False
        self.gradio_app.stop_event.set()
        await super().shutdown(sockets)
        folder = Path(get_upload_folder())
        remove_empty(folder, since=self.started_at - 1)
        with contextlib.suppress(OSError):  # made with the page, before: removed when empty
            (folder / "vibe_edit_history").rmdir()


def remove_empty(folder: Path, since: float = 0.0, until: float = float("inf")) -> None:
    """The empty directories, and empty `tmp*` files, at the top of `folder` last changed
    between `since` and `until` (seconds since the epoch)."""
    for path in folder.iterdir():
        try:
            stat = path.stat()
            if not since <= stat.st_mtime <= until:
                continue
            if path.is_file() and path.name.startswith("tmp") and stat.st_size == 0:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        except OSError:  # filled, or removed, meanwhile
            pass


def launch(page: gr.Blocks, host: str, port: int, auth: tuple[str, str] | None = None,
           limits: HttpLimits = HttpLimits(), block: bool = True):
    """Serve until stopped (Ctrl-C or SIGTERM closes the server); `block=False` serves on a
    thread and returns the uvicorn server (its stop() stops it)."""
    started_at = time.time()
    app = gr.mount_gradio_app(
        FastAPI(), page, "/", server_name=host, server_port=port, auth=auth, show_error=False,
        footer_links=["api"], run_history=False, enable_monitoring=False, ssr_mode=False,
        mcp_server=False, theme=THEME, css=CSS, max_file_size=limits.max_upload)
    gradio_app = next(route.app for route in app.routes if hasattr(route.app, "stop_event"))
    sessions = Sessions(page, limits.sessions_per_address, limits.sessions, limits.session_age)
    guarded = ServingGuard(BodyLimit(SessionGuard(app, sessions), limits.max_body,
                                     limits.read_timeout),
                           limits.streams_per_address, limits.streams, limits.stream_lifetime,
                           limits.results_per_address, limits.results, limits.result_age,
                           sessions=sessions, upload_bytes=limits.max_upload,
                           uploads=limits.uploads, uploads_per_address=limits.uploads_per_address,
                           read_timeout=limits.read_timeout)
    server = GradioServer(server_config(
        guarded, read_timeout=limits.read_timeout, keep_alive=limits.keep_alive,
        connections=limits.connections, per_address=limits.per_address,
        write_timeout=limits.write_timeout, forwarded_allow_ips=limits.forwarded_allow_ips,
        host=host, port=port, log_level="warning",
        timeout_graceful_shutdown=5), page, gradio_app, limits.file_age, started_at)
    if block:
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
            pass
        return server
    server.thread = threading.Thread(target=server.run, daemon=True, name="crm-usl-server")
    server.thread.start()
    while not server.started and server.thread.is_alive():
        server.thread.join(0.01)
    return server
