"""Fixtures shared by the test modules."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead (and stall when another process holds the
    cores: 2 threads measured 12x slower than 1 on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """torch.compile's in-process caches emptied, so that a test sees the graphs it builds and many
    tests' graphs never add up to dynamo's recompile limit; inductor's on-disk cache keeps the
    rebuild quick."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """A paths.root_dir whose cache holds the (small) demo data, generated once per session."""
    from hydra import compose, initialize_config_module

    import crm.cli.train  # noqa: F401  (registers train.yaml's schema)
    from crm.data.demo import DemoConfig, prepare_demo

    root = tmp_path_factory.mktemp("crm_root")
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=[*TINY_DEMO, f"paths.root_dir={root}"])
    shard_dir = prepare_demo(DemoConfig(**cfg.data.demo))
    assert (shard_dir / "manifest.json").is_file()
    return root


@pytest.fixture(scope="session")
def length_crm(tmp_path_factory):
    """(export dir, demo training file): a tiny pointwise CRM that prefers fewer sentences under
    "short" criteria and more under "detailed" ones, trained once per session (tests/scorers.py)."""
    from scorers import train_length_crm

    root = tmp_path_factory.mktemp("length_crm")
    torch.set_num_threads(1)
    return train_length_crm(root / "export", root / "data")
