"""A user's votes (crm.evaluation.votes) and the board they make (PPI intervals, rank sets,
suggested pairs): every bad line refused with FILE:LINE and the field, the counts, the forwards."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_leaderboard import StubScorer, bench_line, write_bench

from crm.core.records import RecordError
from crm.evaluation.leaderboard import PPI_ASSUMES, leaderboard, select
from crm.evaluation.render import markdown, plot
from crm.evaluation.votes import Votes, read_votes


def bench(tmp_path: Path, queries: int = 30) -> Path:
    """`queries` lines over topics t1, t2, t3 (t3 left out by the tests' selection), three models
    whose responses say how the stub CRM judges them: m1 mostly wins, m2 half, m3 mostly loses."""
    lines = [bench_line(f"q{i}", ("t1", "t2", "t3")[i % 3],
                        {"base": "b", "m1": ("win", "win", "lose")[i % 3] if i % 5 else "tie",
                         "m2": ("win", "lose")[i % 2], "m3": "lose" if i % 4 else "win"})
             for i in range(queries)]
    lines.append(bench_line("q-no-m3", "t1", {"base": "b", "m1": "win", "m2": "win"}))
    return write_bench(tmp_path / "bench.jsonl", lines)


def write_votes(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def vote(idx, model="m1", verdict="win") -> dict:
    return {"idx": idx, "model": model, "verdict": verdict}


@pytest.mark.parametrize("line, field, reason", [
    ('{"idx": "q0", "model": "m1", ', "", "bad JSON"),
    ('["q0", "m1", "win"]', "", "a vote is a JSON object"),
    ({"idx": "q0", "model": "m1"}, "verdict", "missing field"),
    ({"idx": True, "model": "m1", "verdict": "win"}, "idx", "must be a string or an integer, not bool"),
    ({"idx": "q0", "model": None, "verdict": "win"}, "model", "must be a string, not null"),
    ({**vote("q0"), "note": "x"}, "note", "unknown field"),
    (vote("q0", verdict="better"), "verdict", "'better' is not one of win, tie, loss"),
    (vote("q999"), "idx", "'q999' is no query of the benchmark"),
    (vote("q0", model="base"), "model", "'base' is not a ranked model (ranked: m1, m2, m3)"),
    (vote("q1"), "idx", "a second vote on ('q1', 'm1'): the first is line 1"),
])
def test_every_bad_line_names_file_line_and_field(tmp_path, line, field, reason):
    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])
    path = write_votes(tmp_path / "votes.jsonl", [vote("q1"), line, vote("q4")])
    with pytest.raises(RecordError) as error:
        read_votes(path, selection)
    assert (error.value.path, error.value.line, error.value.field) == (str(path), 2, field)
    assert str(error.value).startswith(f"{path}:2: {field + ': ' if field else ''}")
    assert reason in str(error.value) and "\n" not in str(error.value)


def test_votes_outside_the_topics_or_on_rejected_lines_are_counted_not_used(tmp_path):
    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])
    path = write_votes(tmp_path / "votes.jsonl", [
        vote("q0"), vote("q0", "m2", "tie"), "", vote("q2", "m3", "loss"),  # q2: topic t3
        vote("q-no-m3", "m1")])  # a line rejected for every model (no m3)
    votes = read_votes(path, selection)
    assert votes.used == {("q0", "m1"): "win", ("q0", "m2"): "tie"}
    assert votes.counts == {"file": str(path), "read": 4, "used": 2, "outside_topics": 1,
                            "on_rejected_lines": 1}


def test_a_bad_votes_file_stops_the_command_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from crm.cli.leaderboard import main

    path = write_votes(tmp_path / "votes.jsonl", [vote("q1"), vote("q1", verdict="meh")])
    # checkpoint= is no model at all: reaching the loader would fail differently
    monkeypatch.setattr("sys.argv", ["crm-leaderboard", f"checkpoint={tmp_path}/none",
                                     f"bench={bench(tmp_path)}", "baseline=base", "criteria=[x]",
                                     f"votes={path}", f"hydra.run.dir={tmp_path}/run"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert f"{path}:2: verdict: 'meh' is not one of win, tie, loss" in err[0]


def test_a_board_with_votes_has_ppi_intervals_rank_sets_and_costs_no_forward_more(tmp_path):
    selection = select(bench(tmp_path, queries=45), "base", topics=["t1", "t2"])
    # the user agrees with the stub CRM except that m3's "lose" answers are wins on t1
    used = {}
    for record in selection.records[:12]:
        for model in selection.models:
            said = record.responses[model][-1].content
            user = "win" if said == "win" or (model == "m3" and record.topic == "t1") else "loss"
            used[record.idx, model] = user
    votes = Votes("votes.jsonl", used)
    plain, voted = StubScorer(), StubScorer()
    without = leaderboard(plain, selection, ["be brief"], contrast=["be long"])
    result = leaderboard(voted, selection, ["be brief"], contrast=["be long"], votes=votes)
    assert len(voted.examples) == len(plain.examples) == 2 * 30 * 3  # the votes cost no forward
    board, contrast = result["boards"]
    assert result["interval"]["method"] == board["interval_method"] == "ppi"
    assert board["assumes"] == PPI_ASSUMES and contrast["interval_method"] == "bootstrap"
    assert result["votes"]["used"] == 36
    rows = {r["model"]: r for r in board["rows"]}
    before = {r["model"]: r for r in without["boards"][0]["rows"]}
    for model, row in rows.items():
        o = row["overall"]
        assert o["votes"] == 12 and o["crm_win_rate"] == before[model]["overall"]["win_rate"]
        assert 0 <= o["ci_low"] <= o["win_rate"] <= o["ci_high"] <= 1
        best, worst = row["rank_set"]
        assert best <= row["rank"] <= worst
    # the correction moves m3 up: the user counts its t1 answers as wins, the CRM does not
    assert rows["m3"]["overall"]["win_rate"] > rows["m3"]["overall"]["crm_win_rate"]
    # topic cells: 12 queries' votes spread over 6 cells, pooled: each cell has its own count
    assert sum(c["votes"] for r in board["rows"] for c in r["topics"].values()) == 36
    text = markdown(result)
    assert "| Rank | Rank (UB) | Rank set | Model | Overall | 95% CI | Votes |" in text
    assert "prediction-powered" in text and "Votes: 36 used of 36 read" in text
    assert plot(result, tmp_path / "board.png").stat().st_size > 10_000
    # fewer votes than PPI needs: the CRM's win rate, no interval, and the reason
    few = Votes("votes.jsonl", dict(list(used.items())[:9]))
    thin = leaderboard(StubScorer(), selection, ["be brief"], votes=few)["boards"][0]["rows"]
    assert all(r["overall"]["ci_low"] is None for r in thin)
    assert "9 votes where PPI needs 20" in thin[0]["overall"]["interval_note"]
    assert [r["rank_set"] for r in thin] == [[1, 3]] * 3


def test_suggested_pairs_are_seeded_spread_and_skip_what_was_voted(tmp_path):
    from collections import Counter

    from crm.evaluation.suggest import suggest_pairs

    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])
    pairs = suggest_pairs(selection, 14, seed=3)
    assert pairs == suggest_pairs(selection, 14, seed=3) != suggest_pairs(selection, 14, seed=4)
    assert len(set(pairs)) == 14
    assert sorted(Counter(m for _, m in pairs).values()) == [4, 5, 5]  # m1, m2 one more than m3
    topics = {r.idx: r.topic for r in selection.records}
    for model in selection.models:  # each model's pairs alternate over the two topics
        mine = Counter(topics[i] for i, m in pairs if m == model)
        assert abs(mine["t1"] - mine["t2"]) <= 1
    again = suggest_pairs(selection, 100, seed=3, exclude=set(pairs))
    assert not set(again) & set(pairs)
    assert len(again) == 20 * 3 - 14  # all the rest: 20 queries in t1 and t2 x 3 models


def test_a_crm_that_reads_the_slot_is_caught_and_averaged_out(tmp_path):
    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])  # 20 queries x 3 models

    class SlotB(StubScorer):
        """Prefers slot B whatever it holds."""

        def pair_probabilities(self, examples, unfit="raise", both_orders=False):
            self.examples += examples * (2 if both_orders else 1)
            # both orders averaged, as CRMScorer does: (0.2, 0.8) and its unswapped mirror
            return torch.tensor([[0.5, 0.5, 0.0] if both_orders else [0.2, 0.8, 0.0]]
                                * len(examples))

    class Fair(StubScorer):
        """Prefers the response that says "win" (or does not say "lose"), in either slot."""

        def pair_probabilities(self, examples, unfit="raise", both_orders=False):
            self.examples += examples
            strength = {"win": 2, "lose": 0}
            rows = []
            for e in examples:
                a, b = (strength.get(c[-1].content, 1) for c in (e.conv_a, e.conv_b))
                rows.append([0.8, 0.2, 0.0] if a > b else [0.2, 0.8, 0.0] if b > a else
                            [0.5, 0.5, 0.0])
            return torch.tensor(rows)

    slot_b = SlotB()
    biased = leaderboard(slot_b, selection, ["x"], both_orders="auto", slot_sample=16)
    board = biased["boards"][0]
    assert board["slot_bias"] == {"pairs": 16, "follow_slot": 16, "rate": 1.0, "slot": "B",
                                  "threshold": 0.2, "biased": True}
    assert board["both_orders"] is True and len(slot_b.examples) == 2 * 16 + 2 * 60
    assert all(r["overall"]["win_rate"] == 0.0 for r in board["rows"])  # averaged: all even
    assert "Slot bias: 16 of 16 sampled pairs" in markdown(biased)
    fair = Fair()
    result = leaderboard(fair, selection, ["x"], both_orders="auto", slot_sample=16)
    board = result["boards"][0]
    assert board["slot_bias"]["follow_slot"] == 0 and not board["slot_bias"]["biased"]
    assert board["both_orders"] is False and len(fair.examples) == 2 * 16 + 60
    assert "Slot bias" not in markdown(result)
