"""Configuration errors as one line naming the command, exit 2: a setting that cannot work or a bad
line of an input file (`one_line_config_errors`, around a command's task) and Hydra's own
composition errors (`install`, which every Hydra command's import runs)."""
from __future__ import annotations

import difflib
import functools
import os
import sys
from pathlib import Path

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from crm.core.errors import ConfigError, ShardError
from crm.core.records import RecordError


def one_line_config_errors(task):
    """Wraps a Hydra task: a ConfigError (a setting that cannot work), a RecordError (a bad line
    of an input file) or a ShardError (a shard that cannot be read) is printed as one line and
    exits 2; Hydra would print it inside a traceback.
    Real crashes keep theirs."""
    @functools.wraps(task)
    def run(cfg: DictConfig):
        _task_started.append(task.__name__)
        try:
            return task(cfg)
        except (ConfigError, RecordError, ShardError) as exc:
            print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
            sys.exit(2)
    return run


# -- Hydra's own errors as one line --------------------------------------------------------------
# An unknown key, a value of the wrong type, a config group option that does not exist, an override
# that does not parse: Hydra prints them over several lines, suggests `+key=value` for a misspelt
# key (which then fails later, inside the code the key was meant for) and exits 1. `install` routes
# the entry points' Hydra run through `one_line`; it runs when this module is imported, as every
# Hydra command does. HYDRA_FULL_ERROR=1 keeps Hydra's own report (and its stack trace).

def install() -> None:
    """Hydra's `run_and_report` (which runs composition and the task) with `one_line` inside it."""
    from hydra._internal import utils

    if getattr(utils.run_and_report, "crm_one_line", False):
        return
    original = utils.run_and_report

    def run_and_report(func):
        return original(lambda: one_line(func))

    run_and_report.crm_one_line = True
    utils.run_and_report = run_and_report


def one_line(func):
    """func(), with a Hydra composition error printed as one line naming the command; exit 2.

    A crash inside a command stays a crash: only Hydra's own exceptions (composition, override
    parsing, instantiating a user's `_target_`) are a user's mistake."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return func()
    _task_started.clear()
    try:
        return func()
    except HydraException as exc:
        print(f"{Path(sys.argv[0]).name}: {describe(exc)}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        if _task_started:  # the command's own: a crash keeps its traceback
            raise
        # Hydra makes the run dir before the task starts: CRM_ROOT unwritable, or under a file.
        root = os.environ.get("CRM_ROOT", ".")
        print(f"{Path(sys.argv[0]).name}: {exc.filename or ''}: {exc.strerror or exc}: the run dir "
              f"cannot be made under CRM_ROOT={root}: set CRM_ROOT (or hydra.run.dir=) to a "
              "directory you can write", file=sys.stderr)
        sys.exit(2)


_task_started: list[str] = []  # set by one_line_config_errors: an OSError after it is no setup error


def describe(exc: HydraException) -> str:
    """One line: the key at fault, what is wrong with it, and the nearest key that exists."""
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        reason = _first_line(cause.msg if hasattr(cause, "msg") else str(cause))
        key = cause.full_key
        if "not in" in reason or "not in struct" in reason:
            return f"{key}: no such key{_nearest(key, cause.parent_node)}"
        if "is not a ListConfig" in reason:  # key=a.jsonl for key=[a.jsonl]
            return f"{key}: a list: write {key}=[...], e.g. {key}=[a.jsonl,b.jsonl]"
        if "is not a subclass of" in reason:  # key=5 for a group such as suggest_votes.pairs=5
            node = cause.parent_node.get(key.rpartition(".")[2]) if cause.parent_node else None
            fields = [f"{key}.{k}" for k in node.keys()] if hasattr(node, "keys") else []
            return (f"{key}: a group of keys, not one value: set "
                    f"{' or '.join(fields) or 'its keys (--cfg job lists them)'}")
        return f"{key}: {reason}"
    if isinstance(exc, OverrideParseException):
        # Hydra's grammar takes letters, digits and a few symbols unquoted: an emoji, a space or
        # a quote mark in a value needs the value quoted, and its message does not say so.
        return (f"{exc.override}: not an override Hydra can read; quote a value holding spaces, "
                "emoji or punctuation: 'key=\"value\"' (docs/COMMANDS.md)")
    if isinstance(exc, MissingConfigException):
        options = getattr(exc, "options", None)
        found = f" (options: {', '.join(options)})" if options else ""
        return f"{_first_line(str(exc))}{found}"
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def _nearest(full_key: str, parent) -> str:
    """' (did you mean X?)' for the closest existing key beside `full_key`, else a pointer to
    --cfg job. Under `trainer` (Lightning Trainer arguments, a free dict) the Trainer's own
    arguments count as existing: `+trainer.NAME=` adds one the group does not set."""
    prefix, _, name = full_key.rpartition(".")
    keys = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
    match = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    if not match:  # another command's short name for a key (crm-eval's data.test: data.test_files)
        match = [key for key in keys if key.startswith(name)][:1] if name else []
    if not match and prefix == "trainer":
        # Lightning's arguments only when the group's own keys hold no near name: most slips are
        # of a key the group sets (max_stepz), and that key is the one to name.
        from crm.training.checks import trainer_arguments

        match = difflib.get_close_matches(name, [*keys, *trainer_arguments()], n=1, cutoff=0.6)
    dotted = f"{prefix}." if prefix else ""
    if match and prefix == "trainer" and match[0] not in parent:
        return f" (did you mean +{dotted}{match[0]}=...? a Trainer argument the group does not set)"
    if match:
        return f" (did you mean {dotted}{match[0]}?)"
    return " (--cfg job lists the keys)"


install()
