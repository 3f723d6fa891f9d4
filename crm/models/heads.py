"""The two CRM heads over a Qwen3 sequence classifier, and their losses.

Both read the head at each row's last attended token, found from the attention mask (not from the
pad id, which breaks when pad == eos), rows right padded; or, for a packed batch
(crm.data.packing: a batch with `read`), at the tokens it names (crm.models.packing). The
wrapped model is a plain `Qwen3ForSequenceClassification`, so an export loads with
`AutoModelForSequenceClassification`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crm.core.examples import LABEL_A, LABEL_TIE
from crm.models.compile import eager
from crm.models.packing import packed_hidden


def check_right_padded(attention_mask: torch.Tensor) -> None:
    lengths = attention_mask.sum(dim=1)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    if not torch.equal(attention_mask.bool(), positions < lengths[:, None]):
        raise ValueError("CRM rows must be right padded (attention mask = a prefix of ones per row)")


def last_token_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    if attention_mask.device.type == "cpu":
        # On an accelerator the check would make the host wait for the device at every forward;
        # crm's batches reach one from crm.data.padding.pad_rows, right padded by construction.
        check_right_padded(attention_mask)
    lengths = attention_mask.sum(dim=1)
    # Right padding under causal attention: no real token can see a pad, so the mask changes
    # nothing the head reads. Without it sdpa takes its fused causal kernel instead of
    # materialising a 4D mask. use_cache=False: a training or scoring forward needs no KV cache.
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return head_at(model, hidden, lengths - 1)


def crm_logits(model: nn.Module, input_ids, attention_mask=None, packed: dict | None = None):
    """The head's output for each row of a right-padded batch, or for each read of `packed` (a
    batch of crm.data.packing.pack, whose row `input_ids` is)."""
    if packed is not None:
        return head(model, packed_hidden(model, packed))
    return last_token_logits(model, input_ids, attention_mask)


def model_inputs(batch: dict) -> dict:
    """A training batch as a CRM's forward takes it. The CRM's own forward must run, not its
    backbone's: under FSDP2 its hooks gather the root's parameters (embeddings, head)."""
    if "read" in batch:
        return {"input_ids": batch["input_ids"], "packed": batch}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def head_at(model: nn.Module, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The head on each row's hidden state at position `last` (its last real token)."""
    return head(model, hidden[torch.arange(hidden.shape[0], device=hidden.device), last])


def head(model: nn.Module, picked: torch.Tensor) -> torch.Tensor:
    """The classification head on the hidden states it reads (rows x hidden), in float32 whatever
    the backbone's dtype.

    A reward rounded to bfloat16 moves in steps of 0.0625 for |r| in [8, 16): P(A) = sigmoid(rA - rB)
    would move in ~1.5% steps, a leaderboard would see ties that are not there, and the loss the
    same rounding. So the head's weight and the picked hidden states are upcast and the product is
    taken with autocast off. The weight is read as the backbone holds it: under FSDP2 that is the
    bfloat16 copy gathered for compute (the master shards stay float32), a fixed rounding of the
    function, the same for every answer, where rounding the output made answers equal. One
    (rows x hidden) x (hidden x labels) product: free next to the backbone.
    """
    score = model.score
    bias = None if score.bias is None else score.bias.float()
    with torch.autocast(picked.device.type, enabled=False):
        return F.linear(picked.float(), score.weight.float(), bias)


class PairwiseCRM(nn.Module):
    """criteria + query + A + B in one sequence -> logits over {A, B} (and tie with 3 labels)."""

    kind = "pairwise"

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def num_labels(self) -> int:
        return self.model.config.num_labels

    def forward(self, input_ids, attention_mask=None, packed: dict | None = None):
        return crm_logits(self.model, input_ids, attention_mask, packed)

    metrics = ("loss", "acc")

    def loss_sums(self, batch: dict) -> dict:
        """L_cls summed over the batch's examples (cross-entropy over the labels), the metrics
        summed alongside, and the example count `n`: the trainer divides by the step's global
        count (docs/DESIGN.md section 9)."""
        labels = batch["labels"]
        if not labels.numel():
            return _empty_batch_sums(self, batch)
        logits = self(**model_inputs(batch)).float()
        return {"loss": F.cross_entropy(logits, labels, reduction="sum"),
                "acc": (logits.argmax(-1) == labels).float().sum(), "n": labels.numel()}

    def loss(self, batch: dict) -> dict:
        """The batch's mean loss and metrics."""
        return batch_means(self.loss_sums(batch))


def davidson_logits(diff: torch.Tensor, log_nu: torch.Tensor) -> torch.Tensor:
    """(..., 3) logits of P(first preferred), P(second), P(tie) under Davidson's (1970)
    Bradley-Terry model with ties, for reward differences `diff` = r_first - r_second:
    P(first) = e^r1 / (e^r1 + e^r2 + nu sqrt(e^r1 e^r2)), which is a softmax over (diff / 2,
    -diff / 2, log nu). A tie is likeliest where the rewards are equal, and nu sets how likely."""
    return torch.stack([diff / 2, -diff / 2, log_nu.expand_as(diff)], dim=-1)


