"""The Python API (crm/__init__.py, README "Python API"): every exported name resolves to what its
module defines, and the README's example runs. The exports load lazily: tests/test_layers.py
checks that importing crm.core loads no torch."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from scorers import export_tiny, tiny_scorer

import crm

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("name", crm.__all__)
def test_every_exported_name_is_its_modules_own(name):
    module = importlib.import_module(crm._EXPORTS[name])
    assert getattr(crm, name) is getattr(module, name)
    assert getattr(crm, name).__module__ == module.__name__  # defined there, not re-exported


def test_all_dir_and_the_exports_agree():
    assert crm.__all__ == list(crm._EXPORTS)
    assert set(crm.__all__) <= set(dir(crm))
    with pytest.raises(AttributeError, match="no attribute 'CRMScorre'"):
        crm.CRMScorre


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """The README's Python API block, on a tiny CRM saved where the demo's would be."""
    from crm.data.demo import write_demo
    from crm.models.checkpoint import CARD, PREFIX, describe

    monkeypatch.chdir(tmp_path)
    export_tiny(tmp_path / "outputs" / "demo" / "export")
    scorer = tiny_scorer()
    (tmp_path / "outputs" / "demo" / "checkpoints").mkdir()
    torch.save({"state_dict": {PREFIX + k: v for k, v in scorer.model.state_dict().items()},
                CARD: describe(scorer.model, scorer.tokenizer, kind="pairwise",
                               template=scorer.template, max_tokens=1000), "global_step": 3},
               tmp_path / "outputs" / "demo" / "checkpoints" / "last.ckpt")
    write_demo(tmp_path / ".cache" / "demo" / "raw", n_train=4, n_test=4, n_bench=2)
    (example,) = re.findall(r"## Python API\n.*?```python\n(.*?)```", README.read_text(), re.S)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert 0.0 <= float(scope["p"]) <= 1.0 and scope["board"]["models"]
    assert scope["loaded"].kind == "pairwise" and scope["rest"]["global_step"] == 3
    assert (tmp_path / "my-export" / "crm.json").is_file()
