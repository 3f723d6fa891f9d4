"""crm.data.packing: a packed row's tokens, positions and attention layout, by hand."""
from __future__ import annotations

import pytest
import torch

from crm.data.config import StreamConfig, StreamSettings
from crm.data.packing import Budget, pack, split_shared, unpack


def test_two_records_restart_their_positions_and_keep_to_themselves():
    batch = pack([([5, 6, 7],), ([8, 9],)])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["seq_starts"].tolist() == [0, 3, 5] and batch["max_length"] == 3
    assert batch["read"].tolist() == [2, 4]  # each record's last token
    assert batch["views"].tolist() == [[0, 1, 2], [3, 4, 4]]  # the shorter view filled at its end
    assert batch["owner"].tolist() == [0, 1, 2, 3, 4]
    assert (batch["real_tokens"], batch["padded_tokens"], batch["attended_tokens"]) == (5, 6, 5)


def test_branches_attend_to_the_shared_prefix_at_the_positions_they_have_alone():
    chosen, rejected = [1, 2, 3, 4, 5], [1, 2, 9]
    batch = pack([split_shared(chosen, rejected), split_shared([7, 8], [7, 6, 5])])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 7, 8, 6, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 0, 1, 1, 2]]
    assert batch["branch_ids"].tolist() == [0, 0, 1, 1, 1, 2, 0, 1, 2, 2]
    assert batch["read"].tolist() == [4, 7, 5, 9]  # the chosen rewards, then the rejected
    assert unpack(batch) == [chosen, [7, 8], rejected, [7, 6, 5]]
    # the second branch's view reads the prefix; its own token's output is taken from there
    views = batch["views"]
    assert views[1].tolist() == [0, 1, 5, 5, 5] and batch["owner"][5] == 1 * 5 + 2
    assert batch["real_tokens"] == 10 and batch["attended_tokens"] == 5 + 3 + 2 + 3


def test_the_shared_prefix_leaves_each_branch_its_last_token():
    assert split_shared([1, 2, 3], [1, 2, 3]) == ([1, 2], [3], [3])
    assert split_shared([4], [4, 5]) == ([], [4], [4, 5])
    assert split_shared([1, 2], [3, 4]) == ([], [1, 2], [3, 4])


def test_an_empty_batch_and_mistakes():
    empty = pack([])
    assert empty["input_ids"].shape == (1, 0) and empty["read"].numel() == 0
    with pytest.raises(ValueError, match="different branch counts"):
        pack([([1, 2],), split_shared([1, 2], [1, 3])])
    with pytest.raises(ValueError, match="segment 0: an empty sequence"):
        pack([([1], [], [2])])
    assert torch.equal(pack([([3, 4],)])["views"], torch.tensor([[0, 1]]))


def test_a_token_budget_fills_the_row_with_pieces_of_their_own():
    budget = Budget(8, records=3, longest=3, fill=0)
    batch = pack([([5, 6, 7],), ([8, 9],)], budget=budget)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]  # the filling restarts at 0
    assert batch["segment_ids"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]  # a segment of its own
    # 3 records + 8 / 3 filling pieces at most + the end: the same count for every row of the budget
    assert batch["seq_starts"].tolist() == [0, 3, 5, 8, 8, 8, 8] and batch["max_length"] == 3
    assert batch["read"].tolist() == [2, 4]  # no head reads the filling
    assert (batch["real_tokens"], batch["padded_tokens"], batch["attended_tokens"]) == (5, 6, 5)
    assert batch["views"].tolist() == [[0, 1, 2], [3, 4, 4], [5, 6, 7]]
    assert batch["owner"].tolist() == list(range(5)) + [6, 7, 8]
    # a longer row: the next multiple of the budget, the filling cut at `longest`
    longer = pack([([1] * 3,), ([2] * 3,), ([3] * 3,)], budget=budget)
    assert longer["input_ids"].shape == (1, 16)
    assert longer["seq_starts"].tolist() == [0, 3, 6, 9, 12, 15, 16, 16, 16, 16]


def test_a_token_budget_gives_every_micro_batch_the_same_shapes():
    g = torch.Generator().manual_seed(0)
    budget = Budget(4 * 40, records=4, longest=40)
    shapes = set()
    for lengths in ([3, 40, 17, 9], [40, 40, 40, 40], [1], [], [12, 5, 30]):
        rows = [torch.randint(1, 99, (n,), generator=g).tolist() for n in lengths]
        for packed in (pack([(r,) for r in rows], budget=budget),
                       pack([split_shared(r[:-1] + [7], r[:-1] + [8]) for r in rows if len(r) > 1],
                            budget=Budget(4 * 80, records=4, longest=40))):
            shapes.add(tuple((k, tuple(packed[k].shape)) for k in
                             ("input_ids", "position_ids", "segment_ids", "branch_ids", "seq_starts"))
                       + (("max_length", packed["max_length"]),))
    assert len(shapes) == 2  # one per budget: pairwise rows and pointwise pairs


def test_a_token_budget_is_a_positive_number_of_tokens_or_none():
    assert StreamSettings(token_budget=None).token_budget is None
    assert StreamConfig(batch_size=2, packing=True, token_budget=4096).token_budget == 4096
    for wrong in (0, -8, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="stream.token_budget"):
            StreamSettings(token_budget=wrong)
