"""The compiled path as a GPU user runs it, on CPU: flash-attn installed (a stand-in package of its
functions' signatures), one-row and four-row micro batches, bf16 parameters and bf16 autocast,
training and scoring, with only batch and sequence dynamic in the captured graphs.

The layers are compiled with a backend that keeps each captured graph and runs it through
aot_eager (autocast) or as captured (bf16 parameters): capture, guards, recompiles and autograd
are what breaks on a GPU (a graph break, a data-dependent branch, a recompile per shape) and they
are the same here, without generating kernels (tests/models/test_compile.py compiles with
inductor). One model per precision is built and compiled once for this module.
"""
from __future__ import annotations

import contextlib
import sys
import textwrap

import pytest
import torch
from helpers import COMPILE_ARCH, tiny_tokenizer

from crm.core.prompts import PromptTemplate
from crm.data.padding import pad_rows
from crm.inference.scorer import CRMScorer
from crm.models import backbone
from crm.models import compile as compiling
from crm.models.factory import LossConfig, ModelConfig, build_crm

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STAND_IN = '''
"""flash-attn 2 as far as a test needs it: its functions' signatures, attention computed by torch.

Layout (batch, sequence, heads, head size), fewer key/value heads than query heads allowed; every
call is recorded in `calls`."""
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

__version__ = "2.8.3"
calls = []


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    calls.append("flash_attn_func")
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
               scale=softmax_scale, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **kwargs):
    calls.append("flash_attn_varlen_func")
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        rows = [t[start:end][None] for t, start, end in
                ((q, cu_seqlens_q[i], cu_seqlens_q[i + 1]), (k, cu_seqlens_k[i], cu_seqlens_k[i + 1]),
                 (v, cu_seqlens_k[i], cu_seqlens_k[i + 1]))]
        outs.append(flash_attn_func(*rows, dropout_p, softmax_scale, causal)[0])
    return torch.cat(outs)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the stand-in has no paged KV-cache kernel (crm never decodes)")
'''
BERT_PADDING = '''
"""flash_attn.bert_padding: rows of a right-padded batch to one packed sequence and back."""
import torch


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    lengths = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return packed, indices, cu_seqlens, int(lengths.max()), lengths


def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
'''


