"""Which call initialises a module's own parameters under `init meta`: the plan's METHOD, or the model's
own way (a Hugging Face model's `_init_weights`, else `reset_parameters`, else `_reset_parameters`).

Lint (SL209), apply (runtime.helpers.init_on_mesh, which the printed program pastes with this) and the
init check ask the same question here. Duck-typed: no torch import.
"""

from __future__ import annotations


def initialiser(root, module, method=None):
    """The call (no arguments) that initialises `module`'s own parameters, or None if nothing does.
    `method`: the METHOD of `init meta with METHOD`; None for the model's own way."""
    hugging_face = is_hugging_face(root)
    if method is not None:
        found = getattr(module, method, None)
        if not callable(found):
            return None
        return (lambda: (forget_initialised(module.modules()), found())) if hugging_face else found
    if hugging_face:
        # A transformers PreTrainedModel: its _init_weights(module) initialises each module as
        # from_config would (normal(0, initializer_range) for linears and embeddings, ones for norms,
        # the rotary tables...).
        return lambda: (forget_initialised([module]), root._init_weights(module))
    # The per-module methods PyTorch modules initialise themselves with (nn.MultiheadAttention has only
    # the second).
    for name in ("reset_parameters", "_reset_parameters"):
        found = getattr(module, name, None)
        if callable(found):
            return found
    return None


def is_hugging_face(root) -> bool:
    """A transformers PreTrainedModel (duck-typed: it has _init_weights and post_init)."""
    return callable(getattr(root, "_init_weights", None)) and callable(getattr(root, "post_init", None))


def children_first(model):
    """The modules of `model`, each after all of its descendants: the order their constructors finish,
    so a parent's initialiser has the last word, as in an unsharded build (nn.MultiheadAttention zeroes
    the bias of its out_proj after out_proj initialised itself)."""
    ordered = []

    def visit(module):
        for child in module.children():
            visit(child)
        ordered.append(module)

    visit(model)
    seen, unique = set(), []
    for module in ordered:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append(module)
    return unique


def covered(modules, fqn, method=None) -> bool:
    """Whether the parameters of module `fqn` get initialised: by its own initialiser, or (for a METHOD
    the plan names, like transformers' `init_weights`) by that method on one of its ancestors, which
    initialises its whole subtree. `modules`: FQN -> module, the root at ""."""
    root = modules.get("")
    if initialiser(root, modules[fqn], method) is not None:
        return True
    if method is None:
        return False
    parts = fqn.split(".") if fqn else []
    return any(callable(getattr(modules.get(".".join(parts[:i])), method, None)) for i in range(len(parts)))


def forget_initialised(modules) -> None:
    """transformers marks modules and parameters `_is_hf_initialized` when the constructor initialises
    them (on the meta device, to no effect) and then skips them: after materialising, they are not."""
    for module in modules:
        module.__dict__.pop("_is_hf_initialized", None)
        for param in module._parameters.values():
            if param is not None:
                param.__dict__.pop("_is_hf_initialized", None)
