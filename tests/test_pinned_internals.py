"""Private internals of pinned libraries that crm replaces or subclasses, checked on the real
objects of the installed versions: each still exists and is still what the library calls, so that
an upgrade that renames or bypasses one fails here instead of silently doing nothing.

- Lightning: the epoch loop's `_broadcast_sigterm_tensor` (crm.training.preemption) and
  `_should_check_val_fx`, `_should_check_val_epoch`, `_should_accumulate`, the fit loop's
  `_can_stop_early` (crm.training.trainer.validate_on_step_boundaries); `Trainer.__init__`'s
  arguments, which crm.training.checks.trainer_arguments reads from Lightning's source without
  importing it; the environment variables Lightning reads a launcher's rank from, in its order
  (crm.cli.train.launcher_rank);
- uvicorn: H11Protocol's hooks and attributes that crm.core.http's deadline uses;
- Gradio: Blocks.queue's arguments and Blocks.validate_inputs, looked up on the instance
  (crm.app.page); the queue's and the state holder's per-session stores that crm.app.guards'
  Sessions drops;
- Hydra: hydra._internal.utils.run_and_report, looked up by name when a command runs
  (crm.cli.errors.install).
"""
from __future__ import annotations

import asyncio
import inspect
import types
import typing

import pytest


def calls(function, name: str) -> bool:
    """Whether `function`'s source calls `self.<name>(` or `<name>(`: the lookup a replacement
    relies on."""
    source = inspect.getsource(function)
    return f"self.{name}(" in source or f" {name}(" in source


def test_lightnings_loop_internals_that_crm_replaces_are_what_it_calls(tmp_path):
    import lightning as L
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=str(tmp_path))
    loop = trainer.fit_loop.epoch_loop
    for name in ("_broadcast_sigterm_tensor", "_should_check_val_fx", "_should_check_val_epoch",
                 "_should_accumulate"):
        assert callable(getattr(loop, name, None)), f"_TrainingEpochLoop.{name} is gone"
    assert isinstance(trainer.fit_loop._can_stop_early, bool)
    # The epoch loop calls both through the instance, so replacing them there takes effect.
    source = inspect.getsource(_TrainingEpochLoop)
    assert "self._broadcast_sigterm_tensor()" in source
    assert "self._should_check_val_fx(" in source
    assert list(inspect.signature(loop._should_check_val_fx).parameters) == ["data_fetcher"]


def annotation_shape(annotation):
    """An annotation as nested tuples, a class as its module and name: the real one and the source
    reader's stand-in compare equal when they name the same class. A Union's members as a set:
    typing caches equal Unions, so `Union[int, float]` can come back as an earlier `Union[float,
    int]` of the same process (seen in the suite, never alone)."""
    origin = typing.get_origin(annotation)
    if origin is types.UnionType or origin is typing.Union:
        return ("Union", frozenset(annotation_shape(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return ("Literal", typing.get_args(annotation))
    if origin is not None:
        return (annotation_shape(origin), tuple(annotation_shape(a) for a in typing.get_args(annotation)))
    if inspect.isclass(annotation):
        return (annotation.__module__, annotation.__qualname__)
    return annotation


# Every kind of value a YAML setting can hold, and the strings and numbers Lightning's Literals take.
YAML_VALUES = [None, True, False, 0, 1, 32, 16, -1, 0.25, 2.0, "x", "warn", "16-mixed", "bf16",
               "64", "00:01:00", "auto", "cpu", [], [0, 1], ["a"], [0.5], {}, {"hours": 1}]


def test_the_trainer_arguments_read_from_lightnings_source_are_its_type_hints():
    """crm-train checks `trainer.` keys against Trainer.__init__ read with `ast` (a refused setting
    answers without importing Lightning): on the pinned version the names, the annotations and what
    each accepts are the real object's, so a change of shape in an upgrade fails here."""
    import lightning as L

    from crm.training.checks import fits, trainer_arguments, type_name

    real = typing.get_type_hints(L.Trainer.__init__)
    real.pop("return", None)
    read = trainer_arguments()
    assert list(read) == list(real)
    assert {name: annotation_shape(a) for name, a in read.items()} == {
        name: annotation_shape(a) for name, a in real.items()}
    for name, annotation in real.items():
        wording = (type_name(read[name]), type_name(annotation))
        assert sorted(wording[0].split(" or ")) == sorted(wording[1].split(" or ")), name
        for value in YAML_VALUES:
            assert fits(value, read[name]) == fits(value, annotation), (name, value)


def test_the_launcher_rank_is_read_as_lightning_reads_it(monkeypatch):
    from lightning.fabric.utilities.rank_zero import _get_rank

    from crm.cli.train import RANK_VARIABLES, launcher_rank

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank() == (_get_rank() or 0) == 0
    for value, name in enumerate(reversed(RANK_VARIABLES), start=1):  # the first in the order wins
        monkeypatch.setenv(name, str(value))
        assert launcher_rank() == _get_rank() == value


def test_uvicorns_h11_protocol_has_the_hooks_the_head_deadline_uses():
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.server import ServerState

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    loop = asyncio.new_event_loop()
    try:
        protocol = H11Protocol(config=uvicorn.Config(app), server_state=ServerState(), app_state={},
                               _loop=loop)
        for name in ("connection_made", "on_response_complete", "connection_lost"):
            assert callable(getattr(protocol, name, None)), f"H11Protocol.{name} is gone"
        for name in ("loop", "cycle", "transport", "client"):
            assert hasattr(protocol, name) or name in inspect.getsource(H11Protocol), name
        assert protocol.loop is loop and protocol.cycle is None
        # a response's end calls the hook crm re-arms the deadline from
        assert calls(H11Protocol, "on_response_complete")
    finally:
        loop.close()


def test_gradios_queue_and_validate_inputs_are_what_blocks_call():
    gr = pytest.importorskip("gradio")

    with gr.Blocks() as page:
        gr.Textbox()
    parameters = inspect.signature(page.queue).parameters
    assert {"max_size", "default_concurrency_limit"} <= set(parameters)
    assert list(inspect.signature(page.validate_inputs).parameters)[:2] == ["block_fn", "inputs"]
    assert "self.validate_inputs(" in inspect.getsource(gr.Blocks)
    page.queue()
    queue = page._queue
    for store in ("pending_messages_per_session", "pending_event_ids_session",
                  "event_ids_to_events"):
        assert hasattr(getattr(queue, store), "pop"), store
    from gradio.state_holder import StateHolder

    holder = StateHolder()
    assert {"session_data", "time_last_used", "lock"} <= set(vars(holder))
    assert list(inspect.signature(holder.delete_state).parameters)[:1] == ["session_id"]


def test_hydras_run_and_report_is_looked_up_by_name_when_a_command_runs():
    from hydra._internal import utils

    assert callable(utils.run_and_report)
    assert list(inspect.signature(utils.run_and_report).parameters) == ["func"]
    # _run_hydra reads the module's global at call time: crm's replacement of it is what runs
    assert calls(utils._run_hydra, "run_and_report")
