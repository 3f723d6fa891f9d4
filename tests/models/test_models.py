"""Backbones, CRM heads, losses and export (crm.models)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_tokenizer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from crm.data.padding import pad_rows
from crm.models.backbone import ARCHITECTURES, build_classifier, choose_attention, count_parameters
from crm.models.heads import PairwiseCRM, PointwiseCRM, davidson_logits, last_token_logits
from crm.models.export import export_crm, load_export, read_meta
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.core.prompts import PromptEncoder, PromptTemplate

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, max_position_embeddings=512)

# Totals of the sequence classifier (2 labels) and non-embedding counts, in billions to 3 decimals.
PUBLISHED = {"qwen3-0.6b": (0.596e9, 0.440e9), "qwen3-1.7b": (1.721e9, 1.409e9),
             "qwen3-4b": (4.022e9, 3.634e9), "qwen3-8b": (7.568e9, 6.946e9)}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_real_sizes_on_meta_device_match_published_counts(arch):
    model = build_classifier(num_labels=2, pad_token_id=0, arch=arch, device="meta")
    counts = count_parameters(model)
    total, non_embedding = PUBLISHED[arch]
    # The table gives three decimals of billions: agree to its rounding.
    assert counts["total"] == pytest.approx(total, abs=0.5e6)
    assert counts["non_embedding"] == pytest.approx(non_embedding, abs=0.5e6)
    assert all(p.is_meta for p in model.parameters())
    assert model.config.pad_token_id == 0


def test_attention_choice_on_cpu():
    assert choose_attention("auto") == "sdpa"
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        choose_attention("flash_attention_2")


def tiny_crm(kind: str, num_labels: int = 2, seed: int = 0, ties: str = "none"):
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    return build_crm(ModelConfig(arch=TINY, attention="sdpa"), LossConfig(kind, ties=ties),
                     num_labels=num_labels, pad_token_id=tok.pad_token_id, vocab_size=len(tok)), tok


def encoded_pairs(tok, n: int = 4) -> list[list[int]]:
    enc = PromptEncoder(tok, max_tokens=400)
    from crm.core.records import Message
    items = [(["concise answer"] * (1 + i % 2), f"query {i}", (Message("assistant", "alpha " * (i + 1)),),
              (Message("assistant", "beta reply " * (3 - i % 3)),)) for i in range(n)]
    return enc.pairwise_many(items)


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_a_row_scores_the_same_alone_and_padded_in_a_batch(kind):
    crm, tok = tiny_crm(kind)
    crm.eval()
    rows = encoded_pairs(tok)
    assert len({len(r) for r in rows}) > 1  # the batch really pads
    with torch.no_grad():
        batch = pad_rows(rows, tok.pad_token_id)
        together = crm(batch["input_ids"], batch["attention_mask"])
        for i, row in enumerate(rows):
            alone = pad_rows([row], tok.pad_token_id)
            single = crm(alone["input_ids"], alone["attention_mask"])
            torch.testing.assert_close(together[i], single[0], atol=1e-5, rtol=1e-5)


def test_a_left_padded_batch_is_refused():
    crm, tok = tiny_crm("pairwise")
    batch = pad_rows(encoded_pairs(tok), tok.pad_token_id)
    left_mask = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="right padded"):
        crm(batch["input_ids"], left_mask)


def test_pairwise_loss_is_cross_entropy_and_accuracy_counts_argmax():
    crm, tok = tiny_crm("pairwise")
    batch = pad_rows(encoded_pairs(tok), tok.pad_token_id)
    batch["labels"] = torch.tensor([0, 1, 1, 0])
    out = crm.loss(batch)
    logits = crm(batch["input_ids"], batch["attention_mask"])
    assert out["loss"].item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits, batch["labels"]).item(), rel=1e-5)
    assert out["acc"].item() == (logits.argmax(-1) == batch["labels"]).float().mean().item()
    assert out["n"] == 4


def test_bradley_terry_loss_reads_chosen_then_rejected_rows():
    crm, _ = tiny_crm("pointwise")
    crm.margin, crm.center_coef = 0.5, 0.1
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0])  # chosen 2, 0 ; rejected 1, 1
    crm.forward = lambda input_ids, attention_mask: rewards  # the loss arithmetic alone
    rows = torch.ones((4, 3), dtype=torch.long)
    out = crm.loss({"input_ids": rows, "attention_mask": rows})
    bt = -(math.log(1 / (1 + math.exp(-(1 - 0.5)))) + math.log(1 / (1 + math.exp(-(-1 - 0.5))))) / 2
    center = 0.1 * ((2 + 1) ** 2 + (0 + 1) ** 2) / 2
    assert out["loss"].item() == pytest.approx(bt + center, rel=1e-5)
    assert out["acc"].item() == 0.5 and out["n"] == 2
    assert out["margin"].item() == pytest.approx(0.0)


def davidson(d: float, nu: float) -> tuple[float, float, float]:
    """Davidson (1970) as published: P(i) = pi_i / (pi_i + pi_j + nu sqrt(pi_i pi_j)), pi = e^r."""
    pi_1, pi_2 = math.exp(d), 1.0
    total = pi_1 + pi_2 + nu * math.sqrt(pi_1 * pi_2)
    return pi_1 / total, pi_2 / total, nu * math.sqrt(pi_1 * pi_2) / total


def test_davidson_logits_give_davidsons_probabilities():
    for d, nu in ((0.0, 1.0), (1.3, 0.2), (-2.0, 5.0)):
        got = davidson_logits(torch.tensor([d]), torch.tensor([math.log(nu)])).softmax(-1)[0]
        assert got.tolist() == pytest.approx(davidson(d, nu), rel=1e-6)


def test_davidson_loss_reads_ties_and_wins_and_learns_nu():
    crm = build_crm(ModelConfig(arch=TINY, attention="sdpa"), LossConfig("pointwise", margin=0.5,
                    ties="davidson"), num_labels=1, pad_token_id=0, vocab_size=64)
    with torch.no_grad():
        crm.tie_log_nu.fill_(math.log(2.0))
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0])  # first rows 2, 0; second rows 1, 1
    crm.forward = lambda input_ids, attention_mask: rewards
    rows = torch.ones((4, 3), dtype=torch.long)
    out = crm.loss({"input_ids": rows, "attention_mask": rows, "labels": torch.tensor([0, 2])})
    won, tie = davidson(1 - 0.5, 2.0)[0], davidson(-1, 2.0)[2]  # the margin on the won pair only
    assert out["loss"].item() == pytest.approx(-(math.log(won) + math.log(tie)) / 2, rel=1e-5)
    # the tie is right (at d -1 a tie is likeliest under nu 2); so is a tie at the won pair's
    # d - margin = 0.5, which is wrong
    assert out["acc"].item() == 0.5
    out["loss"].backward()
    assert crm.tie_log_nu.grad is not None and crm.tie_log_nu.grad.item() != 0.0


def test_a_tie_reaching_a_bradley_terry_crm_is_refused():
    crm, _ = tiny_crm("pointwise")
    crm.forward = lambda input_ids, attention_mask: torch.zeros(2)
    rows = torch.ones((2, 3), dtype=torch.long)
    with pytest.raises(ValueError, match="loss.ties=davidson"):
        crm.loss({"input_ids": rows, "attention_mask": rows, "labels": torch.tensor([2])})


def test_davidson_ties_are_a_pointwise_loss():
    with pytest.raises(ValueError, match="3-way head"):
        LossConfig("pairwise", ties="davidson")
    with pytest.raises(ValueError, match="loss.ties=rao"):
        LossConfig("pointwise", ties="rao")


@pytest.mark.parametrize("kind", ["pairwise", "pointwise", "davidson"])
def test_an_empty_batch_gives_a_zero_loss_that_still_reaches_every_parameter(kind):
    crm, tok = tiny_crm(kind) if kind != "davidson" else tiny_crm("pointwise", ties="davidson")
    batch = {"input_ids": torch.zeros((0, 1), dtype=torch.long),
             "attention_mask": torch.zeros((0, 1), dtype=torch.long),
             "labels": torch.zeros(0, dtype=torch.long)}
    out = crm.loss(batch)
    out["loss"].backward()
    assert out["loss"].item() == 0.0 and out["n"] == 0
    assert all(p.grad is not None and not p.grad.any() for p in crm.parameters())


@pytest.mark.parametrize("kind,num_labels", [("pairwise", 2), ("pairwise", 3), ("pointwise", 1)])
def test_export_loads_in_plain_transformers_with_identical_logits(tmp_path, kind, num_labels):
    crm, tok = tiny_crm(kind, num_labels=max(num_labels, 2) if kind == "pairwise" else 2)
    template = PromptTemplate(criterion="* {criterion}")
    export_crm(crm.model, tok, tmp_path, kind=kind, template=template, max_tokens=400)
    assert (tmp_path / "model.safetensors").is_file()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tokenizer.pad_token_id == tok.pad_token_id
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == \
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    batch = pad_rows(encoded_pairs(tok), tok.pad_token_id)
    with torch.no_grad():
        ours = last_token_logits(crm.model.eval(), batch["input_ids"], batch["attention_mask"])
        plain = model(**batch).logits
    torch.testing.assert_close(plain, ours, atol=1e-6, rtol=1e-6)
    meta = read_meta(tmp_path)
    assert meta["kind"] == kind and len(meta["labels"]) == model.config.num_labels
    _, _, loaded_template, _ = load_export(tmp_path)
    assert loaded_template == template


def test_model_from_a_local_checkpoint_path(tmp_path):
    crm, tok = tiny_crm("pairwise")
    crm.model.save_pretrained(tmp_path)
    loaded = build_crm(ModelConfig(path=str(tmp_path), attention="sdpa"), LossConfig("pairwise"),
                       num_labels=2, pad_token_id=None)
    assert isinstance(loaded, PairwiseCRM) and loaded.model.config.pad_token_id == tok.pad_token_id
    for a, b in zip(crm.parameters(), loaded.parameters()):
        torch.testing.assert_close(a, b)
    pointwise = build_crm(ModelConfig(path=str(tmp_path), attention="sdpa"), LossConfig("pointwise"),
                          num_labels=1, pad_token_id=None)
    assert isinstance(pointwise, PointwiseCRM) and pointwise.model.config.num_labels == 1


def last_hidden(crm, batch: dict) -> torch.Tensor:
    """The final hidden state at each row's last real token, as the head reads it."""
    hidden = crm.model.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    last = batch["attention_mask"].sum(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0]), last]


