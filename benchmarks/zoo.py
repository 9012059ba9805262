"""The zoo (issue 41): every family transformers maps to a causal, seq2seq or masked language model, built
tiny from its config class and swept through `shardlang init`, `lint` and `apply`, one family per process.

    python benchmarks/zoo.py [--mode plain|tp|ep|cp ...] [--only FAMILY ...] [--shard I/N] [--timeout S]
                             [--results FILE] [--table]

Sampling families by hand found a new class of failure each round; the sweep stops sampling. Each family
gets a generated model file (benchmarks/.zoo/<family>.py, importing `model_file` from here), then per mode:
`init MODEL --no-check -o PLAN` (the starter plan, statically linted), `lint PLAN MODEL --world W --format
json` (lint's verdict, with its simulated step) and `apply PLAN MODEL --nproc W --json` (apply's verdict),
each in its own process with a timeout. One JSON line per (family, mode) goes to the results file, which
makes the sweep resumable: a (family, mode) already there is skipped. `--table` prints the summary: counts
by outcome and the failures grouped by class (the first diagnostic code and a short normalised message).

Built tiny: 2 layers, hidden 64, 4 heads (2 kv heads), head_dim 16, intermediate 128, vocab 128, 4 experts
(top 2, width 32) where it has experts, no special token ids, float32, SDPA attention where it has it. The
unsharded model runs one forward and loss here before any shardlang command: a family whose own model
cannot do that is "not built", with why, and is no verdict on shardlang.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".zoo"
RESULTS = ROOT / "benchmarks" / "zoo_results.jsonl"
VOCAB, SEQ = 128, 16

#: The kinds of model, in the order a family that several map is taken as: its seq2seq model is what an
#: encoder-decoder is for, a masked LM what an encoder is for (BERT's causal head is a side use).
KINDS = ("seq2seq", "masked", "causal")

#: The generic shrink: (value, every name configs spell it with); a config takes those its constructor has,
#: attribute_map aliases followed.
SHRINK = (
    (64, ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")),
    (
        2,
        (
            "num_hidden_layers",
            "num_layers",
            "n_layer",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
        ),
    ),
    (
        4,
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads"),
    ),
    (2, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")),
    (16, ("head_dim", "d_kv", "attention_head_size", "kv_channels")),
    (128, ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "ffn_hidden_size")),
    (VOCAB, ("vocab_size",)),
    (SEQ * 4, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")),
)
#: A mixture of experts' few, narrow experts (examples/families/common.py): 4 of width 32, top 2.
EXPERTS = (
    (4, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (2, ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "num_selected_experts")),
    (32, ("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size")),
)
#: Multi-head latent attention's ranks and head dims (examples/families/deepseek_v3.py), grouped routing
#: over 4 experts, a rotary dim within head_dim 16.
LATENT = (
    (16, ("kv_lora_rank", "v_head_dim", "rotary_dim")),
    (32, ("q_lora_rank",)),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim")),
    (1, ("n_group", "topk_group")),
)
SPECIAL_IDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "cls_token_id",
    "decoder_start_token_id",
    "mask_token_id",
    "unk_token_id",
)

#: Per-family overrides where the generic shrink builds nothing that runs (config keyword -> value).
#: Families whose code reads a padding id (RoBERTa's positions from `input_ids.ne(padding_idx)`, a
#: seq2seq shift right) get pad 1, decoder start 2 (BART's).
NEEDS_IDS = dict(pad_token_id=1, decoder_start_token_id=2)
OVERRIDES: dict[str, dict] = {
    name: NEEDS_IDS
    for name in (
        "camembert",
        "data2vec-text",
        "esm",
        "ibert",
        "longformer",
        "m2m_100",
        "nllb-moe",
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "seamless_m4t",
        "seamless_m4t_v2",
        "led",
        "prophetnet",
        "fsmt",
        "t5gemma",
    )
}

#: Families not built, and why (remote code, extra packages, not a language model one can shrink).
NOT_BUILT: dict[str, str] = {}


@attrs.frozen
class Family:
    """One model_type of transformers' auto mappings: which head class the sweep builds, from which config."""

    name: str
    kind: str  # one of KINDS
    model_class: str
    config_class: str


