"""CRMReward: a CRM and one user's criteria as the reward of reinforcement learning.

TRL's GRPOTrainer and RLOOTrainer (1.16, trl/trainer/grpo_trainer.py `_calculate_rewards`) call a
reward function as `f(prompts=..., completions=..., completion_ids=..., **columns)`: every dataset
column but `prompt` arrives as a list with one value per completion, so a `criteria` column carries
each row's criteria to the reward. A prompt is text or a list of chat messages (then a completion is
a list holding one assistant message); a None reward is NaN to TRL (that row gets no advantage).

Three strategies (docs/RL.md says when to use which):

- `pointwise` (a pointwise CRM): r(criteria, query, completion), unbounded.
- `reference`: against the row's reference answer (column `reference`). A pairwise CRM gives the
  probability that the completion beats it, both orders averaged; a pointwise CRM
  sigmoid((r - r_ref) / tau), the reference's reward computed once and cached.
- `round_robin`: the mean win probability against the other completions of the same group. A
  group is the completions of one (criteria, prompt), found by value, never by position: TRL may
  split a group across processes (they are gathered when torch.distributed runs) and a batch may
  hold a prompt twice. A pairwise CRM judges each ordered pair of distinct completions once
  (G(G-1) forwards for G distinct completions; identical completions tie at 0.5 with no forward);
  a pointwise CRM scores each distinct completion once and compares with sigmoid((r_i - r_j)/tau).

A pairwise CRM's win probability for one order is P(A) + P(tie)/2; both orders averaged,
P(a beats b) + P(b beats a) = 1 exactly. `log_odds=True` returns the log-odds of the same
probabilities instead (unbounded: the guard docs/RL.md measures).

Verdicts are cached (an LRU of hashed keys, `cache_size` entries): a completion seen again under
the same criteria and prompt costs no forward. So are the (criteria, query) pairs already found to
fit the CRM's length (another LRU of hashed keys, `cache_size` entries): no cache holds raw text,
and none grows past its size however many distinct requests arrive. `counts` totals completions,
forwards (sequences the CRM ran) and cache hits over the reward's life.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from crm.core.errors import excerpt
from crm.core.examples import PairExample
from crm.core.lru import LRU
from crm.core.records import Conversation, Message
from crm.inference.scorer import CRMScorer
from crm.inference.config import STRATEGIES

FIT_CHUNK = 256  # prompts tokenized per call by the length check
LOGIT_EPS = 1e-6  # log_odds of a pairwise probability clamps it into [eps, 1 - eps]


class CRMRewardError(ValueError):
    """Input the reward cannot score: one line naming the row, column or file at fault."""


class Row(NamedTuple):
    """One completion as the CRM reads it: criteria, query, the conversation after the query."""

    criteria: tuple[str, ...]
    query: str
    context: Conversation  # the prompt's messages after the query (multi-turn prompts)
    conversation: Conversation  # context + the completion


class CRMReward:
    """A reward function for TRL's GRPOTrainer / RLOOTrainer from a trained CRM.

        reward = CRMReward("outputs/demo/export")            # round_robin for a pairwise CRM
        trainer = GRPOTrainer(model=..., reward_funcs=reward, train_dataset=ds)  # ds has `criteria`

    `crm` is an export directory or any checkpoint crm-train writes (or a CRMScorer). `strategy`
    defaults to `pointwise` for a pointwise CRM and `round_robin` for a pairwise one.
    """

    def __init__(self, crm: str | Path | CRMScorer, strategy: str | None = None, *,
                 criteria_column: str = "criteria", reference_column: str = "reference",
                 tau: float = 1.0, log_odds: bool = False, cache_size: int = 100_000,
                 batch_size: int = 16, device=None, dtype=None, name: str | None = None,
                 unfit: str = "raise"):
        self.scorer = crm if isinstance(crm, CRMScorer) else load_crm_scorer(
            crm, batch_size=batch_size, device=device, dtype=dtype)
        kind = self.scorer.kind
        self.strategy = strategy or ("pointwise" if kind == "pointwise" else "round_robin")
        if self.strategy not in STRATEGIES:
            raise CRMRewardError(f"strategy={self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if self.strategy == "pointwise" and kind != "pointwise":
            raise CRMRewardError("strategy='pointwise' needs a pointwise CRM (loss=ranking); a "
                                 "pairwise CRM compares: strategy='reference' or 'round_robin'")
        if self.strategy == "pointwise" and log_odds:
            raise CRMRewardError("log_odds=True: the pointwise reward is already unbounded")
        if tau <= 0 or (tau != 1.0 and kind != "pointwise"):
            raise CRMRewardError(f"tau={tau}: the positive temperature of a pointwise CRM's reward "
                                 "differences; a pairwise CRM gives probabilities")
        # "raise": a completion the length policy cannot fit is an error (an RL reward must never
        # lose a score silently); "nan": it scores NaN, for evaluations that count them.
        if unfit not in ("raise", "nan"):
            raise CRMRewardError(f"unfit={unfit!r}: 'raise' or 'nan'")
        self.unfit = unfit
        self.criteria_column, self.reference_column = criteria_column, reference_column
        self.tau, self.log_odds = tau, log_odds
        self.cache = LRU(cache_size)
        self._fits = LRU(cache_size)  # hashes of (criteria, query) pairs found to fit the length
        self.counts = Counter()
        # TRL names a reward's metrics after it (rewards/<name>/mean)
        self.__name__ = name or f"crm_{self.strategy}"

    # -- TRL's contract ----------------------------------------------------------------------

    def __call__(self, prompts: Sequence, completions: Sequence, completion_ids=None,
                 **columns) -> list[float]:
        rows = self.rows(prompts, completions, columns)
        if self.strategy == "pointwise":
            rewards, forwards = self._run(self._pointwise, rows)
        elif self.strategy == "reference":
            references = self._references(rows, columns)
            rewards, forwards = self._run(lambda r: self._against_reference(r, references), rows)
        else:
            rewards, forwards = self._run(self._round_robin, rows)
        if "log_metric" in columns:  # TRL averages these per logging step
            columns["log_metric"](f"{self.__name__}/forwards", float(forwards))
        return rewards

    def score_groups(self, groups: Sequence[tuple]) -> list[list[float]]:
        """Each group's rewards, for groups given as (criteria, query, completions): a benchmark's
        prompt and its completions (texts or assistant message lists). The round robin runs within
        each group as given, never across groups that share a prompt: a benchmark's rows are
        separate items even where two hold the same prompt. `pointwise` or `round_robin` only."""
        if self.strategy == "reference":
            raise CRMRewardError("score_groups scores completions against each other or alone: "
                                 "strategy='pointwise' or 'round_robin'")
        rows, members = [], []
        for g, (criteria, query, completions) in enumerate(groups):
            conversations = [_completion(c, g) for c in completions]
            for own, conversation in enumerate(conversations):
                rows.append(Row(tuple(criteria), query, (), conversation))
                members.append((conversations, own))
        self._check_fit(rows)
        if self.strategy == "pointwise":
            rewards, _ = self._run(self._pointwise, rows)
        else:
            rewards, _ = self._run(lambda r: self._round_robin(r, members), rows)
        out, start = [], 0
        for _, _, completions in groups:
            out.append(rewards[start:start + len(completions)])
            start += len(completions)
        return out

    def _run(self, strategy, rows: list[Row]) -> tuple[list[float], int]:
        """(rewards, forwards) of `strategy(rows)`, counted in `counts`."""
        before = self.scorer.counts["sequences"]
        try:
            with torch.inference_mode():
                rewards = strategy(rows)
        except CRMRewardError:
            raise
        except ValueError as exc:  # the scorer's: e.g. a long multi-turn context that cannot fit
            raise CRMRewardError(str(exc)) from None
        forwards = self.scorer.counts["sequences"] - before
        self.counts.update(completions=len(rows), forwards=forwards)
        return rewards, forwards

    def rows(self, prompts: Sequence, completions: Sequence, columns: dict) -> list[Row]:
        """The completions as the CRM reads them, with their criteria; bad input is refused."""
        if len(prompts) != len(completions):
            raise CRMRewardError(f"{len(prompts)} prompts but {len(completions)} completions")
        if self.criteria_column not in columns:
            raise CRMRewardError(
                f"no '{self.criteria_column}' column: the dataset needs one, holding each row's "
                "criteria (a list of strings or one string)")
        criteria = columns[self.criteria_column]
        if len(criteria) != len(prompts):
            raise CRMRewardError(f"'{self.criteria_column}' has {len(criteria)} values for "
                                 f"{len(prompts)} completions")
        rows = []
        for i, (prompt, completion, value) in enumerate(zip(prompts, completions, criteria)):
            query, context = _split_prompt(prompt, i)
            rows.append(Row(_criteria(value, i, self.criteria_column), query, context,
                            context + _completion(completion, i)))
        self._check_fit(rows)
        return rows

    # -- strategies -------------------------------------------------------------------------

    def _pointwise(self, rows: list[Row]) -> list[float]:
        return self._rewards([(r.criteria, r.query, r.conversation) for r in rows])

    def _references(self, rows: list[Row], columns: dict) -> list[Conversation]:
        if self.reference_column not in columns:
            raise CRMRewardError(f"strategy='reference' needs a '{self.reference_column}' column: "
                                 "each row's reference answer (text or an assistant message list)")
        references = columns[self.reference_column]
        for i, ref in enumerate(references):
            if ref is None or ref == "":
                raise CRMRewardError(f"row {i}: no reference answer in '{self.reference_column}'")
        return [row.context + _completion(ref, i, self.reference_column)
                for i, (row, ref) in enumerate(zip(rows, references))]

    def _against_reference(self, rows: list[Row], references: list[Conversation]) -> list[float]:
        pairs = [(r.criteria, r.query, r.conversation, ref) for r, ref in zip(rows, references)]
        if self.scorer.kind == "pointwise":
            return self._pointwise_comparisons(pairs)
        return [self._from_probability(p) for p in self._win_probabilities(pairs)]

    def _round_robin(self, rows: list[Row], members: list | None = None) -> list[float]:
        """`members`: each row's group and its place in it; None: groups found by value."""
        members = members or _group_members(rows)
        # Every (completion, opponent) comparison, each distinct pair once; the rewards average them.
        opponents = [[m for j, m in enumerate(group) if j != own] for group, own in members]
        pairs = list(dict.fromkeys((r.criteria, r.query, r.conversation, o)
                                   for r, others in zip(rows, opponents) for o in others))
        if self.scorer.kind == "pointwise":
            values = self._pointwise_comparisons(pairs)
        else:
            values = [self._from_probability(p) for p in self._win_probabilities(pairs)]
        value = dict(zip(pairs, values))
        out = []
        for r, others in zip(rows, opponents):
            if not others:  # nothing to compare with: neutral
                out.append(0.0 if self.log_odds else 0.5)
                continue
            out.append(sum(value[(r.criteria, r.query, r.conversation, o)] for o in others)
                       / len(others))
        return out

    # -- pairwise CRM: win probabilities ---------------------------------------------------

    def _win_probabilities(self, pairs: list[tuple]) -> list[float]:
        """P(a beats b) for (criteria, query, a, b), both orders averaged: P(a,b) + P(b,a) = 1."""
        ordered = self._ordered_wins([(c, q, a, b) for c, q, a, b in pairs]
                                     + [(c, q, b, a) for c, q, a, b in pairs])
        n = len(pairs)
        return [(ordered[i] + 1.0 - ordered[n + i]) / 2 for i in range(n)]

    def _ordered_wins(self, pairs: list[tuple]) -> list[float]:
        """P(A wins) + P(tie)/2 with a in slot A, from the cache or one batched scorer call."""
        keys = [_key("pair", *p) for p in pairs]
        wins: dict[str, float] = {}
        todo: dict[str, tuple] = {}
        for key, (c, q, a, b) in zip(keys, pairs):
            if a == b:  # the same answer twice: a tie, no forward
                wins[key] = 0.5
            elif (hit := self.cache.get(key)) is not None:
                wins[key] = hit
                self.counts["cache_hits"] += 1
            else:
                todo.setdefault(key, (c, q, a, b))
        if todo:
            probs = self.scorer.pair_probabilities(
                [PairExample(str(i), c, q, a, b, 0) for i, (c, q, a, b) in enumerate(todo.values())],
                unfit=self.unfit)
            for key, p in zip(todo, probs.tolist()):
                wins[key] = p[0] + p[2] / 2
                self.cache.put(key, wins[key])
        return [wins[k] for k in keys]

    def _from_probability(self, p: float) -> float:
        if not self.log_odds:
            return p
        p = min(max(p, LOGIT_EPS), 1 - LOGIT_EPS)
        return math.log(p / (1 - p))

    # -- pointwise CRM: rewards --------------------------------------------------------------

    def _pointwise_comparisons(self, pairs: list[tuple]) -> list[float]:
        """sigmoid((r_a - r_b) / tau) for (criteria, query, a, b); log_odds: (r_a - r_b) / tau."""
        items = list(dict.fromkeys(item for c, q, a, b in pairs for item in ((c, q, a), (c, q, b))))
        reward = dict(zip(items, self._rewards(items)))
        out = []
        for c, q, a, b in pairs:
            margin = (reward[(c, q, a)] - reward[(c, q, b)]) / self.tau
            out.append(margin if self.log_odds else 1 / (1 + math.exp(-margin)))
        return out

    def _rewards(self, items: list[tuple]) -> list[float]:
        """r(criteria, query, conversation) per item, each distinct uncached item scored once."""
        keys = [_key("point", *item) for item in items]
        values: dict[str, float] = {}
        todo: dict[str, tuple] = {}
        for key, item in zip(keys, items):
            if (hit := self.cache.get(key)) is not None:
                values[key] = hit
                self.counts["cache_hits"] += 1
            else:
                todo.setdefault(key, item)
        if todo:
            scored = self.scorer.score_many(list(todo.values()), unfit=self.unfit).tolist()
            for key, r in zip(todo, scored):
                values[key] = r
                self.cache.put(key, r)
        return [values[k] for k in keys]

    # -- input checks ------------------------------------------------------------------------

    def _check_fit(self, rows: list[Row]) -> None:
        """Criteria and query must fit the CRM's length with room for the answers: the length
        policy shortens answers, never the criteria, so a criteria set that does not fit can
        never be scored."""
        for i, over in enumerate(self._overflow([(r.criteria, r.query) for r in rows])):
            if over is not None:
                n, room = over
                raise CRMRewardError(
                    f"row {i}: the criteria and query take {n} tokens; the CRM reads at most "
                    f"{self.scorer.encoder.max_tokens} with {room} left for the answers: shorten "
                    "the criteria (the length policy never cuts them)")

    def fits(self, pairs: Sequence[tuple[Sequence[str], str]]) -> list[bool]:
        """Whether each (criteria, query) leaves the answers room within the CRM's length limit."""
        return [over is None for over in self._overflow([(tuple(c), q) for c, q in pairs])]

    def _overflow(self, pairs: list[tuple[tuple[str, ...], str]]) -> list[tuple[int, int] | None]:
        """Per (criteria, query): None when it fits, else (its tokens, the answers' least room).
        Each distinct pair is tokenized once, in batched tokenizer calls (thousands of rows cost
        a few passes, and only one chunk's token lists are alive), and a fitting pair is
        remembered in the bounded cache."""
        encoder = self.scorer.encoder
        empty = (Message("assistant", ""),)
        room = (2 if self.scorer.kind == "pairwise" else 1) * encoder.least_answer_tokens()
        keys = [_key("fit", criteria, query) for criteria, query in pairs]
        todo: dict[str, str] = {}  # key -> prompt text, in first-seen order
        for key, (criteria, query) in zip(keys, pairs):
            if key in todo or self._fits.get(key):
                continue
            if self.scorer.kind == "pairwise":
                todo[key] = self.scorer.template.pairwise_text(criteria, query, empty, empty)
            else:
                todo[key] = self.scorer.template.pointwise_text(criteria, query, empty)
        texts = list(todo.values())
        lengths = [len(ids) for start in range(0, len(texts), FIT_CHUNK)
                   for ids in encoder.encode_texts(texts[start:start + FIT_CHUNK])]
        over: dict[str, tuple[int, int]] = {}
        for key, n in zip(todo, lengths):
            if n + room > encoder.max_tokens:
                over[key] = n, room
            else:
                self._fits.put(key, True)
        return [over.get(key) for key in keys]


