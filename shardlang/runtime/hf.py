"""A Hugging Face transformers model as a model file (`--hf PATH`): the architecture its config.json
names, built from the config alone (no weights, never the network), random token ids as inputs and the
causal language-model loss.

PATH is a directory holding config.json (as `save_pretrained` writes it, optionally with safetensors
weights) or the config.json file itself.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

#: Tokens per sequence of the example inputs, unless --seq says otherwise.
SEQ = 128


class HFError(Exception):
    """transformers missing, or PATH not a config it can read: a usage error."""


def config_path(path: str) -> Path:
    given = Path(path)
    found = given / "config.json" if given.is_dir() else given
    if not found.is_file():
        raise HFError(f"--hf {path}: no config.json there (give a directory saved by save_pretrained, or the file)")
    return found


def load_config(path: str):
    """The model's config, read from disk only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the network, whatever the config refers to
    try:
        import transformers
    except ImportError as e:
        raise HFError("--hf needs transformers: pip install 'shardlang[hf]'") from e
    found = config_path(path)
    try:
        return transformers.AutoConfig.from_pretrained(str(found.parent), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read is the user's to fix
        raise HFError(f"--hf {path}: transformers cannot read {found}: {type(e).__name__}: {e}") from e


def model_class(config):
    """The class the config's `architectures` names, else the causal-LM class transformers maps it to."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if found is not None:
            return found
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as e:
        raise HFError(f"transformers has no causal language model for {type(config).__name__}") from e


def build_model(path: str) -> torch.nn.Module:
    config = load_config(path)
    return model_class(config)(config)


def example_input(path: str, seq: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` sequences of `seq` random token ids within the vocabulary."""
    vocab = load_config(path).get_text_config().vocab_size
    return torch.randint(0, vocab, (batch_size, seq), generator=generator)


def loss(output, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the logits (in float32)."""
    logits = output.logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def functions(path: str, seq: int | None):
    """build_model, example_input and loss for the model at `path`, checked to load now."""
    load_config(path)
    return partial(build_model, path), partial(example_input, path, seq or SEQ), loss
