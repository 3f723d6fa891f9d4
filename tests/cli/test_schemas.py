"""Each command's config is declared once (docs/DESIGN.md section 6): a key's type in a dataclass,
its value and its comment in the YAML. Hydra checks types and keys when it composes; the
dataclasses' own checks refuse a value outside a key's choices, as one-line ConfigErrors."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

import crm.cli.eval
import crm.cli.leaderboard
import crm.cli.plan
import crm.cli.rl
import crm.cli.train
import crm.cli.usl
import crm_configs
from crm.app.config import HttpLimits
from crm.app.service import Limits
from crm.cli.schema import settings
from crm.core.errors import ConfigError
from crm.core.prompts import PromptTemplate
from crm.data.config import StreamSettings
from crm.data.transforms import TransformSettings
from crm.evaluation.benchmarks import BenchmarkConfig
from crm.evaluation.leaderboard import Bootstrap
from crm.inference.engine import EngineConfig
from crm.models.factory import LossConfig, ModelConfig
from crm.training.loggers import LoggerConfig
from crm.training.module import OptimConfig
from crm.training.parallel import ParallelConfig

CONFIG_DIR = Path(crm_configs.__file__).parent
SCHEMAS = {"train": crm.cli.train.TrainConfig, "eval": crm.cli.eval.EvalConfig,
           "leaderboard": crm.cli.leaderboard.LeaderboardConfig, "usl": crm.cli.usl.UslConfig,
           "plan": crm.cli.plan.PlanConfig, "rl": crm.cli.rl.RlConfig}
REQUIRED = {"eval": ["checkpoint=x"], "leaderboard": ["checkpoint=x", "bench=y", "baseline=z"]}


def compose_config(command: str, overrides: list[str]):
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        return compose(command, overrides=[*REQUIRED.get(command, []), *overrides])


def yaml_keys_match_fields(section: dict, schema: type, where: str) -> None:
    """The keys a YAML section writes are its dataclass's fields, recursively into sections."""
    hints = typing.get_type_hints(schema)
    fields = {f.name for f in dataclasses.fields(schema)}
    assert set(section) == fields, f"{where}: YAML keys vs {schema.__name__} fields"
    for name, value in section.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[name]):
            yaml_keys_match_fields(value, hints[name], f"{where}.{name}")


@pytest.mark.parametrize("command", SCHEMAS)
def test_every_field_of_a_schema_is_a_key_of_its_yaml(command):
    raw = yaml.safe_load((CONFIG_DIR / f"{command}.yaml").read_text())
    groups = {next(iter(d)) for d in raw.pop("defaults")
              if isinstance(d, dict) and not next(iter(d)).startswith("override hydra/")} - {"experiment"}
    raw.pop("hydra")
    yaml_keys_match_fields({**raw, **dict.fromkeys(groups)}, SCHEMAS[command], command)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIG_DIR / "engine").glob("*.yaml")))
@pytest.mark.parametrize("command", ["eval", "leaderboard", "usl"])
def test_every_engine_option_is_its_schema_and_composes_for_each_scoring_command(command, option,
                                                                                 tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "engine" / f"{option}.yaml").read_text())
    if option == "local":  # one process: no Ray setting applies
        assert raw == {"name": "local"}
    else:
        yaml_keys_match_fields(raw, EngineConfig, f"engine/{option}")
    run = settings(compose_config(command, [f"engine={option}", f"paths.root_dir={tmp_path}"]))
    assert isinstance(run.engine, EngineConfig) and run.engine.name == option


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIG_DIR / "benchmark").glob("*.yaml")))
def test_every_benchmark_option_is_its_schema_and_composes(option, tmp_path):
    raw = yaml.safe_load((CONFIG_DIR / "benchmark" / f"{option}.yaml").read_text())
    yaml_keys_match_fields(raw, BenchmarkConfig, f"benchmark/{option}")
    run = settings(compose_config("eval", [f"benchmark={option}", f"paths.root_dir={tmp_path}"]))
    assert isinstance(run.benchmark, BenchmarkConfig) and run.benchmark.name == option
    assert run.benchmark.path == f"{tmp_path}/data/benchmarks/{option}"  # where the docs download it
    assert run.criteria is None and settings(compose_config("eval", [])).benchmark is None


