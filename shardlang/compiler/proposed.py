"""Tensor-parallel rules proposed from a model's structure, for `shardlang init --tp N` on a model that
carries no TP plan of its own (a plain nn.Module: torchtitan's, a user's): each attention's q, k and v
column-wise and its output row-wise, each MLP's gate and up column-wise and its down row-wise, the token
embedding split by vocabulary and the output layer gathering its logits. Nothing here runs the model: it
reads the module tree, its attributes and its attentions' source, proposes only splits that divide evenly,
and init's lint step then drops those the model cannot run.

The rules use torch's default layouts (docs/language.md §4.2): between two rules every activation is whole
on every tp rank, so a norm, a residual or a rotary embedding in between needs no rule of its own.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping

import torch.nn as nn

from ..frontend.patterns import within

#: Where a proposed rule comes from, in init_plan's (key, source, ours, why) rules.
SOURCE = "structure"

#: An attention's projections by the last segment of their names (lower case): the common spellings of
#: transformers, torchtitan, nanoGPT-style and diffusers-style code.
QUERY = {"q_proj", "wq", "query", "q", "q_lin", "to_q", "query_proj", "q_linear"}
KEY = {"k_proj", "wk", "key", "k", "k_lin", "to_k", "key_proj", "k_linear"}
VALUE = {"v_proj", "wv", "value", "v", "v_lin", "to_v", "value_proj", "v_linear"}
OUT = {"o_proj", "wo", "out_proj", "dense", "o", "out_lin", "to_out", "output_proj", "out", "proj", "o_linear"}
#: q, k and v packed into one weight, which no proposal splits (below).
FUSED = {"qkv", "qkv_proj", "wqkv", "query_key_value", "c_attn", "in_proj", "w_pack", "qkv_lin", "qkv_linear"}
WHY_FUSED = (
    "q, k and v packed in one weight: not proposed (packed_colwise splits only equal widths, and where they "
    "are, the model's split of the packed output must be checked by hand)"
)
WHY_NOT_LINEAR = (
    "a 2-D weight that is not an nn.Linear's (transformers' Conv1D stores it [in, out]): not proposed; "
    "colwise_conv1d and rowwise_conv1d are the styles for it"
)

#: Where an attention module (or a submodule, or its config) says its head counts.
HEAD_DIM = ("head_dim", "head_size", "attention_head_size", "d_head", "dim_per_head")
HEADS = ("n_heads", "num_heads", "num_attention_heads", "n_head", "n_local_heads", "nheads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "n_local_kv_heads")

#: The down projection of an MLP whose hidden width equals its model width (the shapes cannot tell).
DOWN = {"w2", "down_proj", "fc2", "dense_4h_to_h", "wo", "c_proj", "fc_out", "lin2", "linear2", "net2", "proj_out"}
#: The token embedding and the output layer, where the vocabulary cannot tell them from the rest.
EMBEDDING = {"tok_embeddings", "embed_tokens", "wte", "word_embeddings", "embed_in", "token_embedding"}
OUTPUT = {"output", "lm_head", "embed_out", "head", "out_proj"}

#: The styles proposed, and why each: torch's default layouts keep every activation between rules whole.
COLWISE, ROWWISE = "colwise", "rowwise"
#: the vocabulary split: each rank looks up the ids its rows hold, the partial lookups summed (whole output)
EMBEDDING_STYLE = "rowwise(input=replicate)"
#: the logits gathered whole, which any loss takes (loss_parallel would keep them split: written by hand)
OUTPUT_STYLE = "colwise_gather_output"


def proposed_tp_rules(model: nn.Module, stacks: tuple[str, ...], tp: int) -> list[tuple[str, str, str | None, str]]:
    """Tensor-parallel rules for `model` at `tp` ranks, as init_plan's (key, SOURCE, shardlang style, "")
    or (key, SOURCE, None, why it stays a comment): in the first block of each of `stacks`
    (compiler.starter.block_stacks), written `stack.*.path`, each attention's projections and each MLP's
    pair; outside the stacks, MLPs, the token embedding and the output layer. Only splits that divide
    evenly by `tp`."""
    return [rule for group in proposed_tp_groups(model, stacks, tp) for rule in group]


def proposed_tp_groups(model: nn.Module, stacks: tuple[str, ...], tp: int) -> list[list[tuple]]:
    """proposed_tp_rules' rules in the groups that only run together: an attention's, an MLP's (a
    column-wise half hands a split activation to its row-wise half), the holders of one tied weight;
    an untied embedding and output layer each alone."""
    groups = []
    for stack in stacks:
        first = next(iter(model.get_submodule(stack).named_children()), None)
        if first is not None:
            groups += [[(f"{stack}.*.{key}", *rest) for key, *rest in group] for group in _block_groups(first[1], tp)]
    for fqn, module in model.named_modules():
        if not any(within(fqn, stack) for stack in stacks):
            groups.append([(_joined(fqn, key), *rest) for key, *rest in _mlp_rules(module, tp)])
    return [group for group in groups + _vocabulary_groups(model, stacks, tp) if group]


def with_partners(groups: list[list[tuple]], dropped: Mapping[str, str]) -> dict[str, str]:
    """`dropped` (rule key -> why it is left out) and, for each, the other rules of its group (which
    cannot run without it: a column-wise up projection whose row-wise down was left out would hand the
    model a split activation), each with why."""
    together = dict(dropped)
    for group in groups:
        gone = next((key for key, _, ours, _ in group if key in dropped and ours is not None), None)
        for key, _, ours, _ in group if gone else ():
            if ours is not None and key not in together:
                together[key] = f"it runs only with {gone}, left out: {dropped[gone]}"
    return together


def _joined(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix else path


def _block_groups(block: nn.Module, tp: int) -> list[list[tuple]]:
    """The rules inside one block, keys relative to it, a group each attention and MLP: its attentions,
    then its MLPs (not inside an attention, nor inside a list of experts: those are `--ep`'s)."""
    attentions = _outermost(block, _is_attention)
    groups = [_attention_rules(block.get_submodule(path), path, tp) for path in attentions]
    for path, module in block.named_modules():
        if not any(within(path, a) for a in attentions) and not _in_container(block, path):
            groups.append([(_joined(path, key), *rest) for key, *rest in _mlp_rules(module, tp)])
    return groups


def _is_attention(module: nn.Module) -> bool:
    """An attention module by its class name (transformers', torchtitan's, nanoGPT's) or, failing that,
    by a forward that calls scaled_dot_product_attention."""
    if type(module).__name__.lower().endswith("attention"):
        return True
    try:
        return "scaled_dot_product_attention" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # a built-in or generated forward: no source to read
        return False


def _outermost(block: nn.Module, matches) -> list[str]:
    """The paths in `block` of the outermost modules that `matches`."""
    found = [path for path, m in block.named_modules() if path and matches(m)]
    return [p for p in found if not any(within(p, other) and p != other for other in found)]


def _in_container(block: nn.Module, path: str) -> bool:
    """Whether `path` lies inside a ModuleList or ModuleDict of the block whose members are all of one
    class (a list of experts, a norm per head), where a rule on the first would leave the others out. A
    list of modules of different classes (T5's `layer`: attention, cross-attention, MLP) is structure."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        container = block.get_submodule(".".join(parts[:i]))
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)) and len({type(m) for m in container.children()}) == 1:
            return True
    return False


def _leaves_with_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) of each module below `module` that holds parameters of its own."""
    for path, m in module.named_modules():
        if path and next(m.parameters(recurse=False), None) is not None:
            yield path, m


def _attention_rules(attention: nn.Module, at: str, tp: int) -> list[tuple[str, str, str | None, str]]:
    """q, k and v column-wise and the output row-wise, each rank keeping whole heads; or a comment on the
    attention saying why not (a packed qkv, a projection it cannot name, heads it cannot count or
    divide)."""
    if isinstance(attention, nn.MultiheadAttention):
        return [(at, SOURCE, None, "nn.MultiheadAttention packs q, k and v in in_proj_weight: not proposed")]
    if next(attention.parameters(recurse=False), None) is not None:
        why = "it holds parameters of its own (attention sinks, relative-position biases, ...): not proposed"
        return [(at, SOURCE, None, why)]
    roles, norms, odd = {}, [], []
    for path, m in _leaves_with_parameters(attention):
        name = path.rsplit(".", 1)[-1].lower()
        if name in FUSED:
            return [(_joined(at, path), SOURCE, None, WHY_FUSED)]
        if isinstance(m, nn.Linear):
            role = next((r for r, names in zip("qkvo", (QUERY, KEY, VALUE, OUT)) if name in names), None)
            if role is None or role in roles:
                odd.append(path)
            else:
                roles[role] = (path, m)
        elif _is_2d_weight(m):
            return [(_joined(at, path), SOURCE, None, WHY_NOT_LINEAR)]
        else:
            norms.append((path, m))
    if odd or len(roles) < 4:
        said = f"its projection {odd[0]} is not one of q, k, v or the output" if odd else "no q, k, v and output"
        return [(at, SOURCE, None, f"{said} by name: not proposed")]
    heads, why = _head_counts(attention, roles["q"][1], roles["k"][1], roles["v"][1])
    per_head = []
    if not why:
        why = _uneven_heads(heads, roles["o"][1], tp)
    if not why:
        per_head, why = _per_head_norms(norms, roles, heads[2], attention)
    why = why or _whole_counts(attention)
    if why:
        return [(at, SOURCE, None, why)]
    rules = [(_joined(at, key), SOURCE, COLWISE, "") for key in _grouped([roles[r][0] for r in "qkv"])]
    rules += [(_joined(at, roles["o"][0]), SOURCE, ROWWISE, "")]
    # a per-head norm sees only its rank's heads: its weight's gradient is summed over tp
    return rules + [(_joined(at, path), SOURCE, "replicated_with_grad_allreduce", "") for path in per_head]


def _is_2d_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and getattr(weight, "ndim", 0) == 2 and not isinstance(module, nn.Embedding)


def _grouped(paths: list[str]) -> list[str]:
    """Paths under one parent as one key, `parent.{a,b,c}` (a pattern naming them all), else each alone."""
    parents = {p.rpartition(".")[0] for p in paths}
    if len(paths) == 1 or len(parents) != 1:
        return paths
    return [_joined(parents.pop(), "{" + ",".join(p.rpartition(".")[2] for p in paths) + "}")]


def _head_counts(attention: nn.Module, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> tuple[tuple, str]:
    """(heads, kv heads, head dim) from what the attention (a submodule, or its config) says and its
    projections' widths, or ((), why they cannot be told)."""
    said_heads, said_kv = _attribute(attention, HEADS, configs=False), _attribute(attention, KV_HEADS, configs=False)
    head_dim = (  # the attention's own word first, its config's after
        _attribute(attention, HEAD_DIM, configs=False)
        or _per_head(q, said_heads)
        or _attribute(attention, HEAD_DIM)
        or _per_head(q, _attribute(attention, HEADS))
    )
    if not head_dim:
        return (), "its head size could not be read (no head_dim, num_heads, ... on it): not proposed"
    if any(p.out_features % head_dim for p in (q, k, v)) or k.out_features != v.out_features:
        return (), f"its q, k and v widths are not whole heads of {head_dim}: not proposed"
    heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
    if (said_heads and said_heads != heads) or (said_kv and said_kv != kv_heads):
        return (), "its q and k widths do not match the head counts it says: not proposed"
    return (heads, kv_heads, head_dim), ""


#: Attributes holding an attention's whole width or head count, which a tp rank's shard does not have.
WHOLE = (*HEADS, *KV_HEADS, "embed_dim", "hidden_size", "all_head_size", "inner_dim", "d_model", "n_embd")
WHOLE_READ = re.compile(r"\bself\.(" + "|".join(WHOLE) + r")\b")


def _whole_counts(attention: nn.Module) -> str:
    """Why the attention's forward would compute wrong on a rank's heads: it (or a module below it) reads
    its whole head count or width, as OPT's `q.view(bsz, -1, self.num_heads, self.head_dim)` does, whose
    -1 then folds half the heads into the sequence with no error. Code that counts heads from its
    tensors' sizes (`view(..., -1, self.head_dim)`: transformers' Llama, torchtitan) reads none."""
    for module in attention.modules():
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):  # a built-in or generated forward: no source to read
            continue
        found = WHOLE_READ.search(source)
        if found:
            return (
                f"{type(module).__name__}.forward reads {found.group(0)}, the whole count, not a rank's: not proposed"
            )
    return ""


def _per_head(q: nn.Linear, heads: int | None) -> int | None:
    return q.out_features // heads if heads and q.out_features % heads == 0 else None


def _attribute(attention: nn.Module, names: tuple[str, ...], configs: bool = True) -> int | None:
    """The first positive int among `names` on the attention or its submodules, else (`configs`) on
    their configs: a model's config is the whole model's, and may count another attention's heads (a
    Whisper config's num_key_value_heads, which its attention does not use)."""
    owners = list(attention.modules())
    owners += [getattr(m, "config", None) for m in attention.modules()] if configs else []
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _uneven_heads(heads: tuple, out: nn.Linear, tp: int) -> str:
    count, kv_count, _ = heads
    if count % tp or kv_count % tp:
        return f"{count} heads and {kv_count} kv heads do not split over tp={tp}: not proposed"
    if out.in_features % tp:
        return f"its output's {out.in_features} inputs do not split over tp={tp}: not proposed"
    return ""


def _per_head_norms(norms: list, roles: dict, head_dim: int, attention: nn.Module) -> tuple[list[str], str]:
    """The attention's other parameter holders sorted: (the per-head norms, "") or ([], why one rules the
    attention out). A per-head norm (one head's width, shared by every head: Qwen3's q_norm) runs on each
    rank's own heads, and its gradient is summed over tp. A norm of the model's width beside the output
    projection or around the whole (BERT's `output.LayerNorm`, T5's `layer_norm`) sees whole activations
    and needs no rule; one beside q, k and v (OLMo2's q_norm, the width of every head) would normalise a
    rank's heads as if they were all of them, and one norm per head (StableLM's) would be applied by
    position to the rank's own heads."""
    width = roles["q"][1].in_features
    beside_qkv = {roles[r][0].rpartition(".")[0] for r in "qkv"}
    per_head = []
    for path, m in norms:
        sizes = {p.numel() if p.ndim == 1 else -1 for p in m.parameters(recurse=False)}
        if _in_container(attention, path):
            return [], f"it holds {path}, one of a norm per head: not proposed"
        if sizes == {head_dim}:
            per_head.append(path)
        elif sizes != {width} or path.rpartition(".")[0] in beside_qkv:
            return [], f"it holds {path}, whose parameters are neither a per-head norm's nor whole: not proposed"
    return per_head, ""


def _mlp_rules(module: nn.Module, tp: int) -> list[tuple[str, str, str | None, str]]:
    """An MLP by its shape: a module whose only parameters are two or three nn.Linear children, one
    (or two: gate and up) from the model width d to a hidden width h and one back from h to d (`_down`).
    Its up projections column-wise and its down row-wise, if h splits over tp; keys relative to the
    module."""
    leaves = list(_leaves_with_parameters(module))
    if not 2 <= len(leaves) <= 3 or any("." in path for path, _ in leaves):
        return []
    if not all(isinstance(m, nn.Linear) for _, m in leaves):
        return [(p, SOURCE, None, WHY_NOT_LINEAR) for p, m in leaves if _is_2d_weight(m)] if _pair(leaves) else []
    down = _down(leaves)
    if down is None:
        return []
    ups = [(p, m) for p, m in leaves if p != down[0]]
    width = down[1].in_features
    if any(m.in_features != down[1].out_features or m.out_features != width for _, m in ups):
        return []
    if width % tp:
        return [(down[0], SOURCE, None, f"its hidden width {width} does not split over tp={tp}: not proposed")]
    return [(key, SOURCE, COLWISE, "") for key in _grouped([p for p, _ in ups])] + [(down[0], SOURCE, ROWWISE, "")]


def _pair(leaves) -> bool:
    """Two or three layers with 2-D weights (transformers' Conv1D MLP): worth a comment."""
    return all(_is_2d_weight(m) for _, m in leaves)


def _down(leaves) -> tuple[str, nn.Linear] | None:
    """The down projection, which runs last: of three, the one whose shape is not the other two's (those
    are gate and up); of two, the one named as a down projection (`fc2`, `w2`, ...), else the second
    declared (a bottleneck d -> r -> d narrows first, so which one narrows cannot tell)."""
    named = [(p, m) for p, m in leaves if p.lower() in DOWN]
    if len(leaves) == 3:
        odd = [(p, m) for p, m in leaves if sum(o.weight.shape == m.weight.shape for _, o in leaves) == 1]
        return odd[0] if len(odd) == 1 else named[0] if len(named) == 1 else None
    return named[0] if len(named) == 1 else leaves[-1]


def _vocabulary_groups(model: nn.Module, stacks: tuple[str, ...], tp: int) -> list[list[tuple]]:
    """The token embedding split by vocabulary and the output layer (the Linear back to the vocabulary)
    gathering its logits, outside the stacks. Where the embedding's weight is tied, every module holding
    it gets its rule (T5's `shared` and its encoder's and decoder's `embed_tokens`, GPT-2's `lm_head`),
    or none does."""
    outside = [(f, m) for f, m in model.named_modules() if f and not any(within(f, s) for s in stacks)]
    linears = [(f, m) for f, m in outside if isinstance(m, nn.Linear)]
    embeddings = [(f, m) for f, m in outside if isinstance(m, nn.Embedding)]
    embedding = (
        _named_or_only(embeddings, EMBEDDING)
        or _only([(f, m) for f, m in embeddings if any(o.out_features == m.num_embeddings for _, o in linears)])
        or _only(list({id(m.weight): (f, m) for f, m in embeddings}.values()))  # one weight, tied
    )
    if embedding is None:
        return []
    vocab, weight = embedding[1].num_embeddings, embedding[1].weight
    holders = {f: m for f, m in embeddings + linears if m.weight is weight}
    if not any(isinstance(m, nn.Linear) for m in holders.values()):  # untied: the output layer by name
        output = _named_or_only([(f, m) for f, m in linears if m.out_features == vocab], OUTPUT)
        holders.update([output] if output else [])
    found = [(f, EMBEDDING_STYLE if isinstance(m, nn.Embedding) else OUTPUT_STYLE) for f, m in holders.items()]
    sharing = _sharing(model, weight) - set(holders)
    if sharing:  # a tied weight placed by one rule and not the other: SL203's different placements
        why = f"its weight is also {min(sharing)}'s, which no rule proposed here places: not proposed"
        return [[(fqn, SOURCE, None, why) for fqn, _ in found]]
    if vocab % tp:
        why = f"its vocabulary of {vocab} does not split over tp={tp}: not proposed"
        return [[(fqn, SOURCE, None, why) for fqn, _ in found]]
    rules = [(fqn, SOURCE, style, "") for fqn, style in found]
    tied = [rule for rule in rules if holders[rule[0]].weight is weight]
    return ([tied] if len(tied) > 1 else []) + [[rule] for rule in rules if len(tied) == 1 or rule not in tied]


def _sharing(model: nn.Module, weight) -> set[str]:
    """The modules holding `weight` as their own parameter (tied, under each name)."""
    return {
        owner
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if parameter is weight
        for owner in [name.rpartition(".")[0]]
    }


def _named_or_only(candidates: list, names: set[str]):
    """The one candidate, or the one whose last name segment is among `names`."""
    return _only(candidates) or _only([(f, m) for f, m in candidates if f.rsplit(".", 1)[-1].lower() in names])


def _only(candidates: list):
    return candidates[0] if len(candidates) == 1 else None