TIE_PARAMETER = "tie_log_nu"  # PointwiseCRM's, by name (an FSDP2 parameter keeps its name)
# AdamW moves every parameter about lr a step. A weight needs no more; log nu is one number that
# must travel a few units (a tie's odds where rewards are equal, from even at nu = 1 to the data's
# rate), which at the model's lr it would not finish in a run: it trains at this multiple.
TIE_LR_SCALE = 100.0


class PointwiseCRM(nn.Module):
    """criteria + query + one response -> a scalar reward; Bradley-Terry over chosen/rejected,
    or with `ties="davidson"` Davidson's model with ties, its log nu (`tie_log_nu`) learned.

    A batch holds the n chosen rows, then their n rejected rows: one forward for both (one FSDP
    all-gather per step, not two). With ties, `labels` says which pairs are ties (LABEL_TIE; the
    two rows of a tie in either order) and which were won by the first row (LABEL_A).
    """

    kind = "pointwise"
    num_labels = 1

    def __init__(self, model: nn.Module, margin: float = 0.0, center_coef: float = 0.0,
                 ties: str = "none"):
        super().__init__()
        self.model, self.margin, self.center_coef = model, margin, center_coef
        # Shape (1,), not a scalar: FSDP2 shards every parameter along its first dimension.
        self.tie_log_nu = nn.Parameter(torch.zeros(1)) if ties == "davidson" else None

    def forward(self, input_ids, attention_mask=None, packed: dict | None = None):
        return crm_logits(self.model, input_ids, attention_mask, packed).squeeze(-1)

    metrics = ("loss", "acc", "reward_chosen", "reward_rejected", "margin")

    def loss_sums(self, batch: dict) -> dict:
        """L_ranking summed over the batch's pairs: -log sigmoid(r_c - r_r - margin)
        (+ center_coef * (r_c + r_r)^2), or with ties Davidson's negative log-likelihood of each
        pair's label (the margin on won pairs); the metrics summed alongside, and the pair count
        `n`."""
        if not batch["input_ids"].numel():
            return _empty_batch_sums(self, batch)
        rewards = self(**model_inputs(batch)).float()
        n = rewards.shape[0] // 2
        chosen, rejected = rewards[:n], rewards[n:]
        diff = chosen - rejected
        labels = batch.get("labels")
        tie = (labels == LABEL_TIE) if labels is not None else torch.zeros_like(diff, dtype=torch.bool)
        if self.tie_log_nu is None:
            # Read on the CPU only: on an accelerator `bool()` makes the host wait for the device
            # at every micro batch; crm-train refuses ties for a Bradley-Terry CRM at start
            # (crm.training.checks), so its stream never sends one.
            if diff.device.type == "cpu" and bool(tie.any()):
                raise ValueError("a tie reached a Bradley-Terry pointwise CRM: set loss.ties=davidson, "
                                 "or transform.ties=drop")
            loss = -F.logsigmoid(diff - self.margin).sum()
            acc = (diff > 0).float().sum()
        else:
            logits = davidson_logits(torch.where(tie, diff, diff - self.margin), self.tie_log_nu.float())
            target = torch.where(tie, LABEL_TIE, LABEL_A)
            loss = F.cross_entropy(logits, target, reduction="sum")
            acc = (logits.argmax(-1) == target).float().sum()
        if self.center_coef:
            # Reward centering (Eisenstein et al. 2023): keeps rewards near zero so that scores
            # from different runs are comparable.
            loss = loss + self.center_coef * ((chosen + rejected) ** 2).sum()
        return {"loss": loss, "acc": acc, "n": n,
                "reward_chosen": chosen.sum(), "reward_rejected": rejected.sum(), "margin": diff.sum()}

    def loss(self, batch: dict) -> dict:
        """The batch's mean loss and metrics."""
        return batch_means(self.loss_sums(batch))


def batch_means(sums: dict) -> dict:
    """Each sum of `loss_sums` divided by the batch's example count (zeros for an empty batch)."""
    n = sums["n"]
    return {name: value if name == "n" else value / max(n, 1) for name, value in sums.items()}


def _empty_batch_sums(crm: nn.Module, batch: dict) -> dict:
    """Zero sums for a batch whose every example the length policy dropped.

    The rank still steps with the others: one forward of a single pad token, times zero, so the
    gradient collectives see every parameter (an empty tensor cannot pass through attention).
    """
    ids = torch.full((1, 1), crm.model.config.pad_token_id, device=batch["input_ids"].device)
    with eager():  # a one-token shape, rare: not worth a compiled graph of its own
        logits = crm(ids, torch.ones_like(ids))
    zero = logits.float().sum() * 0.0
    if getattr(crm, "tie_log_nu", None) is not None:
        zero = zero + crm.tie_log_nu.float().sum() * 0.0
    return {name: zero for name in crm.metrics} | {"n": 0}
