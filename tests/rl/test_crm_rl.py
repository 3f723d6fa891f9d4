"""crm-rl (crm/cli/rl.py, configs/rl.yaml): its one-line configuration errors, and end to end the
real command on a quickly trained CRM (tests/scorers.py train_length_crm): rl.json's structure,
and lengths that move the way the criteria say, measured by the harness."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scorers import export_tiny, run_cli

from crm.cli.rl import run
from crm.core.errors import ConfigError

BIN = Path(sys.executable).parent
# Few and small: a tiny policy warmed up briefly, a few GRPO steps per run, short completions.
QUICK = ["torch_threads=1", "policy.warm_up.steps=40", "grpo.max_steps=5", "grpo.prompts_per_step=4",
         "grpo.max_completion_length=32", "grpo.learning_rate=3e-3", "grpo.logging_steps=5",
         "measure.prompts=8", "guards.overlong_cache=8"]


@pytest.mark.slow
def test_crm_rl_moves_length_the_way_the_criteria_say(length_crm, tmp_path):
    export, data = length_crm
    env = {**os.environ, "CRM_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(BIN / "crm-rl"), f"checkpoint={export}", f"prompts={data}", "name=quick",
                           *QUICK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "outputs" / "rl" / "quick" / "rl.json").read_text())
    assert result["kind"] == "pointwise" and result["reward"]["strategy"] == "pointwise"
    runs = result["runs"]
    assert set(runs) == {"short", "detailed", "constant", "flipped_short", "flipped_detailed"}
    assert set(result["guards"]) == {"under", "beta", "overlong_penalty"}  # pointwise: no unbounded
    for entry in [*runs.values(), result["guards"]["beta"], result["guards"]["overlong_penalty"]]:
        assert entry["length"]["n"] == 8 * 4
        assert {"mean_tokens", "clipped_share", "mean_share_of_max"} <= set(entry["length"])
    assert "DERIVED" in runs["flipped_short"]["reward"]  # named for what it is: not trained
    initial = result["initial"]["mean_tokens"]
    assert runs["short"]["length"]["mean_tokens"] < initial < runs["detailed"]["length"]["mean_tokens"]
    assert runs["flipped_short"]["length_change"] > 0 > runs["flipped_detailed"]["length_change"]
    assert abs(runs["constant"]["length_change_share_of_max"]) < result["evidence"]["epsilon_share_of_max"]
    # the CRM prefers the longer final answers to the initial policy's where it asked for them
    for name in ("detailed", "flipped_short"):
        assert runs[name]["crm"]["final_beats_initial"] > 0.5
    assert runs["detailed"]["crm"]["reward_end"] > runs["detailed"]["crm"]["reward_start"]
    assert result["evidence"]["all_passed"], result["evidence"]
    assert "evidence: all checks pass" in done.stdout


def test_missing_demo_crm_says_how_to_make_it(tmp_path):
    # (one_line_config_errors prints a ConfigError as one line and exits 2, for every command)
    with pytest.raises(ConfigError, match=r"^checkpoint=.*: no such file or directory\. .*`make demo` "
                                          r"makes them") as err:
        run_cli("rl", run, [f"paths.root_dir={tmp_path}"], tmp_path / "run")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["runs=[]"], "runs: no runs"),
    (["runs=[{name: a, criteria: []}]"], "runs: a: criteria must be a non-empty list of non-empty strings"),
    (["runs=[{name: a, criteria: [x]}, {name: a, criteria: [y]}]"], "runs: two runs share a name (a, a)"),
    (["runs.0.expect=sideways"], "runs: short: expect=sideways: shorter, longer or null"),
    (["guards.under=missing"], "guards.under=missing: not a run (short, detailed)"),
    (["grpo.num_generations=1"], "grpo.num_generations=1: at least 2"),
    (["reward.strategy=best_of"], "reward.strategy=best_of: null or one of pointwise, reference"),
    (["controls.flipped=/no/such/crm"], "controls.flipped=/no/such/crm: no such file"),
])
def test_settings_that_cannot_work_are_config_errors(tmp_path, overrides, message):
    export = export_tiny(tmp_path / "crm")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"idx": 0, "topic": "t", "prompt": "q",
                                "responses": {"m": "a", "n": "b"}}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_cli("rl", run, [f"checkpoint={export}", f"prompts={data}", *overrides], tmp_path / "run")


def test_a_model_that_is_not_a_crm_is_a_config_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"idx": 0, "topic": "t", "prompt": "q", "responses": {"m": "a"}}) + "\n")
    with pytest.raises(ConfigError, match="not a CRM checkpoint"):
        run_cli("rl", run, [f"checkpoint={tmp_path / 'model'}", f"prompts={data}",
                            "measure.prompts=0"], tmp_path / "run")  # the prompts pass: the CRM is read


def test_a_prompt_file_with_every_prompt_held_out_is_a_config_error(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"idx": 0, "topic": "t", "prompt": "q", "responses": {"m": "a"}}) + "\n")
    with pytest.raises(ConfigError, match="1 distinct prompts, all held out for the measurement"):
        run_cli("rl", run, [f"checkpoint={export_tiny(tmp_path / 'crm')}", f"prompts={data}"],
                tmp_path / "run")


def test_a_policy_of_ones_own_is_loaded_from_its_directory_without_warm_up(tmp_path):
    from helpers import tiny_tokenizer

    from crm.rl.config import Guards, Plan, PolicyConfig, PolicySettings, Run
    from crm.rl.demo import _initial_policy
    from crm.rl.policy import build_policy

    tokenizer = tiny_tokenizer()
    build_policy(tokenizer, PolicyConfig(hidden_size=32, intermediate_size=64), 0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    plan = Plan(checkpoint="unused", prompts="unused", runs=[Run("mine", ["concise"])],
                guards=Guards(under=None), policy=PolicySettings(path=str(tmp_path)))
    policy, loaded, info = _initial_policy(plan, crm=None, answers={})
    assert info == {"path": str(tmp_path), "warm_up": None}
    assert policy.config.hidden_size == 32 and len(loaded) == len(tokenizer)
