"""Criteria-conditioned prompts -> chat messages -> token ids, under a length policy.

The templates are our own wording and are configuration: crm-train's `template` group replaces any
field, and checkpoints and exports carry the template they trained with. A prompt is one user
message rendered through the tokenizer's chat template. The length policy never
cuts the tail of the sequence (response B and the final token the head reads): it shortens the
middles of the responses, or drops the example, and counts both.

No torch here: the tokenizer is any object with `apply_chat_template` and `__call__`/`decode`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

from crm.core.records import Conversation, Message

PAIRWISE_TEMPLATE = """Compare two responses to the same query for a user with these criteria.

## Criteria
{criteria}

## Query
{query}

## Response A
{conversation_a}

## Response B
{conversation_b}

Which response does this user prefer?"""

POINTWISE_TEMPLATE = """Rate a response for a user with these criteria.

## Criteria
{criteria}

## Query
{query}

## Response
{conversation}

How well does the response meet this user's criteria?"""

ELLIPSIS = " [...] "
FIELDS = {"pairwise": ("criteria", "query", "conversation_a", "conversation_b"),
          "pointwise": ("criteria", "query", "conversation"),
          "criterion": ("criterion",), "turn": ("role", "content")}


DEFAULTS = {"pairwise": PAIRWISE_TEMPLATE, "pointwise": POINTWISE_TEMPLATE,
            "criterion": "- {criterion}", "turn": "{role}: {content}",
            "roles": {"user": "User", "assistant": "Assistant", "system": "System"}}


