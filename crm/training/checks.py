"""crm-train's checks at start: what Lightning, the model or the data would refuse only later (after
the tokenizer is trained, inside a traceback) is a ConfigError before anything runs, and settings
that run but do not fit the data or the run are one warning line each (docs/DESIGN.md section 6)."""
from __future__ import annotations

import ast
import builtins
import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import typing
from pathlib import Path

from crm.core.errors import ConfigError

if typing.TYPE_CHECKING:
    from crm.data.transforms import TransformConfig

log = logging.getLogger(__name__)

# Trainer arguments crm-train sets itself, and the key that sets each.
SET_BY_CRM = {"accumulate_grad_batches": "global_batch_size", "callbacks": "callbacks",
              "logger": "logger", "val_check_interval": "val_every_n_steps",
              "check_val_every_n_epoch": "val_every_n_steps", "default_root_dir": "paths.output_dir"}


def check_trainer(trainer: dict) -> None:
    """The trainer group against Lightning's Trainer: a name it does not take, one crm-train sets
    itself, a value of the wrong type (`trainer.max_steps=ten`). (A GPU accelerator where there is
    none is refused where the device is decided, crm.training.resolve.device_type.)"""
    hints = trainer_arguments()
    for key, value in trainer.items():
        if key in SET_BY_CRM:
            raise ConfigError(f"trainer.{key}: crm-train sets it from {SET_BY_CRM[key]}; set that")
        if key not in hints:
            near = difflib.get_close_matches(key, list(hints), n=1)
            hint = f" (did you mean trainer.{near[0]}?)" if near else ""
            raise ConfigError(f"trainer.{key}: not an argument of Lightning's Trainer{hint}")
        if not fits(value, hints[key]):
            raise ConfigError(f"trainer.{key}={value!r}: expected {type_name(hints[key])}")


@functools.cache
def trainer_arguments() -> dict:
    """Lightning Trainer's arguments and their annotations: the names a `trainer.` key may take.

    Read from Lightning's installed source, not imported: importing Lightning costs 4 s (with
    torch), and a refused setting answers within a second or two (docs/DESIGN.md section 6). The
    annotations are the typing objects `typing.get_type_hints(Trainer.__init__)` gives, Lightning's
    own classes as stand-ins of the same name (no YAML value is an instance of either);
    tests/test_pinned_internals.py compares the two on the pinned version, and a source this reader
    cannot follow raises instead of accepting everything."""
    source = _ModuleSource("lightning")
    init = source.method("lightning.pytorch.trainer.trainer", "Trainer", "__init__")
    args = init.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return {arg.arg: source.annotation(arg.annotation, "lightning.pytorch.trainer.trainer")
            for arg in named[1:] if arg is not None and arg.annotation is not None}


class _ModuleSource:
    """A package's modules parsed, not imported. A name is followed as Python would bind it at the
    top of its module: through `from X import Y` (relative too) to a class (a stand-in class of that
    name and module) or a module-level assignment (a type alias, evaluated where it stands); a name
    from the standard library is its real object; anything else (another package, a conditional
    definition, an expression other than a name, subscript, `|` or constant) raises LookupError."""

    def __init__(self, package: str):
        spec = importlib.util.find_spec(package)  # a top-level name: found without importing it
        if spec is None or not spec.submodule_search_locations:
            raise LookupError(f"{package} is not an installed package")
        self.package, self.root = package, Path(spec.submodule_search_locations[0])
        self.trees: dict[str, tuple[ast.Module, bool]] = {}
        self.stand_ins: dict[tuple[str, str], type] = {}

    def tree(self, module: str) -> tuple[ast.Module, bool]:
        """The module's syntax tree and whether it is a package (its __init__.py)."""
        if module not in self.trees:
            folder = self.root.joinpath(*module.split(".")[1:])
            is_package = (folder / "__init__.py").is_file()
            path = folder / "__init__.py" if is_package else folder.with_suffix(".py")
            if not path.is_file():
                raise LookupError(f"{module}: no source at {path}")
            self.trees[module] = ast.parse(path.read_text(encoding="utf-8")), is_package
        return self.trees[module]

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef:
        for node in self.tree(module)[0].body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == name:
                        return item
        raise LookupError(f"{module}: no {cls}.{name} at the top of its source")

    def annotation(self, node: ast.expr, module: str):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a forward reference
            node = ast.parse(node.value, mode="eval").body
        return self.evaluate(node, module)

    def evaluate(self, node: ast.expr, module: str):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.lookup(module, node.id)
        if isinstance(node, ast.Subscript):
            index = node.slice
            args = (tuple(self.evaluate(e, module) for e in index.elts)
                    if isinstance(index, ast.Tuple) else self.evaluate(index, module))
            return self.evaluate(node.value, module)[args]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return typing.Union[self.evaluate(node.left, module), self.evaluate(node.right, module)]
        raise LookupError(f"{module}: cannot read `{ast.unparse(node)}` without importing it")

    def lookup(self, module: str, name: str):
        """What `name` is bound to at the top of `module`: its last top-level binding, else a
        builtin."""
        tree, is_package = self.tree(module)
        for node in reversed(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                key = (module, name)
                if key not in self.stand_ins:
                    self.stand_ins[key] = type(name, (), {"__module__": module, "__qualname__": name})
                return self.stand_ins[key]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return self.evaluate(node.value, module)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        package = module if is_package else module.rpartition(".")[0]
                        origin = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                             package)
                        return self.imported(origin, alias.name)
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise LookupError(f"{module}: {name} is not bound at the top of its source")

    def imported(self, module: str, name: str):
        top = module.partition(".")[0]
        if top == self.package:
            return self.lookup(module, name)
        if top in sys.stdlib_module_names:  # typing, datetime, pathlib: cheap, and the real objects
            return getattr(importlib.import_module(module), name)
        raise LookupError(f"{name} comes from {module}, outside {self.package} and the standard "
                          "library")


