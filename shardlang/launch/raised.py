"""Where model code raised: the module of the model whose forward (or hooks) was running, the plan statement
that governs it, and the line and package of the code that raised. For apply's checks (launch.job) and
lint's simulated step (explain.rehearsal), which both turn an exception into a diagnostic at a plan line."""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..frontend.diagnostics import Code, Diagnostic
from ..frontend.source import Span


def in_chain(error: BaseException, wanted) -> BaseException | None:
    """The first error in `error`'s chain (itself, then what each was raised from) for which `wanted` holds,
    or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if wanted(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def value_read(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that fake tensors raise where an op reads tensor values (`.item()`,
    `nonzero`), or None."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return in_chain(error, lambda e: isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)))


def cause_saying(error: BaseException, words: str | tuple[str, ...]) -> str | None:
    """The first line of the error in `error`'s chain whose message begins with `words` (one of them), or
    None."""
    found = in_chain(error, lambda e: str(e).startswith(words))
    return None if found is None else str(found).splitlines()[0]


def summary(error: BaseException) -> str:
    """`RuntimeError: its first line`, and the summary of the error it was raised from where there is one
    (torch's pipeline stages wrap what their backward raised in "Failed to run stage backward:", the
    tensors' shapes on the lines below: the cause is what says what went wrong)."""
    said, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip().splitlines()
        said.append(f"{type(error).__name__}: {text[0].rstrip(':') if text else '(no message)'}")
        error = error.__cause__
    return ": ".join(said)


@contextlib.contextmanager
def watching(model: torch.nn.Module, finished: dict[str, int]):
    """Keep in `finished` when each module of `model` last finished its forward, in calls counted (one
    global hook, which ignores the references' modules): where a forward raises, the submodule whose
    output its code was reading, the last to finish, is the likeliest to have been sharded wrong."""
    from ..verification.localise import plain_name

    names = {id(m): plain_name(n) for n, m in model.named_modules()}
    ticks = itertools.count()

    def hook(module, args, output) -> None:
        # Inside a compiled module (a plan's `compile`) dynamo traces this hook: it does nothing there
        # (dynamo folds is_compiling() to True), leaving those modules' order unknown, not the graph broken.
        if torch.compiler.is_compiling():
            return
        name = names.get(id(module))
        if name is not None:
            finished[name] = next(ticks)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def in_module(
    ctx, found, message: str, finished: dict[str, int], code: Code, detail: tuple[str, ...] = ()
) -> Diagnostic:
    """`code` at the plan statement that governs the module `found` (raising_module's (name, module,
    frame); frame None where no line of its code was running, as in a backward) saying `message`, with the
    line of its code that was running, `detail`, and the other statements that govern it as help."""
    from ..verification.localise import governing

    fqn, module, frame = found
    statements = governing(ctx, fqn, inside=True, finished=finished)
    spans = [Span(s["file"], s["line"], s["col"], s["end_line"], s["end_col"]) for s in statements]
    return Diagnostic(
        code,
        message,
        spans[0] if spans else None,
        (
            *((f"in {place(frame)}",) if frame is not None else ()),
            *detail,
            *(f"{s['what']}: {s['file']}:{s['line']}:{s['col']}: {s['text']}" for s in statements[1:]),
            *(() if spans else ("no plan statement governs this module; look at the rules around it",)),
        ),
        label=statements[0]["what"] if statements else "",
    )


def module_text(found) -> str:
    """`module 'layers.0.attention' (Attention), in its forward` for raising_module's (name, module, frame)."""
    fqn, module, frame = found
    running = "forward" if frame.name == "forward" else f"call ({frame.name}: its hooks)"
    return f"module '{fqn or 'root'}' ({type(module).__name__.removeprefix('FSDP')}), in its {running}"


def filenames(error: BaseException) -> list[str]:
    from .frames import chain

    return [tb.tb_frame.f_code.co_filename for e in chain(error) for tb in _tracebacks(e)]


def _tracebacks(error: BaseException):
    tb = error.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def raising_module(model: torch.nn.Module, error: BaseException):
    """The innermost module of `model` that was running when `error` was raised: (its name, the module,
    the frame that ran it), from the frames of the traceback whose `self` is one of the model's modules
    (its forward, or torch's call of it while its hooks ran); None where none was."""
    import traceback

    from ..verification.localise import plain_name
    from .frames import chain

    names = {id(m): plain_name(n) for n, m in model.named_modules()}
    found = None
    for e in chain(error):
        for tb in _tracebacks(e):
            owner = tb.tb_frame.f_locals.get("self")
            if owner is not None and id(owner) in names:
                frame = traceback.FrameSummary(tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name)
                found = (names[id(owner)], owner, frame)
        if found is not None:
            return found  # the first cause's traceback reaches deepest
    return None


def first_argument(module: torch.nn.Module, error: BaseException):
    """What `module`'s forward was given first (its first parameter after `self`), from the traceback of
    `error` raised while it ran; None where its frame is not there."""
    from .frames import chain

    for e in chain(error):
        for tb in _tracebacks(e):
            frame = tb.tb_frame
            if frame.f_locals.get("self") is module and frame.f_code.co_argcount > 1:
                return frame.f_locals.get(frame.f_code.co_varnames[1])
    return None


def swapped_pair(ctx, fqn: str, module: torch.nn.Module, given) -> str | None:
    """A hint where a Linear's `rowwise` and `colwise` rules look swapped: a rowwise Linear given its whole
    input (this rank's tensor as long in its last dim as in_features), or a colwise one given a slice of it."""
    from torch.distributed.tensor import DTensor

    rule = next((r.rule for r in ctx.applied.linted.resolution.rules if r.fqn == fqn), None)
    if rule is None or rule.style.use is not None or not isinstance(module, torch.nn.Linear):
        return None
    if not isinstance(given, torch.Tensor) or given.ndim == 0:
        return None
    # What this rank holds: a style's input hook may have made it a DTensor, whose shape is the whole one's.
    local = given.to_local() if isinstance(given, DTensor) else given
    whole = local.shape[-1] == module.in_features
    name = rule.style.name
    if (name, whole) not in (("rowwise", True), ("colwise", False)):
        return None
    return (
        f"it was given {'its whole input' if whole else 'a slice of its input'}, where `{name}` takes "
        f"{'a slice' if whole else 'it whole'}: are `colwise` and `rowwise` swapped? Of a pair of Linears, the "
        "first (its input whole) is colwise, and the one after it, which reads the first's slice, rowwise"
    )


def place(frame) -> str:
    """`transformers/models/llama/modeling_llama.py:123 in forward, transformers 5.24.0: code`, or the
    user's own file as `where` writes it."""
    from .frames import package_of, where

    found = package_of(frame.filename)
    if found is None:
        return where(frame)
    package, inside = found
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{inside}:{frame.lineno} in {frame.name}, {package}{code}"