def families() -> list[Family]:
    """Every model_type transformers maps to a causal, seq2seq or masked LM, each once (KINDS' order)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = {
        "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    }
    found: dict[str, Family] = {}
    for kind in KINDS:
        for name, model_class in mappings[kind].items():
            config_class = configuration_auto.CONFIG_MAPPING_NAMES.get(name)
            if name not in found and config_class:
                found[name] = Family(name, kind, _first(model_class), config_class)
    return sorted(found.values(), key=lambda f: f.name)


def _first(names) -> str:
    return names[0] if isinstance(names, (list, tuple)) else names


def family(name: str) -> Family:
    return next(f for f in families() if f.name == name)


def accepted(config_class) -> set[str]:
    """The keywords a config's constructor takes (transformers 5's configs are dataclasses)."""
    return {p for p in inspect.signature(config_class.__init__).parameters if p not in ("self", "kwargs")}


def shrunk(config_class) -> dict:
    """The generic shrink's keywords this config class takes; attribute_map aliases followed."""
    takes, aliases = accepted(config_class), getattr(config_class, "attribute_map", {}) or {}
    kwargs = {}
    for value, names in (*SHRINK, *EXPERTS, *LATENT):
        for name in names:
            real = name if name in takes else aliases.get(name, name)  # the constructor's own name first
            if real in takes:
                kwargs[real] = value
    kwargs.update(special_ids(config_class))
    kwargs.update({name: 0.0 for name in random_knobs(config_class)})
    for name in ("tie_word_embeddings", "use_cache"):
        if name in takes:
            kwargs[name] = False
    return kwargs


def special_ids(config_class) -> dict:
    """No special token ids (defaults such as 50256 lie outside vocab 128; these models only see random
    ids); 0 where the config's type takes no None."""
    parameters = inspect.signature(config_class.__init__).parameters
    return {
        name: None if "None" in str(parameters[name].annotation) else 0 for name in SPECIAL_IDS if name in parameters
    }


def random_knobs(config_class) -> list[str]:
    """Dropout probabilities and router jitter, numbers a config takes: zero, so that one training step of
    the sharded model and of the reference are the same computation (random masks differ by rank)."""
    parameters = inspect.signature(config_class.__init__).parameters.values()
    return [
        p.name
        for p in parameters
        if ("dropout" in p.name or p.name.endswith("pdrop") or "jitter" in p.name) and type(p.default) in (int, float)
    ]


def config_of(fam: Family):
    """The tiny config: the shrink, any sub-config (text, vision, ...) shrunk alike, the family's overrides."""
    import transformers

    config_class = getattr(transformers, fam.config_class)
    kwargs = shrunk(config_class)
    subs = [key for key in getattr(config_class, "sub_configs", None) or {} if key in accepted(config_class)]
    default = config_class() if subs else None
    for key in subs:  # a text, vision or audio config: its default's class (sub_configs may say AutoConfig)
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PretrainedConfig):
            kwargs[key] = {**per_model(sub.to_dict()), **shrunk(type(sub))}
    takes = accepted(config_class)
    kwargs.update({k: v for k, v in OVERRIDES.get(fam.name, {}).items() if k in takes})
    config = config_class(**kwargs)
    config._attn_implementation = "sdpa" if _has_sdpa(fam) else "eager"
    return config


def per_model(values: dict) -> dict:
    """A default sub-config's values less its per-layer lists (layer_types ...), which the shrunk layer
    count recomputes."""
    layers = values.get("num_hidden_layers")
    return {k: v for k, v in values.items() if not (isinstance(v, list) and layers and len(v) == layers)}


def _has_sdpa(fam: Family) -> bool:
    import transformers

    return bool(getattr(getattr(transformers, fam.model_class), "_supports_sdpa", False))


def build(fam: Family):
    """The family's model, tiny, float32, on the default device."""
    import torch
    import transformers

    model = getattr(transformers, fam.model_class)(config_of(fam))
    if fam.kind == "seq2seq":
        model.register_forward_pre_hook(_decoder_inputs, with_kwargs=True)
    return model.to(torch.float32)


def _decoder_inputs(module, args, kwargs):
    """A seq2seq model is handed the tokens once: the decoder reads the same tokens, so that the loss is the
    causal LM loss on the decoder's logits for every seq2seq family alike."""
    if "decoder_input_ids" not in kwargs and args:
        kwargs = {**kwargs, "decoder_input_ids": args[0]}
    return args, kwargs


def example_input(batch_size: int, generator):
    import torch

    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)


def causal_loss(output, inputs):
    """Next-token cross-entropy on [batch, seq, vocab] logits (causal LMs and seq2seq decoders)."""
    from examples.llama import causal_lm_loss

    return causal_lm_loss(output.logits, inputs)


