"""CRMScorer: batched inference with a trained CRM, no trainer needed.

Prefix reuse (docs/DESIGN.md section 8). In a leaderboard every candidate is compared with the same
baseline under the same criteria and query: with the baseline in slot A, the prompt up to the slot-B
header is the same for every candidate. Such a shared prefix is run once, its keys and values are
kept, and only each candidate's tokens (its response and the template's tail) run against them.

- Which prefix: within one call, examples that share criteria, query and conversation A are split
  right before conversation B; otherwise examples that share criteria and query (the swapped order
  of a leaderboard, or the responses of a pointwise model to one query) are split right before
  their first conversation. A group of rows takes the prefix path only when that saves at least
  crm.inference.prefix_reuse.PREFIX_MIN_SAVING of its tokens: the N + 1 responses of a pointwise leaderboard
  query do, the two responses of a pointwise test pair usually do not. Everything else takes the
  plain path.
- How: crm.inference.prefix_reuse runs each shared prefix once and only the rows' suffixes over its cached
  keys and values; a row whose tokens differ at the split, or a group that would save too little,
  takes the plain path. `counts` says how many did (split_mismatch, prefix_declined,
  prefix_sequences).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from crm.core.examples import PairExample, swap
from crm.core.prompts import PromptEncoder, PromptTemplate
from crm.core.records import Conversation, Message
from crm.data.padding import pad_rows
from crm.inference.prefix_reuse import prefix_logits
from crm.models import compile as compiling
from crm.models.checkpoint import load_crm
from crm.models.export import META, load_export
from crm.models.heads import davidson_logits, last_token_logits

SENTINEL = "\x00crm-slot\x00"  # stands for the conversation where a prompt is split


def default_device_dtype() -> tuple[torch.device, torch.dtype]:
    """CUDA + bfloat16 where a GPU is visible, else CPU + float32."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def as_conversation(response: str | Conversation) -> Conversation:
    """A response after the query: plain text is one assistant message."""
    if isinstance(response, str):
        return (Message("assistant", response),)
    return tuple(m if isinstance(m, Message) else Message(m["role"], m["content"]) for m in response)