def load_crm_scorer(path: str | Path, **kwargs) -> CRMScorer:
    """CRMScorer.load, with anything that is not a CRM refused in one line."""
    path = Path(path)
    if not path.exists():
        raise CRMRewardError(f"{path}: no such export directory or checkpoint")
    try:
        return CRMScorer.load(path, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CRMRewardError(
            f"{path}: not a CRM checkpoint ({reason}); expected an export directory with "
            "crm.json or a checkpoint crm-train wrote (.ckpt or a sharded dir)") from None

# -- reading TRL's values ------------------------------------------------------------------------


def _criteria(value, row: int, column: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise CRMRewardError(f"row {row}: '{column}' is {type(value).__name__}; expected a list "
                             "of strings or one string")
    criteria = tuple(c.strip() for c in value if isinstance(c, str))
    if len(criteria) != len(value) or not criteria or not all(criteria):
        raise CRMRewardError(f"row {row}: '{column}' is empty or holds an empty or non-string "
                             f"criterion: {excerpt(value)}")
    return criteria


def _text(content) -> str:
    """A message's content: a string, or the text parts of a content-block list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text")
    return str(content)


def _messages(value, row: int, what: str) -> Conversation:
    try:
        return tuple(m if isinstance(m, Message) else Message(m["role"], _text(m["content"]))
                     for m in value)
    except (TypeError, KeyError) as exc:
        raise CRMRewardError(f"row {row}: {what} is neither text nor a list of "
                             f"{{role, content}} messages ({exc!r})") from None


def _split_prompt(prompt, row: int) -> tuple[str, Conversation]:
    """(query, the messages after it): a text prompt is the query; a chat prompt's first user
    message is, and system messages (the policy's instructions, not the user's) are left out."""
    if isinstance(prompt, str):
        return prompt, ()
    messages = [m for m in _messages(prompt, row, "the prompt") if m.role != "system"]
    if not messages or messages[0].role != "user":
        raise CRMRewardError(f"row {row}: a chat prompt must start (after system messages) with "
                             "the user's message")
    return messages[0].content, tuple(messages[1:])


def _completion(completion, row: int, what: str = "the completion") -> Conversation:
    if isinstance(completion, str):
        return (Message("assistant", completion),)
    return _messages(completion, row, what)


def _key(*parts) -> str:
    """A short, stable cache key (the texts themselves would hold megabytes per thousand keys)."""
    data = json.dumps(parts, ensure_ascii=False, default=lambda m: [m.role, m.content])
    return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


def _group_members(rows: list[Row]) -> list[tuple[list[Conversation], int]]:
    """For each row: its group's completions (all processes') and its own index in that list."""
    everything, offset = gather_rows(rows)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, r in enumerate(everything):
        groups[(r.criteria, r.query, r.context)].append(index)
    out = []
    for index, r in enumerate(rows, start=offset):
        members = groups[(r.criteria, r.query, r.context)]
        out.append(([everything[m].conversation for m in members], members.index(index)))
    return out


def gather_rows(rows: list[Row]) -> tuple[list[Row], int]:
    """Every process's rows in rank order, and where this process's start. One process: its own."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return rows, 0
    world = torch.distributed.get_world_size()
    if world == 1:
        return rows, 0
    parts: list = [None] * world
    # Pickled between this job's own processes (torch's object collective), never from outside.
    torch.distributed.all_gather_object(parts, [tuple(r) for r in rows])
    rank = torch.distributed.get_rank()
    offset = sum(len(p) for p in parts[:rank])
    return [Row(*r) for part in parts for r in part], offset


def split_calls(sizes: list[int], index: list[int], limit: int, pairwise: bool):
    """`index` cut into runs whose sequences (G(G - 1) for a pairwise group of G, G pointwise)
    add up to at most `limit` (a group alone may exceed it): the token ids of one call are held
    at once."""
    chunk, total = [], 0
    for g, i in zip(sizes, index):
        cost = g * (g - 1) if pairwise else g
        if chunk and total + cost > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(i)
        total += cost
    if chunk:
        yield chunk
