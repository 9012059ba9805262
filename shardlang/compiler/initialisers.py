"""Which calls initialise a model under `init meta`, on which modules, in which order.

Without METHOD, each module that has one gets the model's own per-module initialiser, children before
parents: a Hugging Face model's `_init_weights(module)`, else `reset_parameters`, else `_reset_parameters`.
With `init meta with METHOD`, METHOD is called once on each outermost module that defines it (the root, for
transformers' `init_weights` or torchtitan's `init_states`), and must initialise that module's whole
subtree: such methods recurse into their children, and calling them again on a descendant would only
repeat the work (on a CPU mesh, on shards it cannot tell apart). Descendants of a module METHOD is called
on are not called again.

Lint (SL209), apply (runtime.helpers.init_on_mesh, which the printed program pastes with this) ask the
same questions here. Duck-typed: no torch import.
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


def initialisation_calls(root, method=None):
    """The calls `init meta` makes on `root`, in order: (module, call, subtree), `subtree` telling whether
    the call initialises the module's whole subtree (METHOD, once per outermost module defining it) or its
    own tensors (the model's own way, per module, children first)."""
    if method is None:
        found = ((module, initialiser(root, module)) for module in children_first(root))
        return [(module, call, False) for module, call in found if call is not None]
    calls, seen = [], set()

    def visit(module):
        if id(module) in seen:
            return
        seen.add(id(module))
        call = initialiser(root, module, method)
        if call is not None:
            calls.append((module, call, True))
            seen.update(id(m) for m in module.modules())  # a descendant shared elsewhere is covered too
            return
        for child in module.children():
            visit(child)

    visit(root)
    return calls


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
