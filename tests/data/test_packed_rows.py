"""crm.data.packing: a packed row's tokens, positions and attention layout, by hand."""
from __future__ import annotations

import pytest
import torch

from crm.data.packing import pack, split_shared, unpack


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
