"""Stand-ins for modules of the RL trainers' GPU stack that `make install` does not install.

verl imports ray at module level everywhere (verl/protocol.py, its reward loop), but the code the
tests drive (config loading, the reward loop worker, DataProto) never calls it on this path. A
stub answers every `ray` and `ray.*` import with a MagicMock; anything that did call ray would get
a mock back, not a cluster. Used only where the real package is missing (the dev extra installs
ray, for engine=ray: then verl imports the real one), and only inside a `with stubbed(...)` block.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from unittest import mock


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []  # a package: `from ray.util.x import y` resolves too
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def stubbed(*names: str):
    """Stub each top-level module in `names` that is not installed, inside the block only: other
    tests' probes for ray (lightning, transformers) must not find a MagicMock."""
    stub = _Stub(tuple(n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None))
    if not stub.names:
        yield
        return
    sys.meta_path.append(stub)
    try:
        yield
    finally:
        sys.meta_path.remove(stub)
        for name in [m for m in sys.modules if m.split(".")[0] in stub.names]:
            del sys.modules[name]  # what imported it keeps its reference
