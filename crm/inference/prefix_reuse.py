"""The prefix-KV engine of CRMScorer: rows that start with the same prefix run it once.

A row comes with the text of the prefix it may share (crm.inference.scorer decides where prompts split). The
engine runs each shared prefix once, keeps its keys and values, and runs only each row's suffix
against them:

- Same tokens, same score: the prefix text is tokenized alone, and a row is only scored from the
  prefix when its own ids (the whole prompt, as the plain path tokenizes it) start with exactly
  those ids; its suffix is the rest of its own ids, so the model reads the plain path's tokens.
  Rows that do not (split_mismatch) and groups that would save less than PREFIX_MIN_SAVING of
  their tokens (prefix_declined) are left to the plain path.
- Batches: the prefixes of up to `batch_size` groups run as one right-padded batch; then each
  group's rows run in batches of `batch_size`, each row over its own group's cached keys/values,
  with the prefix's padding masked and position ids continuing from the prefix's real length.
  The head reads each row's last real token, as on the plain path. Scores equal the plain path's to
  float rounding (tests: 1e-4 in float32; bf16 on a GPU rounds differently, as any batch change does).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import torch
from transformers import DynamicCache

from crm.data.padding import pad_rows
from crm.models.heads import head_at

# The prefix path costs a copy of the cached keys/values per row, attention with an explicit mask
# and padding in two places: a group takes it only when it saves at least this share of its tokens
# (a pointwise test pair, criteria + query shared by two responses, saves too few to pay for them,
# its two-row groups padding worse than length-sorted batches; a leaderboard query with 8
# candidates saves enough: docs/PERFORMANCE.md section 6 has the figures).
PREFIX_MIN_SAVING = 1 / 3


def prefix_logits(model, tokenizer, rows: list[list[int]], prefix_texts: list[str | None], *,
                  batch_size: int, device: torch.device, counts: Counter, bar) -> dict[int, torch.Tensor]:
    """{row index: logits} for the rows scored from a shared prefix; the caller scores the others.

    `prefix_texts[i]` is the text row i may share (None: none). `counts` receives split_mismatch,
    prefix_declined, prefix_sequences, computed_tokens and padded_tokens; `bar` is updated per row.
    """
    groups = _groups(tokenizer, rows, prefix_texts, counts)
    prefixes = sorted(groups, key=len)  # similar lengths together: less padding in the cache
    out = {}
    for start in range(0, len(prefixes), batch_size):
        chunk = prefixes[start:start + batch_size]
        members = [groups[p] for p in chunk]
        suffixes = [[rows[i][len(p):] for i in m] for p, m in zip(chunk, members)]
        logits = _run(model, tokenizer.pad_token_id, [list(p) for p in chunk], suffixes,
                      batch_size=batch_size, device=device, counts=counts, bar=bar)
        for m, group_logits in zip(members, logits):
            out.update(zip(m, group_logits))
    return out


def _groups(tokenizer, rows: list[list[int]], prefix_texts: list[str | None],
            counts: Counter) -> dict[tuple, list[int]]:
    """{prefix ids: row indices} for rows whose ids start with their prefix's ids."""
    split = [i for i, text in enumerate(prefix_texts) if text is not None]
    if not split:
        return {}
    texts = list(dict.fromkeys(prefix_texts[i] for i in split))
    prefix_ids = dict(zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in split:
        prefix, ids = prefix_ids[prefix_texts[i]], rows[i]
        if len(prefix) < len(ids) and ids[:len(prefix)] == prefix:
            groups[tuple(prefix)].append(i)
        else:
            counts["split_mismatch"] += 1
    kept = {}
    for prefix, members in groups.items():
        saved = (len(members) - 1) * len(prefix)
        if saved >= PREFIX_MIN_SAVING * sum(len(rows[i]) for i in members):
            kept[prefix] = members
        else:
            counts["prefix_declined"] += len(members)
    return kept


@torch.inference_mode()
def _run(model, pad: int, prefixes: list[list[int]], suffixes: list[list[list[int]]], *,
         batch_size: int, device: torch.device, counts: Counter, bar) -> list[torch.Tensor]:
    """Per prefix, the logits of its suffixes (each continues that prefix)."""
    backbone = model.model
    batch = pad_rows(prefixes, pad)
    prefix_mask = batch["attention_mask"].to(device)
    cache = backbone(input_ids=batch["input_ids"].to(device), attention_mask=prefix_mask,
                     use_cache=True).past_key_values
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    counts["computed_tokens"] += int(prefix_mask.sum())
    counts["padded_tokens"] += prefix_mask.numel()
    lengths = prefix_mask.sum(dim=1)

    rows = [(g, s) for g, group in enumerate(suffixes) for s in group]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
    flat = torch.empty(len(rows), max(model.config.num_labels, 1))
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        group = torch.tensor([rows[i][0] for i in index], device=device)
        part = pad_rows([rows[i][1] for i in index], pad)
        suffix_mask = part["attention_mask"].to(device)
        width = suffix_mask.shape[1]
        rows_cache = DynamicCache([(k[group], v[group]) for k, v in kv], config=model.config)
        hidden = backbone(
            input_ids=part["input_ids"].to(device),
            attention_mask=torch.cat([prefix_mask[group], suffix_mask], dim=1),
            position_ids=lengths[group, None] + torch.arange(width, device=device),
            past_key_values=rows_cache, use_cache=True).last_hidden_state
        flat[index] = head_at(model, hidden, suffix_mask.sum(dim=1) - 1).float().cpu()
        counts["computed_tokens"] += int(suffix_mask.sum())
        counts["padded_tokens"] += suffix_mask.numel()
        counts["prefix_sequences"] += len(index)
        bar.update(len(index))
    out, i = [], 0
    for group in suffixes:
        out.append(flat[i:i + len(group)])
        i += len(group)
    return out
