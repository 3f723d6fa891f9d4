"""A user's votes (crm.evaluation.user_votes) and the board they make (PPI intervals, rank sets,
suggested pairs): every bad line refused with FILE:LINE and the field, the counts, the forwards."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_leaderboard import StubScorer, bench_line, write_bench

from crm.core.records import RecordError
from crm.evaluation.leaderboard import PPI_ASSUMES, Outcome, leaderboard, select
from crm.evaluation.render import markdown, plot
from crm.evaluation.user_votes import Votes, read_votes


def bench(tmp_path: Path, queries: int = 30) -> Path:
    """`queries` lines over topics t1, t2, t3 (t3 left out by the tests' selection), three models
    whose responses say how the stub CRM judges them: m1 mostly wins, m2 half, m3 mostly loses."""
    lines = [bench_line(f"q{i}", ("t1", "t2", "t3")[i % 3],
                        {"base": "b", "m1": ("win", "win", "lose")[i % 3] if i % 5 else "tie",
                         "m2": ("win", "lose")[i % 2], "m3": "lose" if i % 4 else "win"})
             for i in range(queries)]
    lines.append(bench_line("q-no-m3", "t1", {"base": "b", "m1": "win", "m2": "win"}))
    return write_bench(tmp_path / "bench.jsonl", lines)


CRITERIA = ["be brief"]


def write_votes(path: Path, lines: list, selection) -> Path:
    """Lines as given; a vote without a bench is given on `selection`'s."""
    lines = [x if isinstance(x, str) or "bench" in x else {**x, "bench": selection.fingerprint}
             for x in lines]
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def vote(idx, model="m1", verdict="win", criteria=CRITERIA) -> dict:
    return {"idx": idx, "model": model, "verdict": verdict, "criteria": criteria}


@pytest.mark.parametrize("line, field, reason", [
    ('{"idx": "q0", "model": "m1", ', "", "bad JSON"),
    ('["q0", "m1", "win"]', "", "a vote is a JSON object"),
    ({"idx": "q0", "model": "m1", "criteria": CRITERIA}, "verdict", "missing field"),
    ({"idx": "q0", "model": "m1", "verdict": "win", "bench": "x"}, "criteria",
     "missing field (the board's suggested_votes.jsonl lines carry it"),
    ({**vote("q0"), "bench": "sha256:0123456789abcdef"}, "bench",
     "these votes were given on the benchmark 'sha256:0123456789abcdef'; this board's "),
    (vote("q0", criteria=["be long"]), "criteria", "this vote was given under the criteria "
     "['be long']; this board's are ['be brief']"),
    ({**vote("q0"), "p": 0.5}, "p", "p on some lines and not others"),
    ({**vote("q0"), "criteria": "be brief"}, "criteria", "must be the board's criteria"),
    ({**vote("q0"), "idx": True}, "idx", "must be a string or an integer, not bool"),
    ({**vote("q0"), "model": None}, "model", "must be a string, not null"),
    ({**vote("q0"), "note": "x"}, "note", "unknown field"),
    ({**vote("q0"), "prompt": "p", "topic": "t1", "baseline": "b", "response": "r"}, "idx",
     "a second vote on ('q0', 'm1'): the first is line 2"),  # a suggested line's fields are kept
    (vote("q0", verdict="better"), "verdict", "'better' is not one of win, tie, loss"),
    (vote("q999"), "idx", "'q999' is no query of the benchmark"),
    (vote("q0", model="base"), "model", "'base' is not a ranked model (ranked: m1, m2, m3)"),
    (vote("q1"), "idx", "a second vote on ('q1', 'm1'): the first is line 1"),
])
def test_every_bad_line_names_file_line_and_field(tmp_path, line, field, reason):
    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])
    path = write_votes(tmp_path / "votes.jsonl", [vote("q1"), line, vote("q4")], selection)
    if field == "idx" and "first is line 2" in reason:  # the kept fields pass: its twin fails
        path = write_votes(path, [vote("q1"), line, vote("q0")], selection)
        with pytest.raises(RecordError) as error:
            read_votes(path, selection, CRITERIA)
        assert (error.value.line, error.value.field) == (3, "idx") and reason in str(error.value)
        return
    with pytest.raises(RecordError) as error:
        read_votes(path, selection, CRITERIA)
    assert (error.value.path, error.value.line, error.value.field) == (str(path), 2, field)
    assert str(error.value).startswith(f"{path}:2: {field + ': ' if field else ''}")
    assert reason in str(error.value) and "\n" not in str(error.value)


def test_votes_outside_the_topics_or_on_rejected_lines_are_counted_not_used(tmp_path):
    selection = select(bench(tmp_path), "base", topics=["t1", "t2"])
    path = write_votes(tmp_path / "votes.jsonl", [
        vote("q0"), vote("q0", "m2", "tie"), "", vote("q2", "m3", "loss"),  # q2: topic t3
        vote("q-no-m3", "m1")], selection)  # a line rejected for every model (no m3)
    votes = read_votes(path, selection, CRITERIA)
    assert votes.used == {("q0", "m1"): "win", ("q0", "m2"): "tie"}
    assert votes.counts == {"file": str(path), "read": 4, "used": 2, "outside_topics": 1,
                            "on_rejected_lines": 1}