def test_rewards_closer_than_a_bfloat16_step_keep_their_order_in_a_bfloat16_model():
    """Two answers whose rewards near 10 differ by 0.03, less than bfloat16's step there (0.0625):
    the scorer of a bfloat16 model tells them apart, in the right order, as float64 does."""
    from crm.core.records import Message
    from crm.inference.scorer import CRMScorer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=TINY, attention="sdpa", dtype="bfloat16"), LossConfig("pointwise"),
                    num_labels=1, pad_token_id=tok.pad_token_id, vocab_size=len(tok)).eval()
    scorer = CRMScorer(crm.model, tok, PromptTemplate(), "pointwise", max_tokens=400,
                       prefix_reuse=False, compile=False)
    items = [(["concise"], "a query", (Message("assistant", text),)) for text in ("alpha", "beta reply")]
    with torch.no_grad():
        h = last_hidden(crm, pad_rows(scorer.encoder.pointwise_many(items), tok.pad_token_id)).double()
        # A head weight in the span of the two hidden states, rewards 9.99 and 10.02, then bfloat16
        w = torch.linalg.solve(h @ h.T, torch.tensor([9.99, 10.02], dtype=torch.float64)) @ h
        crm.model.score.weight.copy_(w[None])
        exact = h @ crm.model.score.weight[0].double()
        assert 0.01 < float(exact[1] - exact[0]) < 0.0625
        rounded = crm.model.score(h.bfloat16()).squeeze(-1)  # what a bfloat16 head computes
        assert rounded[0] == rounded[1]  # the test sees what it is about
    rewards = scorer.score_many(items)
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(rewards.double(), exact, rtol=1e-6, atol=1e-5)
    p_a = scorer.compare_many([(c, q, a, b) for (c, q, a), (_, _, b) in [items]])[0, 0]
    assert float(p_a) == pytest.approx(float(torch.sigmoid(exact[0] - exact[1])), abs=1e-6)
    assert p_a < 0.5


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_the_loss_under_bfloat16_autocast_is_the_float64_head_on_its_hidden_states(kind):
    """trainer=gpu's precision (bfloat16 autocast over float32 weights) computes the head and the
    loss in float32: equal to the head and loss in float64 over the same hidden states."""
    crm, tok = tiny_crm(kind)
    with torch.no_grad():  # rewards near 10, where a bfloat16 head would round to 0.0625
        crm.model.score.weight.mul_(200.0)
    batch = pad_rows(encoded_pairs(tok), tok.pad_token_id)
    batch["labels"] = torch.tensor([0, 1, 1, 0]) if kind == "pairwise" else torch.tensor([0, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = crm.loss(batch)["loss"]
        hidden = last_hidden(crm, batch)
        autocast_head = crm.model.score(hidden)  # the head as autocast alone would run it
    logits = hidden.double() @ crm.model.score.weight.double().T
    assert logits.abs().max() > 4 and (autocast_head.double() - logits).abs().max() > 1e-3
    assert loss.dtype == torch.float32
    if kind == "pairwise":
        reference = torch.nn.functional.cross_entropy(logits, batch["labels"])
    else:
        reference = -torch.nn.functional.logsigmoid(logits[:2, 0] - logits[2:, 0]).mean()
    assert float(loss.detach()) == pytest.approx(float(reference), rel=1e-6, abs=1e-6)
