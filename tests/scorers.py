"""Tiny CRMScorers for the scoring, evaluation and leaderboard tests (random init, CPU, float32)."""
from __future__ import annotations

import torch
from helpers import run_as_job, tiny_tokenizer

from crm.core.prompts import PromptTemplate
from crm.inference.scorer import CRMScorer
from crm.models.factory import LossConfig, ModelConfig, build_crm

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, max_position_embeddings=1024)


def tiny_scorer(kind: str = "pairwise", num_labels: int = 2, seed: int = 0, max_tokens: int = 1000,
                tokenizer=None, **kwargs) -> CRMScorer:
    tok = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    crm = build_crm(ModelConfig(arch=TINY, attention="sdpa"), LossConfig(kind),
                    num_labels=num_labels, pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    return CRMScorer(crm.model, tok, PromptTemplate(), kind, max_tokens, device=torch.device("cpu"),
                     **kwargs)


def export_tiny(out_dir, kind: str = "pairwise", num_labels: int = 2, seed: int = 0):
    """A tiny random CRM written as an export directory (what crm-eval and crm-leaderboard load)."""
    from crm.models.export import export_crm

    scorer = tiny_scorer(kind, num_labels=num_labels, seed=seed)
    export_crm(scorer.model, scorer.tokenizer, out_dir, kind=kind, template=scorer.template,
               max_tokens=1000)
    return out_dir


def run_cli(config_name: str, function, overrides: list[str], run_dir):
    """`function(cfg)` as the Hydra entry point runs it, in `run_dir`."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose(config_name, overrides=[*overrides, f"hydra.run.dir={run_dir}"],
                      return_hydra_config=True)
    return run_as_job(cfg, function)
