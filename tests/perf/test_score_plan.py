"""crm-plan task=score (crm/perf/scoring.py): a scoring job's forwards, tokens, FLOPs, GPU-hours and
GPUs for a target time, checked by hand, and through the command."""
from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_module
from transformers import Qwen3Config

from test_plan import run_plan  # crm-plan in-process, as Hydra runs it

from crm.cli.schema import settings
from crm.core.errors import ConfigError
from crm.perf.flops import ModelShape, flops_per_token
from crm.perf.scoring import ScoreSettings, score_plan

SMALL = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True)


def test_the_arithmetic_by_hand():
    shape = ModelShape.from_config(Qwen3Config(**SMALL, num_labels=2, pad_token_id=0))
    score = ScoreSettings(rows=1000, tokens_per_row=100, prefix_share=0.5, rows_per_prefix=10,
                          both_orders=True, gpus=4, target_seconds=2.0)
    p = score_plan(shape, score, peak=1e9, mfu=0.5)
    # 2,000 forwards in 200 groups: each row computes its 50 own tokens, each group its 50 shared once
    assert p["forwards"] == 2000 and p["prompt_tokens"] == 200_000
    assert p["computed_tokens"] == 2000 * 50 + 200 * 50
    per_token = flops_per_token(shape, 100, training=False)
    assert p["flops"] == pytest.approx(110_000 * per_token)
    gpu_seconds = 110_000 * per_token / (1e9 * 0.5)
    assert p["gpu_hours"] == pytest.approx(gpu_seconds / 3600)
    assert p["seconds"] == pytest.approx(gpu_seconds / 4)
    assert p["gpus_for_target"] == math.ceil(gpu_seconds / 2.0)


def test_crm_plan_task_score_prices_the_usl_at_scale(tmp_path, capsys):
    """200 models x 500 queries = 100,000 battles of 3,200 tokens with a 4B CRM on H100s at MFU 0.3:
    2N FLOPs per token alone give 2.2 H100-hours; attention at 3,200 tokens adds a quarter (2.7),
    and about 165 H100s answer within a minute."""
    _, plan = run_plan(tmp_path, "task=score", "model=qwen3-4b", "mfu=0.3", "score.rows=100000",
                    "score.tokens_per_row=3200")
    assert plan["forwards"] == 100_000 and plan["computed_tokens"] == 320_000_000
    assert 2.6 < plan["gpu_hours"] < 2.9 and 155 < plan["gpus_for_target"] < 175
    out = capsys.readouterr().out
    assert "crm-plan task=score: qwen3-4b, 100,000 rows" in out and "GPU-hours" in out


def test_a_bad_score_setting_is_one_line():
    import crm.cli.plan  # noqa: F401  (registers the schema)

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        with pytest.raises(ConfigError, match="score.prefix_share=1.5: expected 0 <= share < 1"):
            settings(compose("plan", overrides=["task=score", "score.prefix_share=1.5"]))
        with pytest.raises(ConfigError, match="task=serve: expected one of train, score"):
            settings(compose("plan", overrides=["task=serve"]))
