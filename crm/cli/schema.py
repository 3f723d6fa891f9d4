"""How a command's config schema is declared and checked, and the `paths` group every command has.

Every Hydra command declares its config once, as dataclasses (docs/DESIGN.md section 6): a field
is one line in a dataclass (its type and, for a library's own dataclass, its default) and one line
in the YAML (its value and the comment that documents it). `register_schema` stores the command's
dataclass in Hydra's ConfigStore as `<command>_schema`, which configs/<command>.yaml lists first
in its defaults: Hydra merges the YAML and the overrides onto it, so a value of the wrong type or
a key the schema lacks stops the composition. `settings` then turns the composed config into
those dataclasses, whose own checks (`__post_init__`) refuse a value that cannot work.

The schema's dataclasses come from each layer's torch-free `config` module (crm.models.config,
...): a command composes and checks its config, and answers `--help`, before torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from crm.core.errors import ConfigError
from crm.core.records import load_records


def register_schema(command: str, schema: type) -> None:
    """`schema` as the config `<command>_schema`, named first in configs/<command>.yaml's defaults.

    A library's frozen dataclass (OptimConfig, Bootstrap, ...) makes its OmegaConf node read-only,
    and the YAML could not be merged onto it: the stored node is made writable. The objects a
    command gets (`settings`) are the frozen dataclasses again.
    """
    node = OmegaConf.structured(schema)
    _make_writable(node)
    ConfigStore.instance().store(name=f"{command}_schema", node=node, provider="crm")


def _make_writable(node: DictConfig | ListConfig) -> None:
    OmegaConf.set_readonly(node, False)
    for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        child = node[key]
        if isinstance(child, (DictConfig, ListConfig)):
            _make_writable(child)


def settings(cfg: DictConfig):
    """The composed config as its schema's dataclasses: every group and section a typed object.

    A value the dataclasses' own checks refuse, or a required value (`???`) left unset, is a
    ConfigError (one line, exit 2), before the command does anything.
    """
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{exc.full_key}: required, and not set (add {exc.full_key}=... to the "
                          "command line)") from None
    except ValueError as exc:
        if hasattr(exc, "full_key"):  # OmegaConf's own: its message spans several lines
            raise
        raise ConfigError(str(exc)) from None


@dataclass
class PathsConfig:
    """configs/paths/default.yaml: where runs and caches live."""

    root_dir: str = MISSING
    cache_dir: str = MISSING
    output_dir: str = MISSING


def benchmark_config(name: str, path: str):
    """configs/benchmark/<name>.yaml with `path` set: a benchmark that crm-train's `benchmarks`
    names, with the criteria crm-eval's `benchmark=<name>` would use."""
    import crm_configs
    from crm.evaluation.benchmarks import LAYOUTS, BenchmarkConfig

    if name not in LAYOUTS:
        raise ConfigError(f"benchmarks.{name}: not a benchmark; one of {', '.join(LAYOUTS)}")
    yaml_file = Path(crm_configs.__file__).parent / "benchmark" / f"{name}.yaml"
    node = OmegaConf.merge(OmegaConf.structured(BenchmarkConfig), OmegaConf.load(yaml_file),
                           {"path": str(path)})
    return settings(node)


def check_test_files(paths, key: str) -> None:
    """Test-format files, read whole before any model loads or trains (crm-eval's `data.test`,
    crm-train's `data.test_files`): a missing file names `key`, and every bad record of every
    file is one BadRecords line (file:line: field: reason) with the format it wants."""
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"{key}: {path}: no such file (test-format JSONL files, the README "
                              "format: docs/DESIGN.md section 3.1)")
    for path in paths:
        load_records(path, "test")
