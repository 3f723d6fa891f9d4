"""A run's tokenizer: the backbone's own, or a byte-level BPE trained on the training data itself.

Real backbones bring their own tokenizer; the tiny CPU models need one that exists offline for any
user data, so it is trained (in well under a second) on the text it will read and saved with the run.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# The Qwen chat layout without Qwen's tool and thinking branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=IM_END,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def load_or_train_tokenizer(source: str | None, saved: str | Path, *, vocab_size: int | None,
                            texts: Callable[[], Iterable[str]]):
    """The tokenizer at `source` (a local dir); without one, the BPE saved at `saved`, trained on
    `texts()` with `vocab_size` tokens the first time (a resumed run keeps its vocabulary)."""
    if source:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    saved = Path(saved)
    # Every rank of a run asks at once: one trains, the others load what it saved.
    with FileLock(saved.with_name(f".{saved.name}.lock")):
        if not (saved / "tokenizer.json").is_file():
            if not vocab_size:
                raise ValueError(f"no tokenizer to load and no vocab_size to train one into {saved}")
            tokenizer = train_bpe_tokenizer(texts(), vocab_size)
            partial = saved.with_name(saved.name + ".partial")
            tokenizer.save_pretrained(partial)
            partial.rename(saved)
            log.info("trained a %d-token BPE on the training data: %s", len(tokenizer), saved)
    return AutoTokenizer.from_pretrained(saved, local_files_only=True)