def masked_loss(output, inputs):
    """Cross-entropy against the input ids at every position: random ids stand in for masked text."""
    import torch.nn.functional as F

    return F.cross_entropy(output.logits.float().flatten(0, 1), inputs.flatten())


def model_file(name: str):
    """(build_model, example_input, loss) for a generated model file."""
    fam = family(name)
    return (lambda: build(fam)), example_input, masked_loss if fam.kind == "masked" else causal_loss


MODEL_FILE = '''"""transformers' {model_class} ({name}), tiny, from benchmarks/zoo.py (generated)."""

from benchmarks.zoo import model_file

build_model, example_input, loss = model_file({name!r})
'''


#: A tiny model has well under a million parameters; more means a size the shrink did not reach.
MAX_PARAMETERS = 20_000_000


def probe(fam: Family) -> str | None:
    """None when the family builds and its unsharded model runs a forward and the loss; else why not."""
    import torch

    if fam.name in NOT_BUILT:
        return NOT_BUILT[fam.name]
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in build(fam).parameters())
        if size > MAX_PARAMETERS:
            return f"the shrink left {size / 1e6:.0f}M parameters (over {MAX_PARAMETERS / 1e6:.0f}M): needs an override"
        torch.manual_seed(0)
        model = build(fam)
        inputs = example_input(2, torch.Generator().manual_seed(0))
        loss = (masked_loss if fam.kind == "masked" else causal_loss)(model(inputs), inputs)
        loss.backward()
    except Exception as e:  # noqa: BLE001 (the family's own code: any failure means "not built")
        return f"{type(e).__name__}: {first_line(str(e))}"[:200]
    return None if torch.isfinite(loss) else f"loss is {loss.item()}"


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


#: The sweep's modes: init's flags, and which families they apply to (see `applies`).
MODES = {"plain": (), "tp": ("--tp", "2"), "ep": ("--ep", "2"), "cp": ("--cp", "2")}


@attrs.frozen
class Ran:
    """One shardlang command's exit status, output and seconds (exit None: it ran past its timeout)."""

    exit: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def crashed(self) -> bool:
        """Exit 2 with a Python traceback, or a timeout: what the issue counts as a crash."""
        return self.exit is None or (
            self.exit == 2 and "Traceback (most recent call last)" in self.stdout + self.stderr
        )

    def tail(self, chars: int = 600) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-chars:]


