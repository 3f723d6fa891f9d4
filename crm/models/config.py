"""The model layer's settings as a user writes them: the model, loss and lora groups' schema
(configs/model, configs/loss, configs/lora), the dtype names and the `compile` setting's check.

Plain Python, no torch: every command composes and checks its config before it does any work, and
`--help` or a refused value must not wait for torch and transformers to load (docs/DESIGN.md
section 6). The code that reads these settings (factory, lora, backbone, compile) imports them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("pairwise", "pointwise")
# The dtypes a setting may name; crm.models.backbone.DTYPES maps each to its torch dtype.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Every linear layer of a Qwen3 decoder layer: attention's four projections and the MLP's three.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# What compiled decoder layers can run (crm.models.compile): transformers' flash-attention wrapper
# branches on tensor values (a one-row batch's packed-sequence check) and logs inside the layer, so
# dynamo cannot capture it whole (docs/PERFORMANCE.md section 9).
COMPILABLE_ATTENTION = ("sdpa", "eager")


def not_compilable(attention: str) -> str:
    """The one-line refusal of an attention implementation that compiled layers cannot run."""
    return (f"attention={attention} cannot run in compiled decoder layers (transformers' "
            "flash-attention wrapper branches on tensor values, e.g. on a one-row batch); use "
            "attention=sdpa, whose flash kernel serves Qwen3's grouped heads on the GPU, or compile=false")


def resolve_attention(requested: str, compiled: bool, device_type: str | None,
                      flash_installed: bool) -> tuple[str, str]:
    """`model.attention` for decoder layers that are `compiled` or eager, running on `device_type`
    (cuda | cpu; None: not known, as where a model is built without its run): the implementation
    and why. The rule itself, asking nothing of this machine (`flash_installed` is the caller's
    answer), so that crm-plan plans a GPU node with it (crm.models.backbone.choose_attention asks
    this machine).

    auto: sdpa for compiled layers (torch's sdpa runs its own flash kernel for crm's unmasked
    causal rows, grouped query heads included, and dynamo traces it whole); eager layers on CUDA
    take flash_attention_2 where flash-attn is installed; sdpa everywhere else, a CPU run on a
    machine with a GPU included. A choice the layers or the device cannot run raises ValueError.
    """
    if requested == "auto":
        if compiled:
            return "sdpa", "compiled decoder layers"
        if device_type != "cuda":
            return "sdpa", f"the model runs on {device_type or 'a device not known here'}"
        if not flash_installed:
            return "sdpa", "flash-attn not installed"
        return "flash_attention_2", "flash-attn installed, the model on CUDA"
    if compiled and requested not in COMPILABLE_ATTENTION:
        raise ValueError(not_compilable(requested))
    if requested == "flash_attention_2" and not flash_installed:
        raise ValueError("attention=flash_attention_2 but flash-attn is not installed "
                         "(pip install '.[gpu]' on a CUDA machine), or use attention=auto")
    if requested == "flash_attention_2" and device_type not in ("cuda", None):
        raise ValueError(f"attention=flash_attention_2 runs on CUDA, and this run is on "
                         f"{device_type}: use attention=auto or sdpa")
    return requested, "requested"


def resolve_compile(setting, device_type: str) -> bool:
    """The `compile` setting for a model on `device_type`: auto = on where it runs on CUDA.

    On CPU compiling costs more than it saves for crm's sizes (docs/PERFORMANCE.md section 9), so
    there it is only done when asked for.
    """
    if setting == "auto":
        return device_type == "cuda"
    if setting is True or setting is False:  # not `in (True, False)`: 0, 1 and 1.0 equal those
        return setting
    raise ValueError(f"compile={setting!r}: expected auto, true or false")


@dataclass(frozen=True)
class ModelConfig:
    name: str | None = None  # the option's name (configs/model/<name>.yaml); runs and reports show it
    path: str | None = None  # a local HF checkpoint dir: its architecture and weights replace `arch`
    tokenizer: str | None = None  # a local tokenizer dir (default: path)
    vocab_size: int | None = None  # the BPE vocabulary trained when there is no tokenizer (tiny models)
    attention: str = "auto"  # auto | sdpa | eager | flash_attention_2 (eager only; resolve_attention)
    dtype: str = "float32"  # parameter dtype at build, a name in DTYPE_NAMES
    arch: Any = None  # a name in backbone.ARCHITECTURES, or a dict of Qwen3Config fields

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype={self.dtype}: expected one of {', '.join(DTYPE_NAMES)}")

    def architecture(self, vocab_size: int | None = None) -> str | dict | None:
        """`arch`, a tiny model's fields with its tokenizer's vocabulary when `vocab_size` is given."""
        if isinstance(self.arch, dict) and vocab_size is not None:
            return {**self.arch, "vocab_size": vocab_size}
        return self.arch


TIE_MODELS = ("none", "davidson")


@dataclass(frozen=True)
class LossConfig:
    kind: str = "pairwise"  # pairwise: L_cls, cross-entropy | pointwise: L_ranking, Bradley-Terry
    name: str | None = None  # the option's name (configs/loss/<name>.yaml): cls | ranking
    margin: float = 0.0  # pointwise: -logsigmoid(r_c - r_r - margin)
    center_coef: float = 0.0  # pointwise: + center_coef * (r_c + r_r)^2
    ties: str = "none"  # pointwise: none (Bradley-Terry) | davidson (Bradley-Terry with ties)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind={self.kind}: expected one of {', '.join(KINDS)}")
        if self.ties not in TIE_MODELS:
            raise ValueError(f"loss.ties={self.ties}: expected one of {', '.join(TIE_MODELS)}")
        if self.ties != "none" and self.kind != "pointwise":
            raise ValueError(f"loss.ties={self.ties} is a pointwise CRM's; a pairwise CRM says "
                             "tie with its 3-way head (transform.ties=keep)")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA's settings (crm.models.lora injects and merges the adapters)."""

    rank: int = 0  # LoRA's r; 0 = train the whole model
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))
    base_dtype: str = "bfloat16"  # dtype of the frozen base weights (no optimizer state, no master copy)

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank}: expected 0 (full training) or a positive rank")
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers to adapt "
                             f"(default: {', '.join(DECODER_LINEARS)})")
        if self.base_dtype not in DTYPE_NAMES:
            raise ValueError(f"lora.base_dtype={self.base_dtype}: expected one of "
                             f"{', '.join(DTYPE_NAMES)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
