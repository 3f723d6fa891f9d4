"""crm-leaderboard: rank the models of a benchmark for one user's criteria.

    crm-leaderboard checkpoint=DIR bench=FILE baseline=NAME 'criteria=["line 1","line 2"]'
                    [topics=[...]] ['contrast=[...]'] [default=true] [votes=FILE]

Writes leaderboard.json, leaderboard.md, leaderboard.png and judgments.jsonl (the CRM's verdict
and probabilities per judged pair) into outputs/leaderboard/<name>.
`default=true` ranks under `default_criteria` (the crowd's average preference) instead of
`criteria`; with `contrast` it is compared with another criteria set (Kendall tau). `checkpoint`
is an export dir or a crm-train checkpoint (the former `model=DIR` still works, with a deprecation
message). `votes=FILE` (the user's own verdicts on a few pairs, crm.evaluation.user_votes) makes the
criteria board's intervals prediction-powered (interval.method=auto|bootstrap|ppi);
`suggest_votes.pairs=N` writes suggested_votes.jsonl, the next N pairs to vote on
(crm.evaluation.suggest): a line of it with "verdict" added is a vote.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.errors import one_line_config_errors
from crm.cli.record import save_run_record
from crm.cli.schema import PathsConfig, register_schema, settings
from crm.cli.scorer import ScorerSettings, checkpoint_argument, close_scorer, load_scorer
from crm.core.errors import ConfigError
from crm.core.files import refuse_replacing, write_json, write_jsonl
from crm.core.records import RecordError
from crm.evaluation.leaderboard import (Bootstrap, interval_method, leaderboard, outcome,
                                        select)
from crm.evaluation.suggest import STRATEGIES, suggest_pairs, suggestion_lines
from crm.evaluation.user_votes import read_votes
from crm.evaluation.render import markdown, plot

log = logging.getLogger("crm.evaluation.leaderboard")


@dataclass
class Labels:
    criteria: str = MISSING
    contrast: str = MISSING


@dataclass
class SuggestVotes:
    pairs: int = MISSING
    strategy: str = MISSING


@dataclass
class LeaderboardConfig(ScorerSettings):
    """configs/leaderboard.yaml's keys and their types."""

    paths: PathsConfig = MISSING
    name: str = MISSING
    bench: str = MISSING
    baseline: str = MISSING
    criteria: Any = MISSING  # a list of lines, or one string (one criterion): `_lines`
    topics: Any = MISSING  # null, a list, or one string
    models: Any = MISSING  # null, a list, or one string
    contrast: Any = MISSING  # null, a list of lines, or one string
    default: bool = MISSING
    default_criteria: list[str] = MISSING
    labels: Labels = MISSING
    both_orders: Any = MISSING  # true, false or auto (from the slot-bias measurement)
    slot_sample: int = MISSING
    interval: Bootstrap = field(default_factory=Bootstrap)
    votes: Any = MISSING  # null, or the user's votes file
    suggest_votes: SuggestVotes = MISSING
    strict: bool = MISSING


register_schema("leaderboard", LeaderboardConfig)


