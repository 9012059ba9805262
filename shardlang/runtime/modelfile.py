"""The model file (docs/language.md §6): `build_model()`, and optionally `example_input(batch, generator)` and
`loss(output, inputs)`, from a `model.py` path or an `--entry package.module:function`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from attrs import frozen


class ModelFileError(Exception):
    """The model file cannot be loaded or lacks build_model (a usage error: exit status 2)."""


@frozen
class ModelFile:
    """What a model file defines. `origin` is how to load it again (in another process)."""

    origin: str
    build_model: Callable[[], torch.nn.Module]
    example_input: Callable[[int, torch.Generator], Any] | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    path: str | None = None  # how to load it again in another process: a file
    entry: str | None = None  # ... or a package.module:function
    hf: str | None = None  # ... or a Hugging Face config (--hf), with its sequence length
    seq: int | None = None

    def __reduce__(self):
        # Functions from a file loaded by path live in a module other processes cannot import:
        # cross processes by path, entry or config, and load again there.
        if self.path or self.entry or self.hf:
            return (load_model_file, (self.path, self.entry, self.hf, self.seq))
        return (ModelFile, (self.origin, self.build_model, self.example_input, self.loss))

    def build_on_meta(self) -> torch.nn.Module:
        """The model on the meta device: no memory, no GPU; what lint, compile and explain look at."""
        try:
            with torch.device("meta"):
                return self.build_model()
        except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not raised
            raise ModelFileError(
                f"build_model() from {self.origin} failed on the meta device: {type(e).__name__}: {e}"
            ) from e


def load_model_file(
    path: str | None = None, entry: str | None = None, hf: str | None = None, seq: int | None = None
) -> ModelFile:
    """Load `path` (a .py file), `entry` (`package.module:function`, the function being build_model) or
    `hf` (a Hugging Face config: runtime.hf)."""
    if sum(x is not None for x in (path, entry, hf)) != 1:
        raise ModelFileError("give a model file, --entry package.module:function or --hf PATH (one of them)")
    if hf is not None:
        from .hf import HFError, functions

        try:
            build, example, loss = functions(hf, seq)
        except HFError as e:
            raise ModelFileError(str(e)) from None
        return ModelFile(f"--hf {hf}", build, example, loss, hf=hf, seq=seq)
    if entry is not None:
        module_name, sep, function = entry.partition(":")
        if not sep or not module_name or not function:
            raise ModelFileError(f"--entry expects package.module:function, got {entry!r}")
        _add_to_path(Path.cwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"cannot import {module_name}: {type(e).__name__}: {e}") from e
        build = getattr(module, function, None)
        if not callable(build):
            raise ModelFileError(f"{module_name} has no function {function}")
        return ModelFile(
            f"--entry {entry}",
            build,
            getattr(module, "example_input", None),
            getattr(module, "loss", None),
            entry=entry,
        )
    return _from_path(Path(path))


def _from_path(path: Path) -> ModelFile:
    if not path.is_file():
        raise ModelFileError(f"cannot read model file {path}: no such file")
    resolved = path.resolve()
    name = f"shardlang_model_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    module = sys.modules.get(name)
    if module is None:
        # The file's folder and the current one are importable, as when running `python model.py`.
        _add_to_path(resolved.parent)
        _add_to_path(Path.cwd())
        spec = importlib.util.spec_from_file_location(name, resolved)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            del sys.modules[name]
            raise ModelFileError(f"{path} failed to load: {type(e).__name__}: {e}") from e
    build = getattr(module, "build_model", None)
    if not callable(build):
        raise ModelFileError(f"{path} defines no build_model() (docs/language.md §6)")
    return ModelFile(
        str(path), build, getattr(module, "example_input", None), getattr(module, "loss", None), path=str(resolved)
    )


def _add_to_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
