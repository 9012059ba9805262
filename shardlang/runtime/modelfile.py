"""The model file (docs/language.md §6): `build_model()`, and optionally `example_input(batch, generator)` and
`loss(output, inputs)`, from a `model.py` path or an `--entry package.module:function`."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from attrs import frozen


class ModelFileError(Exception):
    """The model file cannot be loaded or lacks build_model (a usage error: exit status 2)."""


class _ExitCalled(BaseException):
    """os._exit called by user code while `user_code(..., keep_alive=True)` guards it."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def user_code(what: str, keep_alive: bool = False) -> Iterator[None]:
    """Run a model file's code: any exception, and `sys.exit`, become ModelFileError naming `what`.

    With `keep_alive` (the launcher: lint, compile, explain and apply's own checks), `os._exit` is
    intercepted too, so that a model file cannot end the command with its own exit status; a worker
    does not need this (the launcher reports a worker that exits as a dead rank)."""
    real_exit = os._exit

    def refuse_exit(code: int = 0) -> None:
        raise _ExitCalled(code)

    if keep_alive:
        os._exit = refuse_exit
    try:
        yield
    except SystemExit as e:
        raise ModelFileError(f"{what} called sys.exit({e.code!r})") from None
    except _ExitCalled as e:
        raise ModelFileError(f"{what} called os._exit({e.code!r})") from None
    except ModelFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not raised
        raise ModelFileError(f"{what} failed: {type(e).__name__}: {_first_line(e)}") from e
    finally:
        if keep_alive:
            os._exit = real_exit


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text.strip() else "(no message)"


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

    def build_on_meta(self, keep_alive: bool = False) -> torch.nn.Module:
        """The model on the meta device: no memory, no GPU; what lint, compile and explain look at."""
        with user_code(f"build_model() from {self.origin} on the meta device", keep_alive), torch.device("meta"):
            model = self.build_model()
        return check_module(model, self.origin)


def check_module(model: Any, origin: str) -> torch.nn.Module:
    """What build_model() returned, if it is a module (ModelFileError otherwise)."""
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"build_model() from {origin} returned {describe(model)}, not a torch.nn.Module")
    return model


def describe(value: Any) -> str:
    """`a str`, `None`: what a value is, for a message."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def load_model_file(
    path: str | None = None,
    entry: str | None = None,
    hf: str | None = None,
    seq: int | None = None,
    keep_alive: bool = False,
) -> ModelFile:
    """Load `path` (a .py file), `entry` (`package.module:function`, the function being build_model) or
    `hf` (a Hugging Face config: runtime.hf). Whatever a file's import does (raise, sys.exit; with
    `keep_alive`, os._exit) is a ModelFileError."""
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
        with user_code(f"importing {module_name}", keep_alive):
            module = importlib.import_module(module_name)
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
    return _from_path(Path(path), keep_alive)


def _from_path(path: Path, keep_alive: bool = False) -> ModelFile:
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
            with user_code(f"loading {path}", keep_alive):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    build = getattr(module, "build_model", None)
    if not callable(build):
        raise ModelFileError(f"{path} defines no build_model() (docs/language.md §6)")
    return ModelFile(
        str(path), build, getattr(module, "example_input", None), getattr(module, "loss", None), path=str(resolved)
    )


def _add_to_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