@dataclass(frozen=True)
class PromptTemplate:
    """crm's wording, any field replaced; None keeps crm's (DEFAULTS). crm-train's `template`
    section (configs/train.yaml) is this dataclass."""

    pairwise: str | None = None  # fields: criteria, query, conversation_a, conversation_b
    pointwise: str | None = None  # fields: criteria, query, conversation
    criterion: str | None = None  # one line per criterion
    turn: str | None = None  # one line per message after the query
    roles: dict | None = None  # role names that `turn` shows
    system: str | None = None  # an optional system message before the prompt (none by default)

    def __post_init__(self):
        for name, default in DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, copy.deepcopy(default))
        # A field the template does not know would otherwise fail mid-run, in a DataLoader worker.
        for name, fields in FIELDS.items():
            try:
                getattr(self, name).format(**dict.fromkeys(fields, ""))
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"template {name}: {exc!r}; its fields are "
                                 f"{', '.join('{' + f + '}' for f in fields)}") from None

    def criteria_block(self, criteria) -> str:
        return "\n".join(self.criterion.format(criterion=c) for c in criteria)

    def conversation_block(self, conversation: Conversation) -> str:
        # A single answer is shown bare; a multi-turn conversation is shown in full, turn by turn.
        if len(conversation) == 1 and conversation[0].role == "assistant":
            return conversation[0].content
        return "\n".join(self.turn.format(role=self.roles[m.role], content=m.content)
                         for m in conversation)

    def pairwise_text(self, criteria, query: str, conv_a: Conversation, conv_b: Conversation) -> str:
        return self.pairwise.format(criteria=self.criteria_block(criteria), query=query,
                                    conversation_a=self.conversation_block(conv_a),
                                    conversation_b=self.conversation_block(conv_b))

    def pointwise_text(self, criteria, query: str, conversation: Conversation) -> str:
        return self.pointwise.format(criteria=self.criteria_block(criteria), query=query,
                                     conversation=self.conversation_block(conversation))

    def messages(self, text: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": text}]


class Fit(NamedTuple):
    """A prompt under the length policy: its token ids (None: dropped) and whether it was shortened."""

    ids: list[int] | None
    shortened: bool


class PromptEncoder:
    """Renders examples to token ids no longer than `max_tokens`.

    `min_turn_tokens` is the least a shortened message keeps (half from its start, half from its
    end); when even that does not fit, the example is dropped. The `*_many` methods tokenize a whole
    batch in one call, which is most of the cost of the data stream.
    """

    def __init__(self, tokenizer, template: PromptTemplate | None = None, max_tokens: int = 2048,
                 min_turn_tokens: int = 16):
        self.tokenizer = tokenizer
        self.template = template or PromptTemplate()
        self.max_tokens = max_tokens
        self.min_turn_tokens = min_turn_tokens
        self._affixes = self._chat_affixes()

    def least_answer_tokens(self) -> int:
        """The fewest tokens the length policy shortens an answer to: `min_turn_tokens` and the
        ellipsis that marks the cut. A check that criteria and query leave the answers room must
        leave each this much, or it passes prompts that this encoder then drops."""
        return self.min_turn_tokens + self._marker_tokens()

    def _marker_tokens(self) -> int:
        return len(self.tokenizer(ELLIPSIS, add_special_tokens=False)["input_ids"])

    def _chat_affixes(self) -> tuple[str, str] | None:
        """The chat template's text before and after the user's content, when it is a plain wrapper.

        Rendering the Jinja template per example costs as much as tokenizing it; most templates
        only wrap the content, so it is rendered once. A template that transforms the content (the
        check below notices) is rendered per example.
        """
        sentinel = "\x00crm-content\x00"
        rendered = self._render_chat(sentinel)
        if rendered.count(sentinel) != 1:
            return None
        prefix, suffix = rendered.split(sentinel)
        probe = "probe text\nwith two lines"
        return (prefix, suffix) if self._render_chat(probe) == prefix + probe + suffix else None

    def _render_chat(self, text: str) -> str:
        return self.tokenizer.apply_chat_template(self.template.messages(text), tokenize=False)

    def chat_text(self, text: str) -> str:
        if self._affixes is None:
            return self._render_chat(text)
        return self._affixes[0] + text + self._affixes[1]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        chats = [self.chat_text(t) for t in texts]
        return self.tokenizer(chats, add_special_tokens=False)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        return self.encode_texts([text])[0]

    def pairwise_many(self, items) -> list:
        """[(criteria, query, conv_a, conv_b)] -> token ids or None (dropped) for each."""
        return [fit.ids for fit in self.fit_pairwise(items)]

    def pointwise_many(self, items) -> list:
        """[(criteria, query, conversation)] -> token ids or None (dropped) for each."""
        return [fit.ids for fit in self.fit_pointwise(items)]

    def fit_pairwise(self, items) -> list[Fit]:
        """As `pairwise_many`, saying for each prompt whether the length policy shortened it."""
        return self._fit_many([(lambda a, b, c=c, q=q: self.template.pairwise_text(c, q, a, b), [a, b])
                               for c, q, a, b in items])

    def fit_pointwise(self, items) -> list[Fit]:
        return self._fit_many([(lambda x, c=c, q=q: self.template.pointwise_text(c, q, x), [conv])
                               for c, q, conv in items])

    def _fit_many(self, items) -> list[Fit]:
        encoded = self.encode_texts([render(*convs) for render, convs in items])
        return [Fit(ids, False) if len(ids) <= self.max_tokens else self._shorten_to_fit(render, convs, ids)
                for ids, (render, convs) in zip(encoded, items)]

    def _shorten_to_fit(self, render, conversations: list[Conversation], ids: list[int]) -> Fit:
        contents = [self.tokenizer(m.content, add_special_tokens=False)["input_ids"]
                    for conv in conversations for m in conv]
        excess = len(ids) - self.max_tokens
        marker = self._marker_tokens()
        lengths = [len(c) for c in contents]
        # Retokenizing a shortened text can merge differently at the cuts: re-check, cut a bit more.
        for _ in range(4):
            cap = _water_level(lengths, excess, marker)
            if cap is None or cap < self.min_turn_tokens:
                break
            ids = self.encode_text(render(*self._shorten(conversations, contents, cap)))
            if len(ids) <= self.max_tokens:
                return Fit(ids, True)
            # At least one token per capped message, so the cap always moves down.
            excess += max(len(ids) - self.max_tokens, sum(n > cap for n in lengths))
        return Fit(None, False)

    def _shorten(self, conversations, contents, cap: int) -> list[Conversation]:
        out, i = [], 0
        for conv in conversations:
            messages = []
            for m in conv:
                ids = contents[i]
                i += 1
                if len(ids) > cap:
                    head, tail = ids[: cap // 2], ids[len(ids) - (cap - cap // 2):]
                    text = (self.tokenizer.decode(head) + ELLIPSIS + self.tokenizer.decode(tail))
                    m = Message(m.role, text)
                messages.append(m)
            out.append(tuple(messages))
        return out


def _water_level(lengths: list[int], excess: int, marker: int = 0) -> int | None:
    """The largest per-message cap that removes at least `excess` tokens (None if none does).

    A capped message keeps `cap` tokens plus a `marker` of `marker` tokens. Capping the longest
    messages first keeps short answers intact and shortens long ones evenly.
    """
    target = sum(lengths) - excess

    def kept(cap: int) -> int:
        return sum(n if n <= cap else cap + marker for n in lengths)

    if target <= 0 or kept(0) > target:
        return None
    lo, hi = 0, max(lengths)
    while lo < hi:  # largest cap with kept(cap) <= target
        mid = (lo + hi + 1) // 2
        if kept(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
