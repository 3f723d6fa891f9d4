"""Reading a sharded checkpoint dir in one process (crm.models.checkpoint.load_checkpoint) through
torch's public distributed-checkpoint loading: the full weights, in their dtypes, and nothing else
of the shards. tests/training/test_distributed.py reads real FSDP checkpoints of 2 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from crm.models.checkpoint import SHARDED_META, is_complete_checkpoint, load_checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_sharded_dir_reads_as_the_state_dict_it_holds(tmp_path):
    weights = {"crm.model.score.weight": torch.randn(2, 8),
               "crm.model.model.norm.weight": torch.randn(8).to(torch.bfloat16)}
    # What Lightning's ModelParallelStrategy writes: the tensors through DCP, the rest in meta.pt.
    dcp.save({"state_dict": weights, "optimizer_states": {"0": {"exp_avg": torch.ones(3)}}},
             checkpoint_id=tmp_path, no_dist=True)
    torch.save({"global_step": 7, "epoch": 0}, tmp_path / SHARDED_META)
    assert is_complete_checkpoint(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint["global_step"] == 7 and set(checkpoint) == {"global_step", "epoch", "state_dict"}
    assert checkpoint["state_dict"].keys() == weights.keys()
    for name, tensor in weights.items():
        assert checkpoint["state_dict"][name].dtype == tensor.dtype
        torch.testing.assert_close(checkpoint["state_dict"][name], tensor, rtol=0, atol=0)