def unswap(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities computed on the B/A order, expressed for the A/B order."""
    return probs[:, [1, 0, 2]]


class Preference(float):
    """P(A is preferred), a float; `.tie` is P(tie) (0.0 without a 3-way head)."""

    tie: float

    def __new__(cls, p_a: float, tie: float = 0.0):
        obj = super().__new__(cls, p_a)
        obj.tie = tie
        return obj


@dataclass
class _Row:
    """One sequence to score: its ids, and the text of the prefix it may share with others."""

    ids: list[int]
    prefix_text: str | None = None  # None: the plain path


class CRMScorer:
    """Compares responses under criteria: `compare_many` gives P(A), P(B), P(tie) per pair.

    A pairwise model reads both responses in one sequence; a pointwise model scores each response
    and compares with a sigmoid of the reward difference (with a tie model, Davidson's three
    probabilities of it: crm.models.heads.davidson_logits). Prompts that the length policy cannot fit
    are refused with an error (a score must never silently disappear), or with unfit="nan" get NaN
    (an evaluation counts them as wrong and reports how many).
    """

    def __init__(self, model, tokenizer, template: PromptTemplate, kind: str, max_tokens: int,
                 batch_size: int = 16, device: torch.device | None = None,
                 prefix_reuse: bool = True, progress: bool = False, compile: bool | str = "auto",
                 ties: dict | None = None):
        self.model, self.tokenizer, self.kind = model.eval(), tokenizer, kind
        # a pointwise CRM's tie model (crm.models.checkpoint.tie_record): P(tie) from Davidson's
        self.tie_log_nu = None if ties is None else torch.tensor([ties["log_nu"]])
        self.encoder = PromptEncoder(tokenizer, template, max_tokens)
        self.template = template
        self.batch_size = batch_size
        self.device = device or next(model.parameters()).device
        # Training's compiled layers (crm.models.compile; auto: on CUDA, where inductor can build),
        # for the plain path; the prefix engine's cached keys and values run eagerly (a KV cache
        # read per layer index would cost a graph per layer).
        if compiling.decide(compile, self.device.type):
            compiling.compile_layers(model)
        self.num_labels = model.config.num_labels
        self.prefix_reuse = prefix_reuse
        self.progress = progress
        # A running total over the scorer's life, not per call: a leaderboard is several calls
        # (each criteria set, each order) and reports their sum; clear() it to start over.
        # Sequences scored, of which from a shared prefix; prefix rows that fell back to the plain
        # path (tokens differ at the split) or were declined; tokens in the prompts, and tokens
        # the model computed (padding included in padded_tokens).
        self.counts = Counter()

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "CRMScorer":
        """An export directory (with crm.json), or any checkpoint crm-train writes (a .ckpt file
        or an FSDP sharded dir): a checkpoint carries its tokenizer and template."""
        path = Path(path)
        if (path / META).is_file():
            return cls.from_export(path, **kwargs)
        if path.exists():
            return cls.from_checkpoint(path, **kwargs)
        raise FileNotFoundError(f"{path}: neither an export directory ({META}) nor a checkpoint "
                                "(a .ckpt file or a sharded checkpoint dir)")

    @classmethod
    def from_export(cls, export_dir: str | Path, batch_size: int = 16, device=None, dtype=None,
                    **kwargs) -> "CRMScorer":
        auto_device, auto_dtype = default_device_dtype()
        model, tokenizer, template, meta = load_export(export_dir, dtype=dtype or auto_dtype)
        model.to(device or auto_device)
        return cls(model, tokenizer, template, meta["kind"], meta["max_tokens"], batch_size,
                   ties=meta.get("ties"), **kwargs)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, batch_size: int = 16, device=None, dtype=None,
                        **kwargs) -> "CRMScorer":
        """The weights of a crm-train checkpoint (e.g. last.ckpt rather than the exported best)."""
        auto_device, auto_dtype = default_device_dtype()
        crm, _ = load_crm(checkpoint, dtype=dtype or auto_dtype)
        crm.model.to(device or auto_device)
        return cls(crm.model, crm.tokenizer, crm.template, crm.kind, crm.max_tokens, batch_size,
                   ties=crm.ties, **kwargs)

    # -- the public API --------------------------------------------------------------------------

    def pair_probabilities(self, examples: Sequence[PairExample], unfit: str = "raise",
                           both_orders: bool = False) -> torch.Tensor:
        """(n, 3): P(A), P(B), P(tie) per example (P(tie) = 0 without a tie class).

        `both_orders` also scores every pair with A and B swapped and averages the two (a
        position-debiased judgement; a pointwise model has no position to debias).
        """
        probs = self._probabilities(examples, unfit)
        if both_orders and self.kind == "pairwise":
            swapped = unswap(self._probabilities([swap(e) for e in examples], unfit))
            probs = (probs + swapped) / 2
        return probs

    def compare_many(self, items: Sequence[tuple], both_orders: bool = False) -> torch.Tensor:
        """(n, 3) P(A), P(B), P(tie) for [(criteria, query, a, b)]; a, b: text or messages."""
        return self.pair_probabilities(
            [PairExample(str(i), tuple(c), q, as_conversation(a), as_conversation(b), 0)
             for i, (c, q, a, b) in enumerate(items)], both_orders=both_orders)

    def compare(self, criteria: Sequence[str], query: str, a, b,
                both_orders: bool = False) -> Preference:
        """P(response `a` is preferred to `b`) under `criteria`; `.tie` holds P(tie)."""
        p = self.compare_many([(criteria, query, a, b)], both_orders=both_orders)[0]
        return Preference(float(p[0]), float(p[2]))

    def score_many(self, items: Sequence[tuple], unfit: str = "raise") -> torch.Tensor:
        """Pointwise rewards for [(criteria, query, response)]; response: text or messages."""
        if self.kind != "pointwise":
            raise ValueError("score_many needs a pointwise CRM; a pairwise CRM compares pairs")
        return self._rewards([(tuple(c), q, as_conversation(r)) for c, q, r in items], unfit)

    def score(self, criteria: Sequence[str], query: str, response) -> float:
        return float(self.score_many([(criteria, query, response)])[0])

    # -- probabilities ---------------------------------------------------------------------------

    def _probabilities(self, examples: Sequence[PairExample], unfit: str) -> torch.Tensor:
        if self.kind == "pointwise":
            # Each distinct response once: a leaderboard's baseline is scored once per query.
            items = list(dict.fromkeys((e.criteria, e.query, c) for e in examples
                                       for c in (e.conv_a, e.conv_b)))
            index = {item: i for i, item in enumerate(items)}
            rewards = self._rewards(items, unfit)
            r_a = rewards[[index[(e.criteria, e.query, e.conv_a)] for e in examples]]
            r_b = rewards[[index[(e.criteria, e.query, e.conv_b)] for e in examples]]
            if self.tie_log_nu is not None:  # NaN rewards stay NaN: an unfit pair
                return davidson_logits(r_a - r_b, self.tie_log_nu).softmax(-1)
            p_a = torch.sigmoid(r_a - r_b)
            return torch.stack([p_a, 1 - p_a, torch.zeros_like(p_a)], dim=1)
        encoded = self._fitted(self.encoder.fit_pairwise([(e.criteria, e.query, e.conv_a, e.conv_b)
                                                           for e in examples]))
        self._check_fit(encoded, "pairs", unfit)
        rows = self._pairwise_rows(examples, encoded)
        probs = torch.full((len(examples), 3), float("nan"))
        fits = torch.tensor([r is not None for r in rows], dtype=torch.bool)
        scored = self._logits([r for r in rows if r is not None]).softmax(-1)
        probs[fits, :scored.shape[1]] = scored
        if scored.shape[1] == 2:
            probs[fits, 2] = 0.0
        return probs

    def _rewards(self, items: Sequence[tuple], unfit: str) -> torch.Tensor:
        encoded = self._fitted(self.encoder.fit_pointwise(list(items)))
        self._check_fit(encoded, "responses", unfit)
        rows = self._pointwise_rows(items, encoded)
        rewards = torch.full((len(items),), float("nan"))
        fits = torch.tensor([r is not None for r in rows], dtype=torch.bool)
        rewards[fits] = self._logits([r for r in rows if r is not None]).squeeze(-1)
        return rewards

    def _fitted(self, fits: list) -> list:
        """The prompts' token ids; those the length policy shortened to fit are counted
        (`counts["shortened"]`): a verdict on a cut response is one a user should know of."""
        self.counts["shortened"] += sum(f.ids is not None and f.shortened for f in fits)
        return [f.ids for f in fits]

    def _check_fit(self, encoded: list, what: str, unfit: str) -> None:
        if unfit == "raise" and any(ids is None for ids in encoded):
            raise ValueError(f"{sum(i is None for i in encoded)} {what} cannot fit in "
                             f"{self.encoder.max_tokens} tokens even with shortened responses")

    # -- where prompts split ---------------------------------------------------------------------

    def _pairwise_rows(self, examples: Sequence[PairExample], encoded: list) -> list[_Row | None]:
        rows = [None if ids is None else _Row(ids) for ids in encoded]
        if not self.prefix_reuse:
            return rows
        render = self.template.pairwise_text
        with_a = Counter((e.criteria, e.query, e.conv_a) for e in examples)
        with_query = Counter((e.criteria, e.query) for e in examples)
        for e, row in zip(examples, rows):
            if row is None:
                continue
            if with_a[(e.criteria, e.query, e.conv_a)] > 1:  # split before conversation B
                row.prefix_text = self._prefix(render(e.criteria, e.query, e.conv_a, _slot()))
            elif with_query[(e.criteria, e.query)] > 1:  # split before conversation A
                row.prefix_text = self._prefix(render(e.criteria, e.query, _slot(), e.conv_b))
        return rows

    def _pointwise_rows(self, items: Sequence[tuple], encoded: list) -> list[_Row | None]:
        rows = [None if ids is None else _Row(ids) for ids in encoded]
        if not self.prefix_reuse:
            return rows
        with_query = Counter((c, q) for c, q, _ in items)
        for (criteria, query, conv), row in zip(items, rows):
            if row is not None and with_query[(criteria, query)] > 1:
                row.prefix_text = self._prefix(
                    self.template.pointwise_text(criteria, query, _slot()))
        return rows

    def _prefix(self, text: str) -> str | None:
        """The chat text before SENTINEL in `text` (a prompt with SENTINEL in the split slot)."""
        chat = self.encoder.chat_text(text)
        if chat.count(SENTINEL) != 1:  # the chat template changed the content: no split
            return None
        return chat.split(SENTINEL)[0]

    # -- running the model -----------------------------------------------------------------------

    def _logits(self, rows: list[_Row]) -> torch.Tensor:
        """Logits for rows: the shared-prefix ones from cached prefixes, the others plainly."""
        out = torch.empty(len(rows), max(self.num_labels, 1))
        bar = _progress(len(rows), self.progress)
        shared = {}
        if any(r.prefix_text is not None for r in rows):
            with compiling.eager():
                shared = prefix_logits(self.model, self.tokenizer, [r.ids for r in rows],
                                       [r.prefix_text for r in rows], batch_size=self.batch_size,
                                       device=self.device, counts=self.counts, bar=bar)
        plain = [i for i in range(len(rows)) if i not in shared]
        if plain:
            out[plain] = self._plain_logits([rows[i].ids for i in plain], bar)
        if shared:
            out[list(shared)] = torch.stack(list(shared.values()))
        bar.close()
        self.counts["sequences"] += len(rows)
        self.counts["prompt_tokens"] += sum(len(r.ids) for r in rows)
        return out

    @torch.inference_mode()
    def _plain_logits(self, rows: list[list[int]], bar) -> torch.Tensor:
        # Length-sorted batches pad less; the order is restored at the end.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out = torch.empty(len(rows), max(self.num_labels, 1))
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            batch = pad_rows([rows[i] for i in index], self.tokenizer.pad_token_id)
            logits = last_token_logits(self.model, batch["input_ids"].to(self.device),
                                       batch["attention_mask"].to(self.device))
            out[index] = logits.float().cpu()
            self.counts["computed_tokens"] += int(batch["attention_mask"].sum())
            self.counts["padded_tokens"] += batch["input_ids"].numel()
            bar.update(len(index))
        return out


def _slot() -> Conversation:
    """A conversation rendered as the bare SENTINEL (a single answer is shown bare)."""
    return (Message("assistant", SENTINEL),)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled or total == 0, unit="seq", dynamic_ncols=True,
                leave=False)
