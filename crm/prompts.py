"""Criteria-conditioned prompts -> chat messages -> token ids, under a length policy.

The templates are our own wording and are configuration: a config can replace any of them. A
prompt is one user message rendered through the tokenizer's chat template. The length policy never
cuts the tail of the sequence (response B and the final token the head reads): it shortens the
middles of the responses, or drops the example, and counts both.

No torch here: the tokenizer is any object with `apply_chat_template` and `__call__`/`decode`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from crm.records import Conversation, Message

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


@dataclass(frozen=True)
class PromptTemplate:
    pairwise: str = PAIRWISE_TEMPLATE  # fields: criteria, query, conversation_a, conversation_b
    pointwise: str = POINTWISE_TEMPLATE  # fields: criteria, query, conversation
    criterion: str = "- {criterion}"  # one line per criterion
    turn: str = "{role}: {content}"  # one line per message after the query
    roles: dict = field(default_factory=lambda: {"user": "User", "assistant": "Assistant",
                                                 "system": "System"})
    system: str | None = None  # an optional system message before the prompt

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


@dataclass
class LengthStats:
    """What the length policy did; summed across workers by whoever reads the batches."""

    rendered: int = 0
    shortened: int = 0
    dropped: int = 0

    def add(self, other: "LengthStats") -> None:
        self.rendered += other.rendered
        self.shortened += other.shortened
        self.dropped += other.dropped


class PromptEncoder:
    """Renders examples to token ids no longer than `max_tokens`.

    `min_turn_tokens` is the least a shortened message keeps (half from its start, half from its
    end); when even that does not fit, the example is dropped.
    """

    def __init__(self, tokenizer, template: PromptTemplate | None = None, max_tokens: int = 2048,
                 min_turn_tokens: int = 16):
        self.tokenizer = tokenizer
        self.template = template or PromptTemplate()
        self.max_tokens = max_tokens
        self.min_turn_tokens = min_turn_tokens
        self.stats = LengthStats()

    def encode_text(self, text: str) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(self.template.messages(text), tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def pairwise(self, criteria, query: str, conv_a: Conversation, conv_b: Conversation):
        """Token ids of the pairwise prompt, or None when it cannot fit."""
        return self._fit(lambda a, b: self.template.pairwise_text(criteria, query, a, b),
                         [conv_a, conv_b])

    def pointwise(self, criteria, query: str, conversation: Conversation):
        return self._fit(lambda c: self.template.pointwise_text(criteria, query, c), [conversation])

    def _fit(self, render, conversations: list[Conversation]):
        self.stats.rendered += 1
        ids = self.encode_text(render(*conversations))
        if len(ids) <= self.max_tokens:
            return ids
        contents = [self.tokenizer(m.content, add_special_tokens=False)["input_ids"]
                    for conv in conversations for m in conv]
        excess = len(ids) - self.max_tokens
        # Retokenizing a shortened text can merge differently at the cuts: re-check, cut a bit more.
        for _ in range(4):
            cap = _water_level([len(c) for c in contents], excess)
            if cap is None or cap < self.min_turn_tokens:
                break
            shortened = self._shorten(conversations, contents, cap)
            ids = self.encode_text(render(*shortened))
            if len(ids) <= self.max_tokens:
                self.stats.shortened += 1
                return ids
            excess += len(ids) - self.max_tokens
        self.stats.dropped += 1
        return None

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


def _water_level(lengths: list[int], excess: int) -> int | None:
    """The largest per-message cap that removes at least `excess` tokens (None if none does).

    Capping the longest messages first keeps short answers intact and shortens long ones evenly.
    """
    total = sum(lengths)
    target = total - excess
    if target <= 0:
        return None
    lo, hi = 0, max(lengths)
    while lo < hi:  # largest cap c with sum(min(l, c)) <= target
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
