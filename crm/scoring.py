"""CRMScorer: batched inference with a trained CRM, no trainer needed.

Prefix reuse (DESIGN section 8). In a leaderboard every candidate is compared with the same
baseline under the same criteria and query: with the baseline in slot A, the prompt up to the slot-B
header is the same for every candidate. Such a shared prefix is run once, its keys and values are
kept, and only each candidate's tokens (its response and the template's tail) run against them.

- Which prefix: within one call, examples that share criteria, query and conversation A are split
  right before conversation B; otherwise examples that share criteria and query (the swapped order
  of a leaderboard, or the responses of a pointwise model to one query) are split right before
  their first conversation. A group of rows takes the prefix path only when that saves at least
  PREFIX_MIN_SAVING of its tokens: the N + 1 responses of a pointwise leaderboard query do, the two
  responses of a pointwise test pair usually do not. Everything else takes the plain path.
- Same tokens, same score: the prefix text is tokenized alone, and a row is only scored from the
  prefix when its own ids (the whole prompt, as the plain path tokenizes it) start with exactly
  those ids; its suffix is the rest of its own ids, so the model reads the plain path's tokens.
  The split follows the newline that ends a slot header, where byte-level pre-tokenizers split
  before a word; a response that starts with whitespace or newlines can merge with that newline,
  and a prompt the length policy shortened differs earlier. Such rows take the plain path;
  `counts` says how many did (split_mismatch, prefix_declined, prefix_sequences).
- Batches: the prefixes of up to `batch_size` groups run as one right-padded batch; then each
  group's rows run in batches of `batch_size`, each row over its own group's cached keys/values,
  with the prefix's padding masked and position ids continuing from the prefix's real length.
  The head reads each row's last real token, as on the plain path. Scores equal the plain path's to
  float rounding (tests: 1e-4 in float32; bf16 on a GPU rounds differently, as any batch change does).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from crm.data.stream import pad_rows
from crm.models.crm import last_token_logits
from crm.models.export import META, load_export
from crm.prompts import PromptEncoder, PromptTemplate
from crm.records import Conversation, Message
from crm.transforms import PairExample, swap

SENTINEL = "\x00crm-slot\x00"  # stands for the conversation where a prompt is split
LIGHTNING_PREFIX = "crm.model."  # where a crm-train checkpoint keeps the HF model's weights
# The prefix path costs a copy of the cached keys/values per row, attention with an explicit mask
# and padding in two places: a group takes it only when it saves at least this share of its tokens
# (on CPU, a pointwise test pair, criteria + query shared by two responses, saves a quarter of its
# tokens yet ran 15-40% slower, its two-row groups padding worse than length-sorted batches; a
# leaderboard query with 8 candidates saves about 55% and ran 1.5-2.3x faster,
# benchmarks/leaderboard_prefix.py).
PREFIX_MIN_SAVING = 1 / 3


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
    and compares with a sigmoid of the reward difference. Prompts that the length policy cannot fit
    are refused with an error (a score must never silently disappear), or with unfit="nan" get NaN
    (an evaluation counts them as wrong and reports how many).
    """

    def __init__(self, model, tokenizer, template: PromptTemplate, kind: str, max_tokens: int,
                 batch_size: int = 16, device: torch.device | None = None,
                 prefix_reuse: bool = True, progress: bool = False):
        self.model, self.tokenizer, self.kind = model.eval(), tokenizer, kind
        self.encoder = PromptEncoder(tokenizer, template, max_tokens)
        self.template = template
        self.batch_size = batch_size
        self.device = device or next(model.parameters()).device
        self.num_labels = model.config.num_labels
        self.prefix_reuse = prefix_reuse
        self.progress = progress
        # sequences scored, of which from a shared prefix; prefix rows that fell back to the plain
        # path (tokens differ at the split); tokens in the prompts, and tokens the model computed.
        self.counts = Counter()

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "CRMScorer":
        """An export directory (with crm.json), or a crm-train checkpoint (.ckpt) of a run whose
        export holds the architecture, tokenizer and template."""
        path = Path(path)
        if path.is_dir():
            return cls.from_export(path, **kwargs)
        if path.suffix == ".ckpt" and path.is_file():
            return cls.from_checkpoint(path, **kwargs)
        raise FileNotFoundError(f"{path}: neither an export directory ({META}) nor a .ckpt file")

    @classmethod
    def from_export(cls, export_dir: str | Path, batch_size: int = 16, device=None, dtype=None,
                    **kwargs) -> "CRMScorer":
        auto_device, auto_dtype = default_device_dtype()
        model, tokenizer, template, meta = load_export(export_dir, dtype=dtype or auto_dtype)
        model.to(device or auto_device)
        return cls(model, tokenizer, template, meta["kind"], meta["max_tokens"], batch_size,
                   **kwargs)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, export_dir: str | Path | None = None,
                        **kwargs) -> "CRMScorer":
        """The weights of a crm-train checkpoint (e.g. last.ckpt rather than the exported best).

        `export_dir` defaults to the run's own export (RUN/checkpoints/X.ckpt -> RUN/export).
        """
        checkpoint = Path(checkpoint)
        export_dir = Path(export_dir) if export_dir else checkpoint.parent.parent / "export"
        scorer = cls.from_export(export_dir, **kwargs)
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
        state = {k[len(LIGHTNING_PREFIX):]: v for k, v in saved.items()
                 if k.startswith(LIGHTNING_PREFIX)}
        if not state:
            raise ValueError(f"{checkpoint}: no '{LIGHTNING_PREFIX}*' weights (not a crm-train "
                             "checkpoint, or a sharded one: export it first)")
        missing, unexpected = scorer.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{checkpoint} does not match {export_dir}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return scorer

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

    def score_many(self, items: Sequence[tuple]) -> torch.Tensor:
        """Pointwise rewards for [(criteria, query, response)]; response: text or messages."""
        if self.kind != "pointwise":
            raise ValueError("score_many needs a pointwise CRM; a pairwise CRM compares pairs")
        return self._rewards([(tuple(c), q, as_conversation(r)) for c, q, r in items], "raise")

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
            p_a = torch.sigmoid(r_a - r_b)
            return torch.stack([p_a, 1 - p_a, torch.zeros_like(p_a)], dim=1)
        encoded = self.encoder.pairwise_many([(e.criteria, e.query, e.conv_a, e.conv_b)
                                              for e in examples])
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
        encoded = self.encoder.pointwise_many(list(items))
        self._check_fit(encoded, "responses", unfit)
        rows = self._pointwise_rows(items, encoded)
        rewards = torch.full((len(items),), float("nan"))
        fits = torch.tensor([r is not None for r in rows], dtype=torch.bool)
        rewards[fits] = self._logits([r for r in rows if r is not None]).squeeze(-1)
        return rewards

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
        groups = self._prefix_groups(rows)
        in_groups = {i for members in groups.values() for i in members}
        plain = [i for i in range(len(rows)) if i not in in_groups]
        bar = _progress(len(rows), self.progress)
        if plain:
            out[plain] = self._plain_logits([rows[i].ids for i in plain], bar)
        if groups:
            prefixes = sorted(groups, key=len)  # similar lengths together: less padding in the cache
            for start in range(0, len(prefixes), self.batch_size):
                chunk = prefixes[start:start + self.batch_size]
                members = [groups[p] for p in chunk]
                suffixes = [[rows[i].ids[len(p):] for i in m] for p, m in zip(chunk, members)]
                logits = self._prefix_logits([list(p) for p in chunk], suffixes, bar)
                for m, g in zip(members, logits):
                    out[m] = g
        bar.close()
        self.counts["sequences"] += len(rows)
        self.counts["prompt_tokens"] += sum(len(r.ids) for r in rows)
        return out

    def _prefix_groups(self, rows: list[_Row]) -> dict[tuple, list[int]]:
        """{prefix ids: row indices} for rows whose ids start with their prefix's ids."""
        split = [i for i, r in enumerate(rows) if r.prefix_text is not None]
        if not split:
            return {}
        texts = list(dict.fromkeys(rows[i].prefix_text for i in split))
        prefix_ids = dict(zip(texts, self.tokenizer(texts, add_special_tokens=False)["input_ids"]))
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i in split:
            prefix, ids = prefix_ids[rows[i].prefix_text], rows[i].ids
            if len(prefix) < len(ids) and ids[:len(prefix)] == prefix:
                groups[tuple(prefix)].append(i)
            else:
                self.counts["split_mismatch"] += 1
        kept = {}
        for prefix, members in groups.items():
            saved = (len(members) - 1) * len(prefix)
            if saved >= PREFIX_MIN_SAVING * sum(len(rows[i].ids) for i in members):
                kept[prefix] = members
            else:
                self.counts["prefix_declined"] += len(members)
        return kept

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

    @torch.inference_mode()
    def _prefix_logits(self, prefixes: list[list[int]], suffixes: list[list[list[int]]],
                       bar) -> list[torch.Tensor]:
        """Per prefix, the logits of its suffixes (each continues that prefix)."""
        pad = self.tokenizer.pad_token_id
        backbone = self.model.model
        batch = pad_rows(prefixes, pad)
        prefix_mask = batch["attention_mask"].to(self.device)
        cache = backbone(input_ids=batch["input_ids"].to(self.device), attention_mask=prefix_mask,
                         use_cache=True).past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self.counts["computed_tokens"] += int(prefix_mask.sum())
        self.counts["padded_tokens"] += prefix_mask.numel()
        lengths = prefix_mask.sum(dim=1)

        rows = [(g, s) for g, group in enumerate(suffixes) for s in group]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
        flat = torch.empty(len(rows), max(self.num_labels, 1))
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            group = torch.tensor([rows[i][0] for i in index], device=self.device)
            part = pad_rows([rows[i][1] for i in index], pad)
            suffix_mask = part["attention_mask"].to(self.device)
            width = suffix_mask.shape[1]
            rows_cache = DynamicCache([(k[group], v[group]) for k, v in kv],
                                      config=self.model.config)
            hidden = backbone(
                input_ids=part["input_ids"].to(self.device),
                attention_mask=torch.cat([prefix_mask[group], suffix_mask], dim=1),
                position_ids=lengths[group, None] + torch.arange(width, device=self.device),
                past_key_values=rows_cache, use_cache=True).last_hidden_state
            last = suffix_mask.sum(dim=1) - 1
            pooled = hidden[torch.arange(len(index), device=self.device), last]
            flat[index] = self.model.score(pooled).float().cpu()
            self.counts["computed_tokens"] += int(suffix_mask.sum())
            self.counts["padded_tokens"] += suffix_mask.numel()
            self.counts["prefix_sequences"] += len(index)
            bar.update(len(index))
        out, i = [], 0
        for group in suffixes:
            out.append(flat[i:i + len(group)])
            i += len(group)
        return out


def _slot() -> Conversation:
    """A conversation rendered as the bare SENTINEL (a single answer is shown bare)."""
    return (Message("assistant", SENTINEL),)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled or total == 0, unit="seq", dynamic_ncols=True,
                leave=False)