def test_a_bad_votes_file_stops_the_command_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from crm.cli.leaderboard import main

    path = write_votes(tmp_path / "votes.jsonl", [vote("q1"), vote("q1", verdict="meh")],
                       select(bench(tmp_path), "base"))
    # checkpoint= is no model at all: reaching the loader would fail differently
    monkeypatch.setattr("sys.argv", ["crm-leaderboard", f"checkpoint={tmp_path}/none",
                                     f"bench={bench(tmp_path)}", "baseline=base",
                                     'criteria=["be brief"]', f"votes={path}",
                                     f"hydra.run.dir={tmp_path}/run"])
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
    # the cells add up: each model's topic cells, weighted by their pairs, average to its Overall
    for row in board["rows"]:
        cells = row["topics"].values()
        mean = sum(c["n"] * c["win_rate"] for c in cells) / sum(c["n"] for c in cells)
        assert mean == pytest.approx(row["overall"]["win_rate"], abs=1e-3)
    # fewer votes than PPI needs: the bootstrap's intervals stay, and say why
    few = Votes("votes.jsonl", dict(list(used.items())[:9]))
    thin = leaderboard(StubScorer(), selection, ["be brief"], votes=few)
    assert thin["boards"][0]["interval_method"] == "bootstrap"
    rows = thin["boards"][0]["rows"]
    assert all(r["overall"]["ci_low"] is not None for r in rows)
    assert rows[0]["overall"]["interval_note"] == (
        "bootstrap interval (the CRM taken as the user) until PPI has 20 votes: 9 so far")
    assert sum(r["overall"]["votes"] for r in rows) == 9
    assert "until PPI has 20 votes: 9 so far" in markdown(thin)


def judged_pairs(queries: dict[str, int], models=("m1", "m2"), sure: float = 0.5) -> list:
    """Outcomes of a board as the CRM judged it: `queries[topic]` queries per topic, every model;
    the CRM unsure (P(win) 0.5) on every fifth query, `sure` on the rest."""
    out, i = [], 0
    for topic, count in queries.items():
        for _ in range(count):
            for model in models:
                p = 0.5 if i % 5 == 0 else sure
                out.append(Outcome(model, topic, "win" if p > 0.5 else "loss", p, f"q{i}"))
            i += 1
    return out


def test_suggested_pairs_are_a_uniform_sample_of_each_models_scored_pairs():
    """An even share per model, going round the models, seeded; within a model uniform over its
    scored pairs whatever their topic: with topics of 40 and 5 queries, the small one gets its
    5/45 of the votes (spreading the votes over topics gave it half of them), and a pair the
    CRM could not score (absent from the outcomes) is never proposed."""
    from collections import Counter

    from crm.evaluation.suggest import suggest_pairs

    judged = judged_pairs({"big": 40, "small": 5})
    judged = [o for o in judged if (o.idx, o.model) != ("q3", "m1")]  # unscorable
    pairs = suggest_pairs(judged, ("m1", "m2"), 7, seed=3)
    assert pairs == suggest_pairs(judged, ("m1", "m2"), 7, seed=3)
    assert pairs != suggest_pairs(judged, ("m1", "m2"), 7, seed=4)
    assert [s.model for s in pairs] == ["m1", "m2"] * 3 + ["m1"] and len(set(pairs)) == 7
    assert all(s.p is None for s in pairs)
    small = {o.idx for o in judged if o.topic == "small"}
    drawn = Counter()
    for seed in range(400):
        drawn.update((s.idx, s.model) for s in suggest_pairs(judged, ("m1", "m2"), 6, seed))
    assert ("q3", "m1") not in drawn
    share = sum(n for (idx, _), n in drawn.items() if idx in small) / sum(drawn.values())
    assert share == pytest.approx(5 / 45, abs=0.03)
    again = suggest_pairs(judged, ("m1", "m2"), 200, seed=3, exclude={(s.idx, s.model)
                                                                       for s in pairs})
    assert not {(s.idx, s.model) for s in again} & {(s.idx, s.model) for s in pairs}
    assert len(again) == len(judged) - 7


def test_active_pairs_are_drawn_with_the_probabilities_they_carry():
    """strategy=active: more of the pairs the CRM is unsure of, each line's p its inclusion
    probability (they sum to the model's share), and over many draws each pair is drawn p of
    the time; the whole batch at once."""
    from collections import Counter

    from crm.evaluation.suggest import inclusion_probabilities, suggest_pairs

    judged = judged_pairs({"t": 30}, sure=0.97)
    pi = inclusion_probabilities([o for o in judged if o.model == "m1"], 4)
    assert sum(pi) == pytest.approx(4) and max(pi) > 2 * min(pi)  # the unsure: p 0.5
    pairs = suggest_pairs(judged, ("m1", "m2"), 8, seed=1, strategy="active")
    assert Counter(s.model for s in pairs) == {"m1": 4, "m2": 4}
    expected = dict(zip([o.idx for o in judged if o.model == "m1"], pi))
    assert all(s.p == pytest.approx(expected[s.idx]) for s in pairs)
    drawn = Counter()
    for seed in range(2000):
        drawn.update(s.idx for s in suggest_pairs(judged, ("m1", "m2"), 8, seed, strategy="active")
                     if s.model == "m1")
    assert max(abs(drawn[idx] / 2000 - p) for idx, p in expected.items()) < 0.04
    with pytest.raises(ValueError, match="whole batch at once"):
        suggest_pairs(judged, ("m1", "m2"), 8, exclude={("q0", "m1")}, strategy="active")


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
