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

import torch


def split_shared(chosen: list[int], rejected: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(shared prefix, chosen's rest, rejected's rest) of two token rows.

    The shared prefix is their longest common prefix of token ids, so each rest continues exactly
    the tokens its own row has there, whatever the template or the length policy did. It stops one
    token short of the shorter row: each branch keeps the token the head reads.
    """
    limit = min(len(chosen), len(rejected)) - 1
    shared = 0
    while shared < limit and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def branches(segment: tuple[list[int], ...]) -> tuple[list[int], ...]:
    """The sequences of a segment whose last token the head reads: the whole of a single sequence,
    else each branch (after the shared prefix)."""
    return segment if len(segment) == 1 else segment[1:]


def pack(segments: list[tuple[list[int], ...]]) -> dict:
    """The packed row of `segments` and its attention layout (see the module's docstring).

    `read` lists the tokens the head reads: every segment's first branch in order, then every
    segment's second branch, and so on (a pointwise batch: the chosen rewards, then the rejected,
    as the padded path orders its rows). All segments have the same number of branches.
    `real_tokens` is the row's length; `padded_tokens` what the right-padded rows of the same
    sequences hold (rows x longest row), the tokens the padded path computes; `attended_tokens`
    those rows' real tokens.
    """
    counts = {len(branches(s)) for s in segments}
    if len(counts) > 1:
        raise ValueError(f"segments with different branch counts {sorted(counts)} in one batch")
    ids: list[int] = []
    positions: list[int] = []
    segment_ids: list[int] = []
    branch_ids: list[int] = []
    view_rows: list[list[int]] = []
    owner: list[tuple[int, int]] = []  # per token, in row order: (its view, its place there)
    reads: list[list[int]] = [[] for _ in range(counts.pop() if counts else 0)]
    starts = [0]
    for number, segment in enumerate(segments):
        shared = segment[0] if len(segment) > 1 else []
        shared_tokens = list(range(len(ids), len(ids) + len(shared)))
        ids += shared
        positions += range(len(shared))
        segment_ids += [number] * len(shared)
        branch_ids += [0] * len(shared)
        for b, branch in enumerate(branches(segment)):
            if not branch:
                raise ValueError(f"segment {number}: an empty sequence has no token for the head")
            view = len(view_rows)
            if b == 0:  # the first branch's view computes the shared tokens' outputs
                owner += [(view, place) for place in range(len(shared))]
            owner += [(view, len(shared) + i) for i in range(len(branch))]
            view_rows.append(shared_tokens + list(range(len(ids), len(ids) + len(branch))))
            ids += branch
            positions += range(len(shared), len(shared) + len(branch))
            segment_ids += [number] * len(branch)
            branch_ids += [b + 1 if len(segment) > 1 else 0] * len(branch)
            reads[b].append(len(ids) - 1)
        starts.append(len(ids))
    width = max((len(v) for v in view_rows), default=1)
    # A view shorter than the widest is filled with its own last token: under causal attention no
    # real query reaches past its own place, so the filling changes nothing that is kept.
    views = [v + [v[-1]] * (width - len(v)) for v in view_rows] or [[0]]
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long).reshape(1, len(ids)),
        "position_ids": torch.tensor(positions, dtype=torch.long).reshape(1, len(ids)),
        "segment_ids": torch.tensor(segment_ids, dtype=torch.int32),
        "branch_ids": torch.tensor(branch_ids, dtype=torch.int32),
        "seq_starts": torch.tensor(starts, dtype=torch.int32),
        "max_length": width,
        "views": torch.tensor(views, dtype=torch.long),
        "owner": torch.tensor([view * width + place for view, place in owner], dtype=torch.long),
        "read": torch.tensor([t for r in reads for t in r], dtype=torch.long),
        "real_tokens": len(ids),
        # the views are the rows the padded path computes, padded alike
        "padded_tokens": len(view_rows) * width,
        "attended_tokens": sum(map(len, view_rows)),  # the views' real tokens: the S of attention
    }


def unpack(batch: dict) -> list[list[int]]:
    """Each read's own sequence (shared prefix + branch) from a packed batch, in read order: the
    token ids of the right-padded path's rows (checks and debugging, not the training path)."""
    ids = batch["input_ids"][0].tolist()
    segment, branch = batch["segment_ids"].tolist(), batch["branch_ids"].tolist()
    return [[ids[t] for t in range(read + 1)
             if segment[t] == segment[read] and branch[t] in (0, branch[read])]
            for read in batch["read"].tolist()]
