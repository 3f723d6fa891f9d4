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


SHORT = "I prefer short, to-the-point answers."
DETAILED = "I prefer detailed answers that cover everything."


def train_length_crm(out_dir, data_dir, steps: int = 30, batch_size: int = 16, seed: int = 0):
    """A tiny pointwise CRM trained in seconds on one rule, exported: under SHORT the answer with
    fewer sentences wins, under DETAILED the one with more (demo answers cut after 1-5 sentences).

    Returns (export dir, the demo training file whose answers it learned from). What crm-rl's
    tests train policies against: a real CRM with a known preference, quick to make (the demo's
    CRM needs minutes; a pairwise head needs hundreds of steps to start reading criteria).
    """
    import json
    import random
    from pathlib import Path

    from crm.core.records import Message
    from crm.data.demo import write_demo
    from crm.data.padding import pad_rows
    from crm.models.export import export_crm
    from crm.models.tokenizer import train_bpe_tokenizer
    from crm.rl.policy import first_sentences

    write_demo(data_dir, seed=seed, n_train=100, n_test=2, n_bench=1)
    data = Path(data_dir) / "train.jsonl"
    records = [json.loads(line) for line in data.read_text().splitlines()]
    pairs = [(r["model_a"][0]["content"], r[side][1]["content"]) for r in records
             for side in ("model_a", "model_b")]
    tok = train_bpe_tokenizer([PromptTemplate().pointwise, SHORT, DETAILED]
                              + [text for pair in pairs for text in pair], vocab_size=512)
    torch.manual_seed(seed)
    crm = build_crm(ModelConfig(arch={**TINY, "max_position_embeddings": 512}, attention="sdpa"),
                    LossConfig("pointwise"), num_labels=1, pad_token_id=tok.pad_token_id,
                    vocab_size=len(tok))
    scorer = CRMScorer(crm.model, tok, PromptTemplate(), "pointwise", 384, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(crm.parameters(), lr=3e-3)
    rng = random.Random(seed)
    crm.train()
    for _ in range(steps):
        chosen, rejected = [], []
        for _ in range(batch_size):
            query, answer = rng.choice(pairs)
            fewer, more = sorted(rng.sample(range(1, 6), 2))
            criteria = rng.choice([SHORT, DETAILED])
            win, lose = (fewer, more) if criteria == SHORT else (more, fewer)
            chosen.append(((criteria,), query, (Message("assistant", first_sentences(answer, win)),)))
            rejected.append(((criteria,), query, (Message("assistant", first_sentences(answer, lose)),)))
        batch = pad_rows(scorer.encoder.pointwise_many(chosen + rejected), tok.pad_token_id)
        loss = crm.loss(batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    crm.eval()
    export_crm(crm.model, tok, out_dir, kind="pointwise", template=PromptTemplate(), max_tokens=384)
    return Path(out_dir), data
