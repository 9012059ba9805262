"""Parameters a model keeps in float32 whatever dtype it computes in, and the fully_shard units that keep
them so under a plan's `mixed_precision` (docs/huggingface.md, "Parameters kept in float32").

transformers names them on the model class: `_keep_in_fp32_modules_strict` under bfloat16 and float16,
`_keep_in_fp32_modules` under float16 only; each entry a pattern searched for in a parameter's full name
(`*` any run of characters), as from_pretrained's dtype plan matches them. A model loaded in bfloat16 holds
these in float32 and its code counts on it: ERNIE-4.5-MoE's router scores tokens with a float32 weight
(`_keep_in_fp32_modules_strict = ["gate.weight", "e_score_correction_bias"]`), and a bfloat16 copy of that
weight rounds the scores enough to send tokens to other experts than the model's own would.

A fully_shard unit casts every parameter it manages to its `param` dtype, and FSDP2 gives a module a policy
of its own only as a unit of its own. So the lowering wraps each module holding only such parameters in a
float32 unit before the unit around it (FSDP2 then leaves its parameters out of the outer unit): the outer
unit's options, `param=float32`, the outer `reduce`, and `cast_forward_inputs=False`, so that the module is
handed its inputs in the compute dtype, as the loaded model's router is.
"""

from __future__ import annotations

import re

from attrs import frozen
from torch import nn

from ..frontend import ir
from .predict import enclosing, units_by_module
from .resolve import Resolution, UnitMatch

#: The class attributes naming the parameters kept in float32, and the compute dtypes each holds under.
KEEPERS = {
    "_keep_in_fp32_modules_strict": ("bfloat16", "float16"),
    "_keep_in_fp32_modules": ("float16",),
}
FLOAT32 = ir.DType("float32")


@frozen
class Float32Unit:
    """A module whose parameters the model keeps in float32 (`params`, full names), given a float32 unit of
    its own inside `unit`, whose `mixed_precision` computes in `dtype`; `keeper` says which attribute
    of which class asked for it."""

    module: str
    unit: UnitMatch
    dtype: str
    params: tuple[str, ...]
    keeper: str

    def why(self) -> str:
        """The note the printed program and the gradients check's report carry."""
        return (
            f"{self.module} stays float32 inside a {self.dtype} unit: {self.keeper} keeps "
            f"{', '.join(p.removeprefix(self.module + '.') for p in self.params)} in float32"
        )


def patterns(model: nn.Module, dtype: str) -> dict[str, str]:
    """The model's float32 patterns that hold when it computes in `dtype`, each with the attribute naming it
    (`Class._keep_in_fp32_modules_strict`). transformers gathers its submodels' patterns into the root's."""
    found = {}
    for attr, dtypes in KEEPERS.items():
        if dtype in dtypes:
            # The class that declares it (FSDP renames the model's own class after fully_shard).
            owner = next((c for c in type(model).__mro__ if attr in vars(c)), type(model))
            for pattern in sorted(getattr(model, attr, None) or ()):
                found.setdefault(pattern, f"{owner.__name__}.{attr}")
    return found


def kept(name: str, found: dict[str, str]) -> str | None:
    """The attribute keeping parameter `name` in float32, or None (transformers' match: `*` is `.*`, searched)."""
    for pattern, keeper in found.items():
        if re.search(pattern.replace("*", ".*"), name):
            return keeper
    return None


def float32_units(plan: ir.Plan, resolution: Resolution) -> list[Float32Unit]:
    """Every module to wrap in a float32 unit, in the order of the units around them (children first): the
    largest modules, strictly inside a fully_shard unit computing in bfloat16 or float16 and in no unit of
    their own, whose parameters (one at least) the model keeps in float32."""
    root = resolution.modules.get("")
    if root is None:
        return []
    units = units_by_module(resolution)
    found: list[Float32Unit] = []
    for match in resolution.units:
        block = plan.units[match.block]
        mp = match.option(block, "mixed_precision") if match.kind(block) == "fully_shard" else None
        keep = patterns(root, mp.param.name) if mp is not None and mp.param is not None else {}
        if keep:
            found += [
                Float32Unit(fqn, match, mp.param.name, params, keeper)
                for fqn, params, keeper in _kept_modules(resolution, match, units, keep)
            ]
    return found


def _kept_modules(resolution: Resolution, match: UnitMatch, units: dict, keep: dict[str, str]):
    """(module, its parameters' names, the keeper) for each largest module of `match` whose parameters are all kept."""
    taken: list[str] = []
    for fqn, module in resolution.modules.items():
        if fqn in match.fqns or fqn in units or enclosing(fqn, units) is not match:
            continue
        if any(fqn.startswith(t + ".") for t in taken):
            continue
        names = [f"{fqn}.{n}" for n, _ in module.named_parameters()]
        keepers = {kept(n, keep) for n in names}
        if names and None not in keepers:
            taken.append(fqn)
            yield fqn, tuple(names), sorted(keepers)[0]