def fits(value, annotation) -> bool:
    """Whether a YAML value can be `annotation` (int, float, bool, str, Optional, Union, Literal,
    list); a type a YAML value cannot hold (a Logger, a timedelta) accepts anything, Lightning
    checks those."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if origin is typing.Union:
        return any(fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if inspect.isclass(annotation):  # a Logger, a timedelta: no YAML value is one
        return isinstance(value, annotation)
    return True  # an abstract collection (Iterable[Logger]) and such: Lightning checks those


def type_name(annotation) -> str:
    names = []
    for arg in typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else [annotation]:
        if typing.get_origin(arg) is typing.Literal:
            names += [repr(a) for a in typing.get_args(arg)]
        elif arg is type(None):
            names.append("null")
        else:
            names.append(getattr(arg, "__name__", str(arg)))
    return " or ".join(names)


def _ties_left_out(run, ties: int) -> str:
    """What leaves `ties` tie records out of the run, and the setting that trains them."""
    if run.loss.kind == "pointwise":  # a Bradley-Terry CRM with keep is refused: the fix is the loss
        return (f"transform.ties=drop leaves out the {ties} ties; loss.ties=davidson "
                "transform.ties=keep trains them (Bradley-Terry with ties)")
    return (f"transform.ties=drop leaves out the {ties} ties; transform.ties=keep trains them (a "
            "3-way head that can say tie)")


def check_data_fits(run, shard_dir: Path, run_dir: Path, world: int,
                    transform: TransformConfig | None = None) -> None:
    """Before the tokenizer is trained on them: shards with no training record, or with fewer
    validation records than ranks in a run that validates, ties kept by a pointwise CRM,
    README-format records under a
    `transform` whose direction needs the losing side's criteria, or noise that draws from a
    criteria pool the manifest lacks (read from the manifest, so refused in seconds, not after
    the tokenizer), are refused; a global batch larger than the data, a validation split too
    small to mean anything, tie records that `transform.ties=drop` leaves out, a curriculum warm-up
    as long as the run, validation or save intervals past the run's last step and a run dir that
    will be resumed are one warning line each."""
    from crm.data.manifest import load_manifest
    from crm.data.transforms import check_one_sided, draws_from_pool

    manifest = load_manifest(shard_dir)
    if transform is not None and manifest.one_sided:
        check_one_sided(transform)
    if (transform is not None and manifest.criteria_pool is None
            and draws_from_pool(transform.noise, manifest.one_sided)):
        # The stream would refuse it too, but only inside fit, after the tokenizer, as a traceback.
        raise ConfigError(f"noise={transform.noise} draws criteria from the manifest's criteria_pool, "
                          f"which {manifest.path} lacks (a manifest not "
                          "written by `crm-data shard`): re-shard the data, or train with "
                          "noise=none or remove")
    keep_ties = run.transform.ties == "keep"
    if keep_ties and run.loss.kind == "pointwise" and run.loss.ties == "none":
        # The stream would refuse it too, but only inside fit, after the tokenizer, as a traceback.
        ties = sum(s.ties for shards in manifest.splits.values() for s in shards)
        raise ConfigError(f"transform.ties=keep with a pointwise CRM (loss=ranking), whose pair needs "
                          f"a winner: it cannot learn the data's {ties} ties; keep them with "
                          "loss.ties=davidson (Bradley-Terry with ties) or loss=cls (a 3-way head "
                          "that can say tie), or set transform.ties=drop")
    train, val = ({} if split not in manifest.splits else manifest.splits[split]
                  for split in ("train", "val"))
    n_train = sum(s.eligible(keep_ties) for s in train)
    n_val = sum(s.eligible(keep_ties) for s in val)
    dropped = {split: 0 if keep_ties else sum(s.ties for s in shards)
               for split, shards in (("train", train), ("val", val))}
    where = f"data.path={run.data.path}" if not run.data.demo else f"the demo data ({shard_dir})"
    if n_train < world:
        raise ConfigError(f"{where}: {n_train} training records (manifest.json), fewer than the "
                          f"{world} rank(s); " + (_ties_left_out(run, dropped["train"]) if dropped["train"]
                                                  else f"did every line go to {shard_dir}/rejects.jsonl?"))
    validates = run.trainer.get("limit_val_batches", 1.0) != 0
    if validates and n_val < world:
        # Lightning builds the validation loader at fit's start, even when no step validates; an
        # empty split is refused there only after the tokenizer is trained, inside a traceback.
        ties = f" ({_ties_left_out(run, dropped['val'])})" if dropped["val"] else ""
        raise ConfigError(f"{where}: {n_val} validation records (manifest.json){ties}, fewer than "
                          f"the {world} rank(s): re-shard with --val-fraction 0.2 (`crm-data shard "
                          "FILE.jsonl DIR --val-fraction 0.2`), or train without validation: "
                          "+trainer.limit_val_batches=0 (no val/loss, no best checkpoint, no early "
                          "stopping: the export is the final weights)")
    if dropped["train"]:
        # The stream skips them without a word: a user who made tie records (crm-data criteria's
        # tie criteria) would train a CRM that never says tie.
        log.warning("%s: %d of the %d training records are ties: %s", where, dropped["train"],
                    n_train + dropped["train"], _ties_left_out(run, dropped["train"]))
    if run.global_batch_size > n_train:
        log.warning("global_batch_size=%d is larger than the %d training records: each optimizer "
                    "step repeats records; for a small set use a global batch of about a tenth of "
                    "it", run.global_batch_size, n_train)
    if validates and n_val < min(4, n_train):  # 5% of a few dozen records: one or two
        log.warning("the validation split holds %d record(s): val/loss, the best checkpoint and "
                    "early stopping rest on them; re-shard with a larger --val-fraction "
                    "(e.g. 0.2) for a small set", n_val)
    steps = run.trainer.get("max_steps", -1)
    direction = run.direction
    if direction.then and steps and 0 < steps <= direction.warmup_steps:
        log.warning("direction=%s: warmup_steps=%d is not shorter than trainer.max_steps=%d: the "
                    "whole run trains on direction %s, never %s; set direction.warmup_steps to a "
                    "fraction of the run", direction.name, direction.warmup_steps, steps,
                    direction.warmup, direction.then)
    if validates and steps and steps > 0 and run.val_every_n_steps > steps:
        log.warning("val_every_n_steps=%d is past trainer.max_steps=%d: the run never validates "
                    "(no val/loss; the export is the final weights, not the best); set it below, e.g. "
                    "val_every_n_steps=%d", run.val_every_n_steps, steps, max(1, steps // 5))
    if steps and steps > 0 and run.save_every_n_steps > steps:
        log.warning("save_every_n_steps=%d is past trainer.max_steps=%d: no last.ckpt is saved "
                    "while the run trains, so a crash resumes from nothing; set it below, e.g. "
                    "save_every_n_steps=%d", run.save_every_n_steps, steps, max(1, steps // 5))
    last = run_dir / "checkpoints" / "last.ckpt"
    if run.resume == "auto" and last.exists():
        log.warning("name=%s: %s holds a checkpoint of an earlier run: this run resumes it "
                    "(another name=, or resume=false, starts over)", run.name, last)
