"""The demo's policy: a tiny causal LM built from a local config, its warm-up, and the harness's
own measurement of what a policy writes.

A randomly initialised LM almost never samples EOS, so all its completions run to the length
limit and a reward for "detailed" has nowhere to push. The warm-up is a brief supervised pass on
the demo's answers cut after k sentences, k drawn uniformly from 1..`max_sentences`: the policy
learns to stop after a sentence with a probability that gives a mid-range length distribution,
and the RL runs can move that probability either way.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from crm.rl.config import PolicyConfig

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def build_policy(tokenizer, config: PolicyConfig, seed: int):
    """A randomly initialised Qwen3ForCausalLM over `tokenizer`'s vocabulary (nothing downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    qwen = Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=None, attn_implementation="sdpa", **vars(config))
    model = Qwen3ForCausalLM(qwen)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_policy(path):
    """A causal LM from a local directory (nothing downloaded), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def first_sentences(text: str, k: int) -> str:
    return " ".join(SENTENCE_END.split(text.strip())[:k])


def warm_up(model, tokenizer, pairs: list[tuple[str, str]], *, steps: int, batch_size: int,
            lr: float, max_sentences: int, seed: int) -> list[float]:
    """Supervised steps on (query, answer cut after k ~ U{1..max_sentences} sentences); the loss
    is on the answer and its EOS only. Returns the loss per step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        batch = [rng.choice(pairs) for _ in range(batch_size)]
        rows, labels = [], []
        for query, answer in batch:
            prompt = prompt_ids(tokenizer, query)
            target = tokenizer(first_sentences(answer, rng.randint(1, max_sentences)),
                               add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def prompt_ids(tokenizer, query: str) -> list[int]:
    """The query as the policy reads it: the chat template with the assistant's turn opened (as
    TRL renders a conversational prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": query}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@dataclass(frozen=True)
class Samples:
    """What a policy wrote for the measurement prompts: texts and token counts (EOS excluded)."""

    queries: list[str]
    texts: list[str]
    lengths: list[int]
    clipped: list[bool]  # no EOS within the limit: cut by the length limit

    def summary(self, max_tokens: int) -> dict:
        n = len(self.lengths)
        mean = sum(self.lengths) / n
        return {"n": n, "mean_tokens": round(mean, 2),
                "mean_share_of_max": round(mean / max_tokens, 4),
                "clipped_share": round(sum(self.clipped) / n, 4),
                "min_tokens": min(self.lengths), "max_tokens": max(self.lengths)}


@torch.inference_mode()
def sample(model, tokenizer, queries: list[str], *, per_query: int, max_tokens: int,
           temperature: float, seed: int) -> Samples:
    """`per_query` completions of each query, sampled with a fixed seed: the harness's evidence,
    independent of the trainer's logs and of the CRM."""
    model.eval()
    torch.manual_seed(seed)
    out_queries, texts, lengths, clipped = [], [], [], []
    eos = tokenizer.eos_token_id
    for query in queries:
        prompt = torch.tensor([prompt_ids(tokenizer, query)] * per_query, device=model.device)
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                   temperature=temperature, top_k=0, top_p=1.0,
                                   max_new_tokens=max_tokens, eos_token_id=eos,
                                   pad_token_id=tokenizer.pad_token_id)[:, prompt.shape[1]:]
        for row in generated.tolist():
            n = row.index(eos) if eos in row else len(row)
            out_queries.append(query)
            texts.append(tokenizer.decode(row[:n], skip_special_tokens=True))
            lengths.append(n)
            clipped.append(eos not in row)
    return Samples(out_queries, texts, lengths, clipped)
