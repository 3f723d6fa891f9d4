"""One GRPO run with TRL: a policy, prompts with their criteria, and reward functions.

TRL's GRPOTrainer (1.16) samples `num_generations` completions per prompt, calls every reward
function with the dataset's other columns per completion (here `criteria`), normalises the
rewards within each prompt's group and steps the policy. The guards it offers and crm-rl exposes:
`beta` (a KL penalty to the initial policy) and the soft overlong punishment of DAPO
(`trl.rewards.get_soft_overlong_punishment`, added as a second reward function).
"""
from __future__ import annotations

from pathlib import Path

import torch

from crm.rl.config import GRPOSettings


def train_grpo(policy, tokenizer, queries: list[str], criteria: list[str] | None, reward_funcs: list,
               settings: GRPOSettings, seed: int, output_dir: str | Path,
               references: dict[str, str] | None = None) -> list[dict]:
    """Trains `policy` in place; returns the trainer's log history (for reference, not evidence).

    Prompts are conversational (one user message), so TRL renders them with the policy's chat
    template and hands completions to the rewards as assistant messages. `criteria` and
    `references` (query -> a reference answer) become the dataset's `criteria` and `reference`
    columns, which TRL passes to the rewards per completion.
    """
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    rows = [{"prompt": [{"role": "user", "content": q}]} for q in queries]
    if criteria is not None:
        rows = [{**row, "criteria": list(criteria)} for row in rows]
    if references is not None:
        rows = [{**row, "reference": references[q]} for row, q in zip(rows, queries)]
    funcs = list(reward_funcs)
    if settings.overlong_cache:
        funcs.append(get_soft_overlong_punishment(settings.max_completion_length,
                                                  settings.overlong_cache))
    cuda = torch.cuda.is_available()
    args = grpo_config(
        output_dir=str(output_dir), use_cpu=not cuda, bf16=cuda and torch.cuda.is_bf16_supported(),
        seed=seed, data_seed=seed, max_steps=settings.max_steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        learning_rate=settings.learning_rate, beta=settings.beta,
        scale_rewards=settings.scale_rewards,
        temperature=settings.temperature, top_k=0, top_p=1.0,
        logging_steps=settings.logging_steps, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=policy, reward_funcs=funcs, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    policy.eval()
    return trainer.state.log_history


def grpo_config(**kwargs):
    """TRL's GRPOConfig, without the FutureWarning transformers raises for the `gradient_checkpointing`
    name TRL itself still sets (not ours to rename: every crm-rl run would print it)."""
    import warnings

    from trl import GRPOConfig

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return GRPOConfig(**kwargs)