def _lines(value) -> list[str]:
    """A criteria list from the config; one string is one criterion."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def criteria_sets(cfg: LeaderboardConfig) -> tuple[list[str], list[str], tuple[str, str]]:
    """(criteria, contrast, labels) as the config asks."""
    criteria, contrast = _lines(cfg.criteria), _lines(cfg.contrast)
    if cfg.default:
        if criteria:
            raise ConfigError("default=true ranks under default_criteria: give criteria=[...] or "
                             "default=true, not both (contrast=[...] compares with another set)")
        criteria = _lines(cfg.default_criteria)
    if not criteria:
        raise ConfigError("no criteria: criteria=[\"...\",...] (one line each), or default=true")
    for key, lines in (("criteria", criteria), ("contrast", contrast)):
        blank = [i for i, line in enumerate(lines, start=1) if not line.strip()]
        if blank:  # the CRM would read an empty criterion, and the board be titled with it
            raise ConfigError(f"{key}: criterion {blank[0]} of {len(lines)} is blank: write each "
                              f"criterion as words, {key}=[\"I prefer short answers.\"]")
    labels = (cfg.labels.criteria if not cfg.default else "default", cfg.labels.contrast)
    return criteria, contrast, labels


def user_votes(cfg: LeaderboardConfig, selection, criteria: list[str]):
    """The votes file checked line by line against the selection and the board's criteria,
    before any model loads."""
    if cfg.votes is not None and not Path(str(cfg.votes)).is_file():
        raise ConfigError(f"votes={cfg.votes}: no such file")
    try:
        votes = None if cfg.votes is None else read_votes(str(cfg.votes), selection, criteria)
        interval_method(cfg.interval, votes)
    except (RecordError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if votes is not None and (votes.outside_topics or votes.on_rejected_lines):
        log.warning("votes: %s", votes.counts)
    return votes


def run(composed: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg = settings(composed)
    criteria, contrast, labels = criteria_sets(cfg)
    topics = None if cfg.topics is None else _lines(cfg.topics)
    models = None if cfg.models is None else _lines(cfg.models)
    if not Path(cfg.bench).is_file():
        raise ConfigError(f"bench={cfg.bench}: no such file")
    try:  # a baseline, model or topic the benchmark lacks: the user's to fix, named in one line
        selection = select(cfg.bench, cfg.baseline, topics=topics, models=models)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if selection.rejects:
        for r in selection.rejects[:10]:
            log.warning("rejected %s:%s: %s: %s", r["file"], r["line"], r["field"], r["reason"])
        if cfg.strict:
            raise ValueError(f"{cfg.bench}: {len(selection.rejects)} benchmark lines rejected "
                             f"(strict=true); first: {selection.rejects[0]}")
    votes = user_votes(cfg, selection, criteria)
    if cfg.both_orders not in (True, False, "auto"):
        raise ConfigError(f"both_orders={cfg.both_orders}: true, false or auto")
    if cfg.slot_sample < 0 or (cfg.both_orders == "auto" and not cfg.slot_sample):
        raise ConfigError(f"slot_sample={cfg.slot_sample}: pairs judged in both orders to measure "
                          "slot bias (>= 0; both_orders=auto needs at least 1)")
    if cfg.suggest_votes.pairs < 0:
        raise ConfigError(f"suggest_votes.pairs={cfg.suggest_votes.pairs}: a number of pairs, 0 "
                          "for none")
    if cfg.suggest_votes.strategy not in STRATEGIES:
        raise ConfigError(f"suggest_votes.strategy={cfg.suggest_votes.strategy}: one of "
                          f"{', '.join(STRATEGIES)}")
    if cfg.suggest_votes.strategy == "active" and votes is not None:
        raise ConfigError("suggest_votes.strategy=active draws the whole batch at once: with "
                          "votes= given, continue with suggest_votes.strategy=uniform")
    # A name holds one board: another checkpoint's, benchmark's or criteria's is refused, so that
    # its files (suggested_votes.jsonl among them) never sit beside this one's.
    refuse_replacing(run_dir / "leaderboard.json",
                     board_inputs(str(cfg.checkpoint), cfg.bench, selection, criteria, contrast),
                     earlier_board, f"give this board its own name= (name={cfg.name} is taken)")
    save_run_record(composed)
    scorer = load_scorer(cfg, run_dir)
    judgments: list[dict] = []
    try:
        result = leaderboard(scorer, selection, criteria, contrast or None,
                             both_orders=cfg.both_orders, labels=labels,
                             interval=cfg.interval, votes=votes, slot_sample=cfg.slot_sample,
                             judgments=judgments)
    finally:
        close_scorer(scorer)
    result.update(model=str(cfg.checkpoint), kind=scorer.kind,
                  sequences={k: int(v) for k, v in sorted(scorer.counts.items())},
                  wall_seconds=round(time.time() - started, 1))
    if result["sequences"].get("shortened"):
        log.warning("%d prompts had responses shortened to fit the CRM's %d tokens (judged on "
                    "their start and end: leaderboard.json's sequences.shortened)",
                    result["sequences"]["shortened"], scorer.encoder.max_tokens)
    write_judgments(run_dir / "judgments.jsonl", judgments, cfg.name)
    if cfg.suggest_votes.pairs:
        judged = [outcome(j) for j in judgments if j["board"] == labels[0]]
        pairs = suggest_pairs(judged, selection.models, cfg.suggest_votes.pairs,
                              cfg.interval.seed, set(votes.used) if votes else set(),
                              cfg.suggest_votes.strategy, cfg.interval.tie_value)
        path = run_dir / "suggested_votes.jsonl"
        path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n"
                                for line in suggestion_lines(selection, pairs, criteria)),
                        encoding="utf-8")
        result["suggested_votes"] = {"file": str(path), "pairs": len(pairs),
                                     "strategy": cfg.suggest_votes.strategy}
    write_json(run_dir / "leaderboard.json", result)
    (run_dir / "leaderboard.md").write_text(markdown(result), encoding="utf-8")
    plot(result, run_dir / "leaderboard.png")
    return result


def write_judgments(path: Path, lines: list[dict], name: str) -> None:
    """The first output written: one that cannot be written leaves every earlier one as it was."""
    try:
        write_jsonl(path, lines)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be written ({exc.strerror or exc}); no output was "
                          "replaced: move what is there or free disk space, or give this board "
                          f"its own name= (name={name})") from None


def board_inputs(checkpoint: str, bench: str, selection, criteria: list[str],
                 contrast: list[str]) -> dict:
    """What makes a board this board: leaderboard.json's record of them (`earlier_board`)."""
    return {"checkpoint": checkpoint, "bench": bench, "baseline": selection.baseline,
            "topics": list(selection.topics), "models": list(selection.models),
            "criteria": list(criteria), "contrast": list(contrast) or None}


def earlier_board(doc: dict) -> dict:
    boards = doc.get("boards") or [{}]
    return {"checkpoint": doc.get("model"), "bench": doc.get("bench"),
            "baseline": doc.get("baseline"), "topics": doc.get("topics"),
            "models": doc.get("models"), "criteria": boards[0].get("criteria"),
            "contrast": boards[1].get("criteria") if len(boards) > 1 else None}


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="leaderboard")
@one_line_config_errors
def _main(cfg: DictConfig) -> None:
    result = run(cfg)
    print(markdown(result))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    print(f"leaderboard: {run_dir / 'leaderboard.md'} (.json, .png)")


def main() -> None:
    sys.argv = checkpoint_argument(sys.argv)
    _main()


if __name__ == "__main__":
    sys.exit(main())