@pytest.fixture(scope="module")
def flash_attn_installed(tmp_path_factory):
    """A `flash_attn` package with its distribution's metadata (what transformers checks) on
    sys.path."""
    root = tmp_path_factory.mktemp("site")
    (root / "flash_attn").mkdir()
    (root / "flash_attn" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    (root / "flash_attn" / "bert_padding.py").write_text(BERT_PADDING)
    info = root / "flash_attn-2.8.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n")
    (info / "top_level.txt").write_text("flash_attn\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        import flash_attn

        yield flash_attn
        for name in ("flash_attn", "flash_attn.bert_padding"):  # imported: gone with the path
            sys.modules.pop(name, None)
    clear_install_probes()


def clear_install_probes():
    from transformers.utils import import_utils

    for probe in (import_utils._package_distribution_mapping, import_utils.is_torch_cuda_available,
                  import_utils.is_flash_attn_2_available):
        probe.cache_clear()


@contextlib.contextmanager
def gpu_visible():
    """torch and transformers report CUDA present, for deciding only: nothing may run in it (a
    forward would reach for CUDA)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        clear_install_probes()
        yield
    clear_install_probes()


def test_with_flash_attn_installed_compiled_layers_take_sdpa_and_an_explicit_flash_is_refused(
        flash_attn_installed):
    with gpu_visible():
        assert backbone.is_flash_attn_2_available()  # transformers takes the stand-in for flash-attn
        assert backbone.choose_attention("auto", False, "cuda") == "flash_attention_2"  # eager layers
        assert backbone.choose_attention("auto", True, "cuda") == "sdpa"
        assert backbone.choose_attention("auto", False, "cpu") == "sdpa"  # the model runs on CPU
        assert backbone.choose_attention("auto", False) == "sdpa"  # a build that knows no device
    assert not backbone.is_flash_attn_2_available()  # no GPU here: the probes are cleared again
    assert backbone.choose_attention("sdpa", compiled=True) == "sdpa"
    with pytest.raises(ValueError, match=r"attention=flash_attention_2 cannot run in compiled decoder "
                                         r"layers .* use attention=sdpa") as refused:
        backbone.choose_attention("flash_attention_2", compiled=True)
    assert "\n" not in str(refused.value)


def test_attention_auto_is_decided_for_the_runs_device_and_recorded(flash_attn_installed):
    """On a machine with CUDA and flash-attn, a run on the CPU trainer takes sdpa (flash-attn's
    kernels run on CUDA only) and a run on the GPU trainer flash_attention_2: decided from the
    trainer's device, not from what the machine has, and named in the run's record and config."""
    from dataclasses import replace

    from crm.data.transforms import TransformSettings
    from crm.models.config import LoraConfig
    from crm.training.config import BatchSettings, DeviceSettings, ParallelConfig, StartSettings
    from crm.training.resolve import Environment, resolve

    start = StartSettings(devices=DeviceSettings(accelerator="cpu", devices=1),
                          batch=BatchSettings(4, "auto", 4), model=ModelConfig(arch=COMPILE_ARCH),
                          loss=LossConfig("pairwise"), lora=LoraConfig(),
                          parallel=ParallelConfig(timeout_minutes=30), compile=False, packing="auto",
                          max_tokens=64, transform=TransformSettings(ties="keep"))
    with gpu_visible():
        assert backbone.is_flash_attn_2_available()
        on_cpu = resolve(start)
        on_gpu = resolve(replace(start, devices=DeviceSettings(accelerator="gpu", devices=1)),
                         environment=Environment("cuda", gpu_memory_gib=80))
    assert (on_cpu.device, on_cpu.attention) == ("cpu", "sdpa")
    assert (on_gpu.device, on_gpu.attention) == ("cuda", "flash_attention_2")
    assert on_cpu.record()["attention"] == "sdpa"
    run_config = on_cpu.into({"model": {"attention": "auto"}, "stream": {}, "parallel": {},
                              "transform": {}})
    assert run_config["model"]["attention"] == "sdpa" and run_config["resolved"]["attention"] == "sdpa"


class Captured:
    """A torch.compile backend: keeps each graph dynamo captures and runs it through aot_eager
    (AOTAutograd's forward and backward graphs), or as captured (dynamo alone: a third of the time)."""

    def __init__(self, aot: bool):
        self.graphs, self.aot = [], aot
        self.__name__ = "aot_eager (captured)" if aot else "eager (captured)"

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs) if self.aot else gm.forward


@pytest.fixture(scope="module")
def compiled(flash_attn_installed):
    """{precision: (pairwise CRM with compiled layers, tokenizer, its captured graphs)} with
    flash-attn installed and attention=auto, as a GPU user builds it."""
    torch._dynamo.reset()
    tok = tiny_tokenizer()
    out = {}
    for precision, dtype in (("bf16 parameters", "bfloat16"), ("bf16 autocast", "float32")):
        torch.manual_seed(0)
        with gpu_visible():
            crm = build_crm(ModelConfig(arch=COMPILE_ARCH, attention="auto", dtype=dtype),
                            LossConfig("pairwise"), num_labels=2, pad_token_id=tok.pad_token_id,
                            vocab_size=len(tok), compiled=True)
        assert crm.model.config._attn_implementation == "sdpa"
        # AOTAutograd for autocast (it traces the autocast regions into forward and backward);
        # bf16 parameters are plain dtypes, and what breaks there breaks in dynamo's capture.
        backend = Captured(aot=precision == "bf16 autocast")
        compiling.compile_layers(crm.model, backend=backend)
        out[precision] = (crm, tok, backend.graphs)
    yield out
    torch._dynamo.reset()


def rows_batch(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 250, (int(length),), generator=g).tolist()
            for length in torch.randint(5, 40, (n,), generator=g)]
    return {**pad_rows(rows, pad_id=0), "labels": torch.arange(n) % 2}


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast")


@pytest.mark.parametrize("precision", ["bf16 parameters", "bf16 autocast"])
def test_compiled_training_and_scoring_with_micro_batches_of_one_to_four_rows(compiled, flash_attn_installed,
                                                                           precision):
    crm, tok, graphs = compiled[precision]
    # The two precisions' models run the same code: each starts from an empty dynamo cache, so
    # that their graphs together never reach the recompile limit (8 per code).
    torch._dynamo.reset()
    before = compiling.compile_stats()
    calls = len(flash_attn_installed.calls)
    crm.train()
    for step, rows in enumerate([4, 1, 2, 3]):  # micro batches of 4, 1, 2 and an odd 3 rows
        b = rows_batch(rows, seed=step)
        with autocast(precision):
            loss = crm.loss(b)["loss"]
            with compiling.eager():
                reference = crm.loss(b)["loss"]
        loss.backward()
        assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(reference), rel=2e-2)
    crm.eval()
    with torch.inference_mode(), autocast(precision):  # validation's forward
        for rows in (4, 1):
            assert torch.isfinite(crm.loss(rows_batch(rows, seed=9))["loss"])
    scorer = CRMScorer(crm.model, tok, PromptTemplate(), "pairwise", max_tokens=200, batch_size=4,
                       prefix_reuse=False, compile=False)  # the layers are compiled already
    items = [(["concise"], f"query {i}", "alpha " * (i + 1), "beta reply") for i in range(5)]
    with autocast(precision):
        probs = scorer.compare_many(items)  # batches of 4 rows and 1 row
    assert probs.dtype == torch.float32 and torch.allclose(probs[:, :2].sum(1), torch.ones(5))
    crm.train()
    stats = compiling.compile_stats()
    # training, training on one row, evaluation, evaluation on one row; no graph break
    assert stats["graph_breaks"] == before["graph_breaks"] == 0
    assert stats["graphs"] - before["graphs"] == len(graphs) <= compiling.RECOMPILE_WARNING, len(graphs)
    assert len(flash_attn_installed.calls) == calls  # installed, and not on the compiled path


