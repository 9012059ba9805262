"""Which calls initialise a model under `init meta`, on which modules, in which order.

Without METHOD, each module that has one gets the model's own per-module initialiser, children before
parents: a Hugging Face model's `_init_weights(module)`, else `reset_parameters`, else `_reset_parameters`.
With `init meta with METHOD`, METHOD is called once on each outermost module that defines it (the root, for
transformers' `init_weights` or torchtitan's `init_states`), which initialises that module's whole
subtree: such methods recurse into their children, and calling them again on a descendant would only
repeat the work (on a CPU mesh, on shards it cannot tell apart). What the call did decides whether it is
called again below: where it left parameters of the subtree unwritten (a per-module method, such as
torchtitan's `_init_self_parameters`, which every module of its tree defines, the root too), it is called
on each descendant that defines it and still holds unwritten parameters, parents before children
(`calls_below`; the runtime tells what a call wrote from the parameters' version counters).

Lint (SL209), apply (runtime.materialise.init_on_mesh, which the printed program pastes with this) ask the
same questions here. Duck-typed: no torch import.
"""

from __future__ import annotations


def initialiser(root, module, method=None, owner=None):
    """The call (no arguments) that initialises `module`'s own parameters, or None if nothing does.
    `method`: the METHOD of `init meta with METHOD`; None for the model's own way. `owner`: for a transformers
    model, the innermost PreTrainedModel holding `module` (`owners`), whose `_init_weights` is the one
    from_config ran on it (the root's, where not given)."""
    hugging_face = is_hugging_face(root)
    if method is not None:
        found = getattr(module, method, None)
        if not callable(found):
            return None
        return (lambda: as_built(module, found)) if hugging_face else found
    if hugging_face:
        # A transformers PreTrainedModel: the _init_weights(module) of the innermost PreTrainedModel holding
        # the module initialises it as from_config did (normal(0, initializer_range) for linears and
        # embeddings, ones for norms, the rotary tables...; a vision tower inside a multimodal model its
        # own way).
        found = owner if owner is not None else root
        return lambda: (forget_initialised([module]), found._init_weights(module))
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
        owned = owners(root)
        found = ((module, initialiser(root, module, owner=owned.get(id(module)))) for module in children_first(root))
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


def calls_below(root, module, method, unwritten):
    """After METHOD on `module` left parameters below it unwritten (a method that sets only its module's own
    parameters, such as torchtitan's `_init_self_parameters`, is defined on every module of the tree, the
    root too): METHOD on each module below that defines it, parents before children, each called only if
    `unwritten(descendant)` still holds when its turn comes. A generator: the caller makes each call before
    asking for the next. (module, call, True) as initialisation_calls gives them."""
    for child in module.children():
        if not unwritten(child):
            continue
        call = initialiser(root, child, method)
        if call is not None:
            yield child, call, True
        yield from calls_below(root, child, method, unwritten)


def as_built(module, method) -> None:
    """Call a transformers module's `method` as on the model as it was built. Its flags of modules initialised
    are forgotten (forget_initialised), and it is told it is the code it was built as: fully_shard makes a
    unit's class a subclass of its own, defined in torch (FSDPModernBertForMaskedLM), which transformers'
    `is_custom_code()` reads as a user's code, and then skips initialising every module with no parameters of
    its own (ModernBERT's attention, whose `_init_weights` sets its linears' std)."""
    forget_initialised(module.modules())
    built = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch."))
    if built is type(module) or not callable(getattr(built, "is_custom_code", None)):
        return method()
    module.is_custom_code = built.is_custom_code
    try:
        return method()
    finally:
        del module.is_custom_code


def is_hugging_face(root) -> bool:
    """A transformers PreTrainedModel (duck-typed: it has _init_weights and post_init)."""
    return callable(getattr(root, "_init_weights", None)) and callable(getattr(root, "post_init", None))


def owners(root) -> dict[int, object]:
    """For a transformers model, each module's (by id) innermost PreTrainedModel, itself included: whose
    `_init_weights` initialises it, as transformers' `initialize_weights` dispatches it (a sub-model's own,
    such as a SigLIP vision tower's inside a multimodal model). Empty for any other model."""
    if not is_hugging_face(root):
        return {}
    found: dict[int, object] = {}

    def visit(module, owner):
        if id(module) in found:
            return
        owner = module if is_hugging_face(module) else owner
        found[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(root, root)
    return found


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