@pytest.mark.parametrize("command, override", [
    ("train", "optim.lr=fast"), ("train", "stream.max_token=512"), ("train", "template.pairwse=x"),
    ("train", "model.vocab_size=big"), ("train", "loss=ranking loss.margin=wide"),
    ("train", "transform.redraw_each_epoch=perhaps"), ("eval", "batch_size=big"),
    ("leaderboard", "interval.resamples=many"), ("usl", "port=http"), ("usl", "limits.line=3"),
    ("plan", "trainer.devices=auto"), ("plan", "model.attentoin=sdpa"), ("plan", "prompt_share=most"),
    ("rl", "grpo.max_steps=many"), ("rl", "guards.bta=0.1"),
])
def test_a_wrong_type_or_an_unknown_key_stops_the_composition(command, override):
    with pytest.raises(ConfigCompositionException):
        compose_config(command, override.split())


@pytest.mark.parametrize("overrides, message", [
    (["transform.ties=maybe"], "transform ties='maybe'"),
    (["transform.swap_prob=1.5"], "swap_prob=1.5: expected a probability"),
    (["model.dtype=int8"], "model.dtype=int8: expected one of float32"),
    (["loss.kind=listwise"], "loss.kind=listwise"),
    (["noise.name=loud"], "noise=loud"),
    (["direction=curriculum", "direction.then=sideways"], "direction.then=sideways"),
    (["logger.name=tensorboard"], "logger 'tensorboard'"),
    (["preemption.signal=SIGFOO"], "preemption.signal=SIGFOO: not a signal name"),
    (["template.criterion='{answer}'"], "template criterion: KeyError\\('answer'\\)"),
    (["data=shards"], "data.path: required, and not set"),
    (("eval", ["criteria=[]"]), "criteria=\\[\\]: null .*, none"),
    (("eval", ["benchmark=pairs", "benchmark.name=arena"]), "benchmark=arena: expected one of"),
    (("eval", ["benchmark=rmbench", "benchmark.criteria.chat=[]"]),
     "benchmark.criteria.chat: a non-empty list"),
    (("usl", ["serve.max_body=0"]), "serve.max_body=0: expected a number > 0"),
    (("usl", ["serve.read_timeout=-1"]), "serve.read_timeout=-1.0: expected a number > 0"),
])
def test_a_value_outside_a_keys_choices_is_a_config_error(overrides, message):
    command, overrides = overrides if isinstance(overrides, tuple) else ("train", overrides)
    cfg = compose_config(command, overrides)
    with pytest.raises(ConfigError, match=message):
        settings(cfg)


def test_the_scorer_commands_refuse_an_unknown_dtype_and_a_missing_checkpoint():
    with pytest.raises(ConfigError, match="dtype=int8: expected auto, float32"):
        settings(compose_config("eval", ["dtype=int8"]))
    with pytest.raises(ConfigError, match="checkpoint: required"):
        settings(compose_config("leaderboard", ["checkpoint=???"]))


def test_each_section_reaches_its_reader_as_that_readers_dataclass(tmp_path):
    run = settings(compose_config("train", [f"paths.root_dir={tmp_path}", "loss=ranking",
                                            "template.system=Judge."]))
    expected = {"model": ModelConfig, "loss": LossConfig, "optim": OptimConfig,
                "parallel": ParallelConfig, "logger": LoggerConfig, "stream": StreamSettings,
                "transform": TransformSettings, "template": PromptTemplate}
    assert {k: type(getattr(run, k)) for k in expected} == expected
    assert run.template == PromptTemplate(system="Judge.")  # null fields keep crm's wording
    assert run.loss.margin == 0.0 and run.loss.kind == "pointwise"
    assert run.data.demo.out_dir == f"{tmp_path}/.cache/demo"  # interpolations resolved
    usl = settings(compose_config("usl", [f"paths.root_dir={tmp_path}", "limits.lines=3"]))
    assert usl.limits == Limits(lines=3, chars=2000) and usl.interval == Bootstrap()
    # the HTTP guards' bounds have one source, the YAML's `serve`: crm-usl's and HttpLimits()'s alike
    assert isinstance(usl.serve, HttpLimits)
    assert HttpLimits(**{f.name: getattr(usl.serve, f.name) for f in dataclasses.fields(HttpLimits)}) == \
        HttpLimits()
