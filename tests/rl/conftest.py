from __future__ import annotations

import pytest
from scorers import tiny_scorer

from crm.inference.reward import CRMReward
from crm.rl.openrlhf import make_server


@pytest.fixture
def openrlhf_server():
    """The OpenRLHF reward server on 127.0.0.1, a free port, serving a pairwise tiny CRM's
    `reference` rewards: (the reward, the server's URL)."""
    reward = CRMReward(tiny_scorer(), "reference")
    server = make_server(reward, "127.0.0.1", 0, batch_wait=0.05).start()
    yield reward, server.url
    server.close()
