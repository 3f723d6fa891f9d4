"""Token-id segments -> one packed row without padding (the training stream's `stream.packing`).

A segment is what one record contributes: `(ids,)`, a single sequence whose last token the head
reads (a pairwise record), or `(shared, branch_1, branch_2, ...)`, a prefix followed by branches
that each attend to the prefix and to themselves, never to each other, and whose last tokens the
head reads (a pointwise pair: criteria + query once, then the chosen and the rejected response).
Every token keeps the position it would have in its own sequence (`shared + branch`), so under
RoPE each branch computes exactly what the sequence alone computes (docs/PERFORMANCE.md section 5).

`pack` lays the segments end to end in one row of real tokens and describes the attention each
token may do, once, in the forms the kernels of crm.models.packing read:
- `segment_ids`, `branch_ids` (one per token; branch 0 is a segment's shared part): the mask's
  definition, for FlexAttention's block mask;
- `seq_starts`, `max_length`: the cumulative segment starts of a block-diagonal row (no branches),
  for a variable-length (varlen) kernel;
- `views`, `owner`: each branch's own sequence as a row of token indices (shared + branch, at most
  `max_length` wide), and where each token's output is in them, for plain causal attention over
  gathered rows (the CPU path).
"""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import torch


def split_shared(chosen: list[int], rejected: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(shared prefix, chosen's rest, rejected's rest) of two token rows.

    The shared prefix is their longest common prefix of token ids, so each rest continues exactly
    the tokens its own row has there, whatever the template or the length policy did. It stops one
    token short of the shorter row: each branch keeps the token the head reads.
    """
    # Bisected over slices, which compare in C: the training process's main thread runs this for
    # every pointwise record, and a token-by-token loop cost more than the rest of the layout.
    shared, limit = 0, max(min(len(chosen), len(rejected)) - 1, 0)  # chosen[:shared] == rejected[:shared]
    while shared < limit:
        middle = (shared + limit + 1) // 2
        if chosen[shared:middle] == rejected[shared:middle]:
            shared = middle
        else:
            limit = middle - 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def branches(segment: tuple[list[int], ...]) -> tuple[list[int], ...]:
    """The sequences of a segment whose last token the head reads: the whole of a single sequence,
    else each branch (after the shared prefix)."""
    return segment if len(segment) == 1 else segment[1:]


class Budget(NamedTuple):
    """A fixed token budget for packed rows (crm-train's `stream.token_budget`): every row padded
    to the same shapes, so that a compiled step sees one shape and CUDA graphs can replay it.

    The row is filled to `tokens` (to the next multiple of it when its records hold more) with
    filling pieces of at most `longest` tokens of `fill`, each a segment of its own that attends
    only to itself and that no head reads; `seq_starts` always lists `records` (the micro batch's
    records, the most a row holds) plus the most filling pieces a budget takes; `max_length`, the
    varlen kernel's longest segment, is `longest` (the length policy's limit, at least every
    record's row)."""

    tokens: int
    records: int
    longest: int
    fill: int = 0

    def fillers(self, real: int) -> tuple[int, list[int]]:
        """(the row's length, the filling pieces' lengths) for `real` tokens of records."""
        total = self.tokens * max(-(-real // self.tokens), 1)
        pad, pieces = total - real, []
        while pad:
            pieces.append(min(pad, self.longest))
            pad -= pieces[-1]
        return total, pieces

    def starts(self, total: int) -> int:
        """How many segment starts a row of `total` tokens lists: the same for every row of one
        budget (the records, the filling pieces a row of that length can take, and its end)."""
        return self.records + -(-total // self.longest) + 1


def pack(segments: list[tuple[list[int], ...]], views: bool = True,
         budget: Budget | None = None) -> dict:
    """The packed row of `segments` and its attention layout (see the module's docstring).

    `read` lists the tokens the head reads: every segment's first branch in order, then every
    segment's second branch, and so on (a pointwise batch: the chosen rewards, then the rejected,
    as the padded path orders its rows). All segments have the same number of branches.
    `real_tokens` is the row's length; `padded_tokens` what the right-padded rows of the same
    sequences hold (rows x longest row), the tokens the padded path computes; `attended_tokens`
    those rows' real tokens. `views=False` leaves out `views` and `owner`, which only the CPU's
    gather kernel reads (they are the costliest part of the layout). `budget`: the row padded to
    fixed shapes (`Budget`); `real_tokens`, `padded_tokens`, `attended_tokens` and `read` count
    the records only.

    Runs on the training process's main thread once per micro batch: Python works per piece (a
    shared prefix or a branch), torch per token.
    """
    counts = {len(branches(s)) for s in segments}
    if len(counts) > 1:
        raise ValueError(f"segments with different branch counts {sorted(counts)} in one batch")
    n_branches = counts.pop() if counts else 0
    # One piece per shared prefix or branch, in row order: its start in the row, its length, the
    # position of its first token, its segment and branch ids, and the view that computes it
    # with the place of its first token there.
    pieces: list[tuple[int, int, int, int, int, int, int]] = []
    view_spans: list[tuple[int, int, int, int]] = []  # per view: shared start, shared, branch start, branch
    reads: list[list[int]] = [[] for _ in range(n_branches)]
    starts = [0]
    flat: list[list[int]] = []
    end = 0
    for number, segment in enumerate(segments):
        shared = segment[0] if len(segment) > 1 else []
        shared_start = end
        if shared:  # its outputs come from the segment's first view
            pieces.append((end, len(shared), 0, number, 0, len(view_spans), 0))
            flat.append(shared)
            end += len(shared)
        for b, branch in enumerate(branches(segment)):
            if not branch:
                raise ValueError(f"segment {number}: an empty sequence has no token for the head")
            pieces.append((end, len(branch), len(shared), number, b + 1 if len(segment) > 1 else 0,
                           len(view_spans), len(shared)))
            view_spans.append((shared_start, len(shared), end, len(branch)))
            flat.append(branch)
            end += len(branch)
            reads[b].append(end - 1)
        starts.append(end)
    real, real_views = end, len(view_spans)
    width = max((s + b for _, s, _, b in view_spans), default=1)
    real_width = width
    if budget is not None:
        total, fillers = budget.fillers(real)
        for number, length in enumerate(fillers, start=len(segments)):
            # a segment of its own, positions from 0, its own view; no read
            pieces.append((end, length, 0, number, 0, len(view_spans), 0))
            view_spans.append((end, 0, end, length))
            flat.append([budget.fill] * length)
            end += length
            starts.append(end)
        starts += [end] * (budget.starts(total) - len(starts))  # empty segments: a fixed count
        width = max(s + b for _, s, _, b in view_spans)
    table = torch.tensor(pieces, dtype=torch.long).reshape(-1, 7)
    begin, length, first_position, segment_of, branch_of, view_of, place_of = table.unbind(1)
    tokens = torch.arange(end, dtype=torch.long)
    offset = torch.repeat_interleave(begin, length)  # per token, its piece's start
    batch = {
        "input_ids": torch.tensor(list(chain.from_iterable(flat)), dtype=torch.long).reshape(1, end),
        "position_ids": (tokens - offset + torch.repeat_interleave(first_position, length)).reshape(1, end),
        "segment_ids": torch.repeat_interleave(segment_of, length).to(torch.int32),
        "branch_ids": torch.repeat_interleave(branch_of, length).to(torch.int32),
        "seq_starts": torch.tensor(starts, dtype=torch.int32),
        "max_length": width if budget is None else max(budget.longest, width),
        "read": torch.tensor([t for r in reads for t in r], dtype=torch.long),
        "real_tokens": real,
        # the views are the rows the padded path computes, padded alike
        "padded_tokens": real_views * real_width,
        # the S of attention
        "attended_tokens": sum(s + b for _, s, _, b in view_spans[:real_views]),
    }
    if views:
        batch["views"] = gather_views(view_spans, width)
        # per token, its output's index in views x width: its view's row, its place there
        batch["owner"] = torch.repeat_interleave(view_of * width + place_of, length) + tokens - offset
    return batch


def gather_views(view_spans: list[tuple[int, int, int, int]], width: int) -> torch.Tensor:
    """[views, width] token indices: each view's shared prefix, then its branch, from
    (shared start, shared length, branch start, branch length) per view."""
    if not view_spans:
        return torch.zeros(1, 1, dtype=torch.long)
    spans = torch.tensor(view_spans, dtype=torch.long)
    shared_start, shared, branch_start, branch = (column[:, None] for column in spans.unbind(1))
    place = torch.arange(width, dtype=torch.long)[None, :]
    # A view shorter than the widest is filled with its own last token: under causal attention no
    # real query reaches past its own place, so the filling changes nothing that is kept.
    in_branch = torch.minimum(place - shared, branch - 1)
    return torch.where(place < shared, shared_start + place, branch_start + in_branch)


def unpack(batch: dict) -> list[list[int]]:
    """Each read's own sequence (shared prefix + branch) from a packed batch, in read order: the
    token ids of the right-padded path's rows (checks and debugging, not the training path)."""
    ids = batch["input_ids"][0].tolist()
    segment, branch = batch["segment_ids"].tolist(), batch["branch_ids"].tolist()
    return [[ids[t] for t in range(read + 1)
             if segment[t] == segment[read] and branch[t] in (0, branch[read])]
            for read in batch["read"].tolist()]