def symbols(value) -> set:
    shapes = [value] if isinstance(value, torch.SymInt) else (
        list(value.shape) if isinstance(value, torch.Tensor) else [])
    return {str(s) for dim in shapes if isinstance(dim, torch.SymInt) for s in dim.node.expr.free_symbols}


def test_captured_layer_graphs_have_only_batch_and_sequence_symbolic(compiled):
    """The model's constants (head size, grouped heads, the norms' eps, the attention scale) are
    constants of the graph; dynamic=True would have made them symbols and 0-d tensors."""
    crm, _, graphs = compiled["bf16 autocast"]
    head_dim = crm.model.config.head_dim
    with autocast("bf16 autocast"):  # the training graph (already there when the test above ran)
        for rows in (4, 3):
            crm.loss(rows_batch(rows, seed=rows))["loss"].backward()
    assert graphs
    for gm in graphs:
        inputs = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
        hidden = next(value for value in tensors if value.dim() == 3)  # (batch, sequence, hidden)
        batch_and_sequence = symbols(hidden.shape[0]) | symbols(hidden.shape[1])
        assert batch_and_sequence and isinstance(hidden.shape[2], int)  # hidden size: a constant
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            assert symbols(value) <= batch_and_sequence, (node.name, value)
            if isinstance(value, torch.Tensor) and value.dim() == 4:  # per head: its size, RoPE halves, norms
                assert isinstance(value.shape[-1], int) and value.shape[-1] in (head_dim, head_dim // 2, 1)
            assert not (node.op == "call_method" and node.target == "item"), node.name
        assert not [value for value in tensors if value.dim() == 0]  # no float read from a tensor


def test_a_model_with_flash_attention_is_not_compiled():
    model = type("M", (), {"config": type("C", (), {"_attn_implementation": "flash_attention_2"})()})()
    with pytest.raises(ValueError, match="attention=flash_attention_2 cannot run in compiled decoder layers"):
        compiling.compile_layers(model)


def test_transformers_flash_attention_wrapper_breaks_the_graph_on_one_row(flash_attn_installed):
    """Why compiled layers refuse flash_attention_2 (crm.models.config.not_compilable): transformers 5.23's
    wrapper, run whole by dynamo over the stand-in, compiles a bf16 four-row batch but stops on a
    one-row batch (its packed-sequence check reads tensor values) and under autocast (it logs from
    inside the layer). If this test fails, transformers has fixed it: the refusal can go."""
    from transformers import modeling_flash_attention_utils as flash_utils

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=COMPILE_ARCH, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                    pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    with gpu_visible():  # transformers loads its flash functions once, where it sees a GPU
        flash_utils.lazy_import_flash_attention("flash_attention_2")
    crm.model.config._attn_implementation = "flash_attention_2"  # what compile_layers would refuse
    calls = len(flash_attn_installed.calls)
    outcomes = {}
    for name, rows, dtype in (("bf16, 4 rows", 4, torch.bfloat16), ("bf16, 1 row", 1, torch.bfloat16),
                              ("autocast, 4 rows", 4, torch.float32)):
        torch._dynamo.reset()
        crm.to(dtype)
        for layer in crm.model.model.layers:
            layer.compile(backend="eager", fullgraph=True)
        b = rows_batch(rows, seed=rows)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
                crm(b["input_ids"], b["attention_mask"])
            outcomes[name] = "compiled"
        except torch._dynamo.exc.Unsupported as exc:
            outcomes[name] = str(exc).splitlines()[0]
    torch._dynamo.reset()
    assert outcomes["bf16, 4 rows"] == "compiled" and len(flash_attn_installed.calls) > calls
    assert outcomes["bf16, 1 row"] == "Data-dependent branching", outcomes
    assert "logging.Logger" in outcomes["autocast, 4 rows"], outcomes
