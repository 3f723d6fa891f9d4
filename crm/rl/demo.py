"""crm-rl's harness: GRPO runs from one initial policy under different criteria, and the evidence.

Every run starts from the same initial policy with the same seeds; runs differ only in the reward.
The evidence is measured here, not read from the trainer's logs or the CRM: each final policy
samples `per_prompt` completions of held-out prompts with one fixed seed, and their tokens are
counted. Checks:

- a run whose criteria expect `shorter` (`longer`) ends with a mean length below (above) the
  initial policy's, and the gap between the two is at least `min_gap` of the maximum length;
- `constant`: a constant reward moves the mean length by less than `epsilon` of the maximum length;
- `flipped_<run>`: the same criteria under a CRM that prefers the opposite moves the length the
  other way (the signal is the CRM's, not a length rule in the wrapper).

Guard runs (KL `beta`, the overlong penalty, and the unbounded log-odds reward as the contrast to
the bounded default) repeat one run with the guard; their measured effect is reported, not checked.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from crm.core.records import read_lines
from crm.inference.reward import CRMReward, load_crm_scorer
from crm.inference.scorer import CRMScorer
from crm.rl.config import EXPECT, GRPOSettings, Plan
from crm.rl.controls import constant_reward, flip
from crm.rl.grpo import train_grpo
from crm.rl.policy import Samples, build_policy, load_policy, sample, warm_up

log = logging.getLogger("crm.rl")


class PlanError(ValueError):
    """Input the harness cannot run on (crm-rl reports it as one line)."""


def read_prompts(path: str | Path) -> dict[str, list[str]]:
    """query -> its answers in the file, for any crm format (training, test, benchmark)."""
    answers: dict[str, list[str]] = {}
    for line in read_lines(path):
        if line.error:
            raise line.error
        record = line.record
        if hasattr(record, "responses"):  # benchmark
            query = record.prompt
            convs = list(record.responses.values())
        else:
            query = record.model_a[0].content
            convs = [record.model_a[1:], record.model_b[1:]]
        texts = [c[0].content for c in convs if c and c[0].role == "assistant"]
        answers.setdefault(query, []).extend(texts)
    return answers


def run(plan: Plan, out_dir: Path) -> dict:
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    answers = read_prompts(plan.prompts)  # before the CRM loads: a prompt file that cannot work stops here
    queries = sorted(answers)
    random.Random(plan.seed).shuffle(queries)
    held_out, train_queries = queries[:plan.measure.prompts], queries[plan.measure.prompts:]
    if not train_queries:
        raise PlanError(f"{plan.prompts}: {len(queries)} distinct prompts, all held out for the "
                        f"measurement (measure.prompts={plan.measure.prompts}); set measure.prompts "
                        f"to about a quarter of them (measure.prompts={max(1, len(queries) // 4)})")
    device = torch.device(plan.device) if plan.device else None
    crm = load_crm_scorer(plan.checkpoint, batch_size=plan.reward.batch_size, device=device)
    strategy = CRMReward(crm, plan.reward.strategy).strategy
    references = {q: answers[q][0] for q in held_out}

    policy, tokenizer, policy_info = _initial_policy(plan, crm, answers)
    max_len = plan.grpo.max_completion_length

    def measure(model) -> Samples:
        return sample(model, tokenizer, held_out, per_query=plan.measure.per_prompt,
                      max_tokens=max_len, temperature=plan.grpo.temperature,
                      seed=plan.measure.seed)

    # Every run loads the initial policy from here: the same weights, and TRL (beta > 0) loads
    # its reference model from the path the policy names.
    initial_dir = out_dir / "initial_policy"
    policy.save_pretrained(initial_dir)
    tokenizer.save_pretrained(initial_dir)
    initial = measure(policy)
    flipped = _flipped(plan, crm, device)
    result = {
        "checkpoint": str(plan.checkpoint), "kind": crm.kind,
        "reward": {**asdict(plan.reward), "strategy": strategy},
        "policy": policy_info, "grpo": asdict(plan.grpo), "measure": asdict(plan.measure),
        "prompts": {"file": str(plan.prompts), "train": len(train_queries),
                    "held_out": len(held_out)},
        "initial": {**initial.summary(max_len), "examples": initial.texts[:plan.measure.examples]},
        "runs": {},
    }
    initial_rewards: dict = {}

    def one_run(name: str, reward_funcs: list, criteria, scorer, grpo: GRPOSettings,
                about: str) -> dict:
        log.info("crm-rl: run %s (%s)", name, about)
        t0 = time.perf_counter()
        model = load_policy(initial_dir)
        history = train_grpo(model, tokenizer, train_queries, criteria, reward_funcs, grpo,
                             plan.seed, out_dir / "trl" / name,
                             {q: answers[q][0] for q in train_queries})
        final = measure(model)
        entry = {"reward": about, "criteria": list(criteria) if criteria else None,
                 "length": final.summary(max_len),
                 "length_change": round(_mean(final.lengths) - _mean(initial.lengths), 2),
                 "examples": final.texts[:plan.measure.examples]}
        entry["length_change_share_of_max"] = round(entry["length_change"] / max_len, 4)
        if scorer is not None:
            key = (id(scorer), tuple(criteria))
            if key not in initial_rewards:
                initial_rewards[key] = against_reference(scorer, criteria, initial, references)
            entry["crm"] = judge(scorer, criteria, initial, final, initial_rewards[key],
                                 against_reference(scorer, criteria, final, references))
        entry["trainer_log"] = _trainer_log(history)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry

    def crm_funcs(scorer, log_odds: bool = plan.reward.log_odds) -> list:
        return [CRMReward(scorer, strategy, tau=plan.reward.tau, log_odds=log_odds)]

    runs = result["runs"]
    for spec in plan.runs:
        runs[spec.name] = one_run(spec.name, crm_funcs(crm), spec.criteria, crm, plan.grpo,
                             f"the CRM, {strategy}")
    if plan.controls.constant:
        runs["constant"] = one_run("constant", [constant_reward()], None, None, plan.grpo,
                                   "constant 0.5 for every completion")
    if flipped is not None:
        scorer, about = flipped
        for spec in plan.runs:
            if spec.expect:
                runs[f"flipped_{spec.name}"] = one_run(f"flipped_{spec.name}", crm_funcs(scorer),
                                                  spec.criteria, scorer, plan.grpo, about)
    result["guards"] = _guard_runs(plan, strategy, runs, one_run, crm_funcs, crm)
    result["evidence"] = evidence(plan, runs)
    result["seconds"] = {"warm_up": (policy_info["warm_up"] or {}).get("seconds"),
                         "total": round(time.perf_counter() - started, 1)}
    return result


def against_reference(scorer: CRMScorer, criteria, samples: Samples,
                      references: dict[str, str]) -> list[float]:
    """Each sample's reward under this CRM and criteria: against the data's answer to its prompt
    (a pairwise CRM, both orders), or its own reward (a pointwise CRM)."""
    reward = CRMReward(scorer, "pointwise" if scorer.kind == "pointwise" else "reference")
    return reward(samples.queries, samples.texts, criteria=[list(criteria)] * len(samples.texts),
                  reference=[references[q] for q in samples.queries])


def judge(scorer: CRMScorer, criteria, initial: Samples, final: Samples, start: list[float],
          end: list[float]) -> dict:
    """What the run's CRM says of the final policy (the evidence is the lengths; this shows
    that the policy moved the CRM's way): its mean reward at start and end, the final samples'
    win rate against the initial policy's for the same prompts (every pair, both orders:
    above 0.5 when the policy moved the CRM's way), and its reward of the final samples the length
    limit cut against those that ended (reward hacking at the limit: docs/RL.md)."""
    pairs = [(q, f, i) for q, f in zip(final.queries, final.texts)
             for qi, i in zip(initial.queries, initial.texts) if qi == q]
    reference = CRMReward(scorer, "reference")
    wins = reference([q for q, _, _ in pairs], [f for _, f, _ in pairs],
                     criteria=[list(criteria)] * len(pairs), reference=[i for _, _, i in pairs])
    cut = [r for r, c in zip(end, final.clipped) if c]
    ended = [r for r, c in zip(end, final.clipped) if not c]
    return {"reward_start": round(_mean(start), 4), "reward_end": round(_mean(end), 4),
            "reward_is": ("against the data's answer to each prompt" if scorer.kind == "pairwise"
                          else "the pointwise reward"),
            "final_beats_initial": round(_mean(wins), 4),
            "reward_end_clipped": round(_mean(cut), 4) if cut else None,
            "reward_end_terminated": round(_mean(ended), 4) if ended else None}


def _initial_policy(plan: Plan, crm: CRMScorer, answers: dict[str, list[str]]):
    if plan.policy.path:
        from transformers import AutoTokenizer

        path = plan.policy.path
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return load_policy(path), tokenizer, {"path": path, "warm_up": None}
    tokenizer = crm.tokenizer
    policy = build_policy(tokenizer, plan.policy.arch, plan.seed)
    t0 = time.perf_counter()
    pairs = [(q, a) for q, texts in answers.items() for a in texts]
    w = plan.policy.warm_up
    losses = warm_up(policy, tokenizer, pairs, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                     max_sentences=w.max_sentences, seed=plan.seed)
    info = {"built": "tiny Qwen3ForCausalLM from a local config, randomly initialised",
            "config": asdict(plan.policy.arch), "parameters": sum(p.numel() for p in policy.parameters()),
            "tokenizer": "the CRM's",
            "warm_up": {**asdict(w), "loss_first": round(losses[0], 3),
                        "loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 3),
                        "seconds": round(time.perf_counter() - t0, 1),
                        "why": "a random policy almost never samples EOS; answers cut after "
                               "1..max_sentences sentences give a mid-range length to move"}}
    return policy, tokenizer, info


def _flipped(plan: Plan, crm: CRMScorer, device):
    if plan.controls.flipped is None:
        return None
    if plan.controls.flipped == "derived":  # a second copy of the CRM, flipped
        scorer = flip(load_crm_scorer(plan.checkpoint, batch_size=plan.reward.batch_size,
                                      device=device))
        return scorer, ("DERIVED flipped CRM (not trained): the CRM with its two label rows "
                        "swapped" if crm.kind == "pairwise" else
                        "DERIVED flipped CRM (not trained): the CRM's reward negated")
    scorer = load_crm_scorer(plan.controls.flipped, batch_size=plan.reward.batch_size, device=device)
    return scorer, f"a CRM trained on flipped labels: {plan.controls.flipped}"


def _guard_runs(plan: Plan, strategy: str, runs: dict, one_run, crm_funcs, crm) -> dict:
    g = plan.guards
    if g.under is None:
        return {}
    spec, base = next(r for r in plan.runs if r.name == g.under), runs[g.under]
    out = {}
    about = f"the CRM, {strategy}"
    if g.beta:
        grpo = GRPOSettings(**{**asdict(plan.grpo), "beta": g.beta})
        out["beta"] = one_run(f"{g.under}_beta", crm_funcs(crm), spec.criteria, crm, grpo,
                              f"{about}, KL beta={g.beta}")
    if g.overlong_cache:
        grpo = GRPOSettings(**{**asdict(plan.grpo), "overlong_cache": g.overlong_cache})
        out["overlong_penalty"] = one_run(
            f"{g.under}_overlong", crm_funcs(crm), spec.criteria, crm, grpo,
            f"{about} + TRL's soft overlong punishment over the last {g.overlong_cache} tokens")
    if g.unbounded and strategy != "pointwise":  # the pointwise reward is unbounded already
        out["unbounded"] = one_run(f"{g.under}_unbounded", crm_funcs(crm, log_odds=True),
                                   spec.criteria, crm, plan.grpo,
                                   f"{about}, log-odds (unbounded) instead of probabilities")
    for entry in out.values():
        entry["versus_unguarded"] = {
            "mean_share_of_max": [base["length"]["mean_share_of_max"],
                                  entry["length"]["mean_share_of_max"]],
            "clipped_share": [base["length"]["clipped_share"], entry["length"]["clipped_share"]]}
    return {"under": g.under, **out}


def evidence(plan: Plan, runs: dict) -> dict:
    """The checks of the module doc, on the measured lengths."""
    checks, max_len = {}, plan.grpo.max_completion_length
    for spec in plan.runs:
        name = spec.name
        if spec.expect:
            sign = EXPECT[spec.expect]
            checks[f"{name}_{spec.expect}_than_initial"] = sign * runs[name]["length_change"] > 0
            if f"flipped_{name}" in runs:
                checks[f"flipped_{name}_reverses"] = -sign * runs[f"flipped_{name}"]["length_change"] > 0
    shorter = [r.name for r in plan.runs if r.expect == "shorter"]
    longer = [r.name for r in plan.runs if r.expect == "longer"]
    out = {"epsilon_share_of_max": plan.controls.epsilon, "min_gap_share_of_max": plan.controls.min_gap}
    if shorter and longer:
        gap = (min(runs[n]["length"]["mean_tokens"] for n in longer)
               - max(runs[n]["length"]["mean_tokens"] for n in shorter)) / max_len
        out["gap_share_of_max"] = round(gap, 4)
        checks["gap_at_least_min_gap"] = gap >= plan.controls.min_gap
    if "constant" in runs:
        moved = abs(runs["constant"]["length_change_share_of_max"])
        checks["constant_within_epsilon"] = moved < plan.controls.epsilon
    out["checks"] = checks
    out["all_passed"] = all(checks.values())
    return out


def _trainer_log(history: list[dict]) -> dict:
    """The trainer's own first and last logged means: context, never the evidence."""
    logged = [h for h in history if "reward" in h]
    if not logged:
        return {}
    keys = ("reward", "completions/mean_length", "completions/clipped_ratio", "kl")
    return {which: {k: round(h[k], 4) for k in keys if k in h}
            for which, h in (("first", logged[0]), ("last", logged[-1]))}


def _mean(values) -> float:
    return sum(values) / len(values)