def shardlang(args: list[str], timeout: float) -> Ran:
    command = [sys.executable, "-m", "shardlang", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return Ran(None, out, err + f"\ntimed out after {timeout:.0f} s", time.perf_counter() - start)
    return Ran(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


CODE = re.compile(r"\b(SL\d{3})\b")
WORLD = re.compile(r"linted at world (\d+)")


def init_verdict(ran: Ran) -> dict:
    """init's exit, its last line (the verdict), the codes its static lint printed, the world it linted at."""
    text = ran.stdout + ran.stderr
    world = WORLD.search(text)
    return {
        "exit": ran.exit,
        "said": first_line(ran.stdout.strip().splitlines()[-1] if ran.stdout.strip() else ran.tail(200)),
        "codes": sorted(set(CODE.findall(ran.stderr))),
        "world": int(world.group(1)) if world else None,
        "seconds": round(ran.seconds, 1),
    }


def lint_verdict(ran: Ran) -> dict:
    """lint's verdict from its JSON list: clean, errors (their codes), or crash (no list: exit 2 or timeout)."""
    try:
        diagnostics = json.loads(ran.stdout)
    except ValueError:
        return {"verdict": "crash", "exit": ran.exit, "said": _last_words(ran), "seconds": round(ran.seconds, 1)}
    errors = [d for d in diagnostics if d.get("severity") == "error"]
    return {
        "verdict": "errors" if errors else "clean",
        "exit": ran.exit,
        "codes": [d["code"] for d in errors],
        "warnings": sorted({d["code"] for d in diagnostics if d.get("severity") != "error"}),
        "said": first_line(errors[0]["message"])[:300] if errors else "",
        "seconds": round(ran.seconds, 1),
    }


def apply_verdict(ran: Ran) -> dict:
    """apply's verdict from its JSON report: pass, fail (a check failed, or an error diagnostic), or crash
    (no report: exit 2 before or outside the checks, or a timeout)."""
    try:
        report = json.loads(ran.stdout)
    except ValueError:
        return {"verdict": "crash", "exit": ran.exit, "said": _last_words(ran), "seconds": round(ran.seconds, 1)}
    checks = {c["check"]: c["status"] for c in report.get("checks", [])}
    failed = [c for c in report.get("checks", []) if c.get("status") == "fail"]
    errors = [d for d in report.get("diagnostics", []) if d.get("severity") == "error"]
    said = f"{failed[0]['check']}: {first_line(failed[0]['message'])}" if failed else ""
    said = said or (first_line(errors[0]["message"]) if errors else report.get("summary", ""))
    return {
        "verdict": "pass" if report.get("ok") else ("fail" if failed or errors else "crash"),
        "exit": ran.exit,
        "checks": checks,
        "codes": [d["code"] for d in errors],
        "said": said[:300],
        "seconds": round(ran.seconds, 1),
    }


def _last_words(ran: Ran) -> str:
    """What a command that gave no JSON said last: its `error:` line, else the last line of its output."""
    text = ran.stderr + "\n" + ran.stdout
    errors = [line.strip() for line in text.splitlines() if "error:" in line or "Error" in line]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (errors[-1] if errors else lines[-1] if lines else f"exit {ran.exit}")[:300]


def is_moe(fam: Family) -> bool:
    import transformers

    takes = accepted(getattr(transformers, fam.config_class))
    return any(name in takes for _, names in EXPERTS[:1] for name in names)


def applies(fam: Family, mode: str) -> bool:
    """plain and tp for every family; ep where it has experts; cp where its attention is SDPA."""
    return {"ep": is_moe, "cp": _has_sdpa}.get(mode, lambda _: True)(fam)


def run(fam: Family, mode: str, timeout: float) -> dict:
    """init, lint and apply of one family's starter plan in one mode, each in its own process."""
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / ".gitignore").write_text("*\n")  # generated files, never committed
    model = CACHE / f"{fam.name.replace('-', '_')}.py"
    model.write_text(MODEL_FILE.format(model_class=fam.model_class, name=fam.name), encoding="utf-8")
    plan = CACHE / f"{model.stem}.{mode}.sl"
    plan.unlink(missing_ok=True)
    ran = shardlang(["init", str(model), *MODES[mode], "--no-check", "-o", str(plan)], timeout)
    record = {"init": init_verdict(ran)}
    if not plan.exists():
        record["crash"] = ran.crashed or ran.exit == 2
        record["tail"] = ran.tail()
        return record
    world = str(record["init"]["world"] or (2 if mode == "plain" else 4))
    ran_lint = shardlang(["lint", str(plan), str(model), "--world", world, "--format", "json"], timeout)
    ran_apply = shardlang(
        ["apply", str(plan), str(model), "--nproc", world, "--json", "--timeout", str(int(timeout))], timeout + 30
    )
    record |= {"world": int(world), "lint": lint_verdict(ran_lint), "apply": apply_verdict(ran_apply)}
    record["crash"] = any(r.crashed for r in (ran, ran_lint, ran_apply))
    if record["crash"] or record["apply"]["verdict"] != "pass":
        record["tail"] = next((r.tail() for r in (ran, ran_lint, ran_apply) if r.crashed), ran_apply.tail())
    return record


def judged(record: dict) -> dict:
    """The record's outcome (pass, fail, crash, not built), lint against apply, and its failure's class."""
    if "built" in record and record["built"] is not True:
        return {"outcome": "not built", "agreement": "-", "class": None}
    lint, applied = record.get("lint"), record.get("apply")
    if lint is None:
        return {"outcome": "crash", "agreement": "-", "class": f"init: {normalised(record['init']['said'])}"}
    outcome = "crash" if record["crash"] else {"pass": "pass", "fail": "fail"}.get(applied["verdict"], "crash")
    if lint["verdict"] == "crash":
        agreement = "lint crash"
    elif lint["verdict"] == "clean":
        agreement = "agree" if applied["verdict"] == "pass" else "miss"
    else:
        agreement = "false alarm" if applied["verdict"] == "pass" else "agree"
    return {"outcome": outcome, "agreement": agreement, "class": failure_class(record, agreement)}


def failure_class(record: dict, agreement: str) -> str | None:
    """The first diagnostic code (lint's, else apply's) or failed check, and a short normalised message."""
    lint, applied = record["lint"], record["apply"]
    if applied["verdict"] == "pass" and agreement == "agree":
        return None
    if lint["verdict"] == "errors" or lint["verdict"] == "crash":
        code = (lint.get("codes") or ["crash"])[0]
        return f"lint {code}: {normalised(lint['said'])}"
    failed = next((c for c, status in applied.get("checks", {}).items() if status == "fail"), None)
    code = (applied.get("codes") or [failed or applied["verdict"]])[0]
    return f"apply {code}: {normalised(applied['said'])}"


def normalised(message: str) -> str:
    """A message with its names and numbers blanked, so that one failure on many families reads alike."""
    message = re.sub(r"'[^']*'|`[^`]*`|\"[^\"]*\"", "'_'", message)
    message = re.sub(r"\b[A-Za-z_]\w*(\.[\w*]+)+", "_._", message)
    message = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", message)
    return message[:110]


def done_keys(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    return {(r["family"], r["mode"]) for r in map(json.loads, path.read_text().splitlines()) if r}


def selected(args: argparse.Namespace) -> list[Family]:
    found = [f for f in families() if not args.only or f.name in args.only]
    index, count = map(int, args.shard.split("/"))
    return found[index::count]


def sweep(args: argparse.Namespace) -> None:
    """Each selected family not yet in the results file, one (family, mode) at a time, a line each."""
    done, chosen = done_keys(args.results), selected(args)
    for number, fam in enumerate(chosen, 1):
        todo = [m for m in args.mode if (fam.name, m) not in done]
        if not todo:
            continue
        start = time.perf_counter()
        why = probe(fam)
        for mode in todo:
            record = {"family": fam.name, "kind": fam.kind, "model_class": fam.model_class, "mode": mode}
            if why is not None:
                record |= {"built": why}
            elif not applies(fam, mode):
                continue
            else:
                record |= {"built": True, **run(fam, mode, args.timeout)}
            record |= judged(record) | {"seconds": round(time.perf_counter() - start, 1)}
            with args.results.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
            said = record["class"] or record.get("built") if record["outcome"] != "pass" else ""
            print(
                f"[{number}/{len(chosen)}] {fam.name} {mode}: {record['outcome']} ({record['agreement']}, "
                f"{record['seconds']:.0f} s) {said or ''}",
                flush=True,
            )
            start = time.perf_counter()


def table(path: Path) -> str:
    """The summary: outcomes and lint-vs-apply by mode, then the failures grouped by class with examples."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        f"{len({r['family'] for r in records})} families tried, "
        f"{len({r['family'] for r in records if r.get('built') is True})} built",
        "",
    ]
    lines += [
        "| mode | tried | built | pass | fail | crash | lint agrees | false alarm | miss | lint crash |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        rows = [r for r in records if r["mode"] == mode]
        if rows:
            count = _counter(rows)
            built = sum(r.get("built") is True for r in rows)
            lines.append(
                f"| {mode} | {len(rows)} | {built} | {count('outcome', 'pass')} | {count('outcome', 'fail')} "
                f"| {count('outcome', 'crash')} | {count('agreement', 'agree')} | "
                f"{count('agreement', 'false alarm')} | {count('agreement', 'miss')} | "
                f"{count('agreement', 'lint crash')} |"
            )
    lines += ["", "| class | mode | outcome / lint vs apply | families |", "|---|---|---|---|"]
    classes: dict[tuple, list[str]] = {}
    for r in records:
        if r.get("class"):
            classes.setdefault((r["class"], r["mode"], f"{r['outcome']} / {r['agreement']}"), []).append(r["family"])
    for (name, mode, outcome), fams in sorted(classes.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(fams[:4]) + (f" (+{len(fams) - 4})" if len(fams) > 4 else "")
        lines.append(f"| {name.replace('|', '/')} | {mode} | {outcome} | {len(fams)}: {shown} |")
    unbuilt = {}
    for r in records:
        if r.get("built") is not True:
            unbuilt.setdefault(normalised(r["built"])[:80], []).append(r["family"])
    lines += ["", "| not built: why | families |", "|---|---|"]
    for why, fams in sorted(unbuilt.items(), key=lambda item: -len(item[1])):
        lines.append(
            f"| {why.replace('|', '/')} | {len(fams)}: {', '.join(fams[:4])}{' ...' if len(fams) > 4 else ''} |"
        )
    return "\n".join(lines)


def _counter(rows: list[dict]):
    """How many of `rows` have `key` equal to `value`."""
    return lambda key, value: sum(r[key] == value for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="*", choices=tuple(MODES), default=["plain"])
    parser.add_argument("--only", nargs="*", help="families (model_type names) to run")
    parser.add_argument("--shard", default="0/1", help="I/N: every Nth family from the Ith (0-based)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per command")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the summary of the results file and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.results))
        return
    sys.path.insert(0, str(ROOT))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    sweep(args)


if __name__ == "__main__":
    main()
