"""How an explanation looks: tables for the terminal, a character grid of a tensor's shards, SVG."""

from __future__ import annotations

import html
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from ..frontend.patterns import starred
from .layouts import TensorInfo
from .simulate import Explanation, select
from .stepping import FIT_CAP

#: Block symbols of the terminal grid, and fill colours of the SVG (colour-blind-safe, then more).
SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")


def size(n: int) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r > start else str(r))
            start = None
    return ",".join(parts)


def _unit(t: TensorInfo, n: int) -> str:
    """The fully_shard unit that gathers `t` (for a collapsed row, its name starred as the row's is)."""
    if t.unit is None:
        return "-"
    return starred(t.unit) if n > 1 else t.unit


def grouped(tensors: Sequence[TensorInfo]) -> list[tuple[str, TensorInfo, int]]:
    """Rows for the table: tensors that differ only in integer path segments (layers.0, layers.1, ...)
    collapse into one row named with `*`, with how many it stands for."""
    rows: dict[tuple, list] = {}
    for t in tensors:
        key = (
            starred(t.name),
            t.kind,
            t.shape,
            t.dtype,
            t.layout,
            t.local_shape,
            t.local_bytes,
        )
        rows.setdefault(key, [t.name, t, 0])[2] += 1
    return [(key[0] if n > 1 else name, t, n) for key, (name, t, n) in rows.items()]


def render_text(e: Explanation, console: Console, pattern: str | None = None) -> None:
    meshes = "; ".join(f"mesh {name}: " + " x ".join(f"{d}={n}" for d, n in dims) for name, dims in e.meshes)
    console.print(f"[bold]{e.plan}[/bold] at world {e.world_size}, as rank {e.rank} sees it ({meshes})")

    tensors = select(e, pattern)
    console.print(f"\nparameters and buffers on rank {e.rank}")
    table = Table(header_style="bold")
    for column, justify in (
        ("name", "left"),
        ("global", "right"),
        ("dtype", "left"),
        ("placements", "left"),
        ("local", "right"),
        ("bytes", "right"),
        ("unit", "left"),
    ):
        table.add_column(column, justify=justify)
    for name, t, n in grouped(tensors):
        table.add_row(
            name + (f" (x{n})" if n > 1 else ""),
            shape_text(t.shape),
            t.dtype,
            t.layout,
            shape_text(t.local_shape),
            size(t.local_bytes),
            _unit(t, n),
        )
    console.print(table)

    console.print("\nmemory per rank (AdamW: two fp32 states; gathered: the largest fully_shard unit, unsharded)")
    table = Table(header_style="bold")
    for column in ("", "params", "grads", "optimizer", "gathered", "total"):
        table.add_column(column, justify="right" if column else "left")
    for label, r in (
        (f"rank {e.rank}", e.this_rank),
        (f"largest: rank {e.largest.rank}", e.largest),
        (f"smallest: rank {e.smallest.rank}", e.smallest),
    ):
        table.add_row(label, size(r.params), size(r.grads), size(r.optimizer), size(r.gathered), size(r.total))
    console.print(table)
    console.print(f"spread between the largest and the smallest rank: {size(e.spread)}")

    if e.pipeline is not None:
        render_pipeline(e, console)
    if e.collectives:
        what = (
            "every microbatch's forward and backward, then the gradients' reduction"
            if e.pipeline is not None
            else "forward, loss, backward"
        )
        console.print(f"\ncollectives of one training step on rank {e.rank} ({what})")
        table = Table(header_style="bold")
        for column, justify in (("op", "left"), ("mesh dim", "left"), ("count", "right"), ("bytes", "right")):
            table.add_column(column, justify=justify)
        for c in e.collectives:
            table.add_row(c.op, c.mesh_dim, str(c.count), size(c.bytes))
        console.print(table)
    render_peak(e, console)
    for note in e.notes:
        console.print(f"note: {note}")
    for t in tensors:
        if t.blocks:
            console.print("\n" + grid(t), highlight=False, markup=False)


def blocks_text(blocks: Sequence[str]) -> str:
    """('layers.0', 'layers.1', 'layers.2') -> 'layers.0-2'; other names are listed."""
    stems = {b.rpartition(".")[0] for b in blocks}
    tails = [b.rpartition(".")[2] for b in blocks]
    if len(stems) == 1 and len(blocks) > 1 and all(t.isdigit() for t in tails):
        numbers = [int(t) for t in tails]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            stem = stems.pop()
            return f"{stem}.{numbers[0]}-{numbers[-1]}" if stem else f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(blocks)


def render_pipeline(e: Explanation, console: Console) -> None:
    """Every stage (what it holds, its microbatches in flight, what it sends) and every pp rank (its
    peak, its bubble)."""
    p = e.pipeline
    per = f" x {p.stages_per_rank} stages" if p.stages_per_rank > 1 else ""
    size_of = f" of {p.microbatch}" if p.microbatch is not None else ""
    console.print(
        f"\npipeline over {p.mesh_dim}: {p.pp} pp ranks{per}, schedule {p.schedule} ({p.torch_class}), "
        f"{p.microbatches} microbatches{size_of}"
    )
    timed = p.span is not None
    table = Table(header_style="bold")
    columns = ["stage", "pp rank", "holds", "parameters", "on a rank", "in flight"]
    if timed:
        columns += ["activations / mb", "send / step", "recv / step", "forward / mb", "backward / mb"]
    for column in columns:
        table.add_column(column, justify="left" if column == "holds" else "right")
    for st in p.stages:
        row = [
            str(st.stage),
            str(st.pp_rank),
            ", ".join(filter(None, (blocks_text(st.blocks), *st.modules))),
            f"{st.parameters:,}",
            size(st.parameter_bytes),
            str(st.in_flight),
        ]
        if timed:
            row += [
                size(st.activations),
                size(st.send),
                size(st.recv),
                seconds_text(st.forward),
                seconds_text(st.backward),
            ]
        table.add_row(*row)
    console.print(table)
    table = Table(header_style="bold")
    columns = ["pp rank", "stages", "bubble"]
    if timed:
        columns += ["peak memory", "busy", "p2p sends", "step"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in p.ranks:
        row = [str(r.pp_rank), ", ".join(map(str, r.stages)), f"{r.bubble:.1%}"]
        if timed:
            row += [size(r.peak), seconds_text(r.busy), seconds_text(r.p2p), seconds_text(r.seconds)]
        table.add_row(*row)
    console.print(table)
    console.print(
        f"bubble: {p.bubble:.1%} of the pp ranks' time ({p.bubble_basis}); textbook (pp - 1) / "
        f"({'v m' if p.stages_per_rank > 1 else 'm'} + pp - 1) = {p.textbook_bubble:.1%}; order: {p.order}"
    )


def seconds_text(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def render_peak(e: Explanation, console: Console) -> None:
    """The step's peak memory with what is live at it, its estimated time, and --fit's answer."""
    p, t = e.peak, e.time
    if p is None:
        return
    if e.pipeline is not None:
        pipe = e.pipeline
        steps = (
            f"{pipe.microbatches} microbatches of {pipe.microbatch} as {pipe.schedule} orders them, "
            "their activations in flight, the gradients' reduction, AdamW step"
        )
    else:
        steps = "forward, loss, backward, AdamW step"
    console.print(
        f"\npeak memory of one training step on rank {e.rank}: [bold]{size(p.bytes)}[/bold] "
        f"(batch {p.batch} per replica, {p.tokens} tokens; {steps}, its states "
        "already there as after the first step)"
    )
    table = Table(header_style="bold")
    table.add_column("live at the peak", justify="left")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    for name, n in p.categories:
        table.add_row(name, size(n), f"{n / max(p.bytes, 1):.0%}")
    console.print(table)
    if p.host:
        held = ", ".join(f"{name} {size(n)}" for name, n in p.host_categories if n)
        console.print(
            f"host memory of the units that offload to the CPU: [bold]{size(p.host)}[/bold] at its most ({held}); "
            "the peak above is the accelerator's"
        )
    if p.modules:
        table = Table(header_style="bold")
        table.add_column(f"activations at the peak, top {len(p.modules)} modules", justify="left")
        table.add_column("bytes", justify="right")
        for name, n in p.modules:
            table.add_row(name, size(n))
        console.print(table)
    if t is not None:
        console.print(
            f"\nestimated step time on {t.gpu}: [bold]{seconds_text(t.seconds)}[/bold], "
            f"{t.tokens_per_s:,.0f} tokens/s over {p.replicas} replica{'s' if p.replicas != 1 else ''}, MFU {t.mfu:.1%}"
        )
        table = Table(header_style="bold")
        table.add_column("", justify="left")
        table.add_column("time", justify="right")
        table.add_column("detail", justify="left")
        table.add_row(
            "compute",
            seconds_text(t.compute),
            f"{t.flops / 1e12:.1f} TFLOP ({t.model_flops / 1e12:.1f} without recomputation), roofline per op",
        )
        if t.recompute:
            table.add_row("  of it recomputation", seconds_text(t.recompute), "activation checkpointing")
        for d in t.dims:
            table.add_row(
                f"{d.mesh_dim} collectives",
                seconds_text(d.seconds),
                f"{size(d.bytes)} over {d.group} ranks by {d.link}, {'overlapped (FSDP)' if d.overlapped else 'exposed'}",
            )
        for label, seconds, nbytes, what in (
            ("H2D copies", t.h2d, t.h2d_bytes, "the offloaded shards before their all-gathers"),
            ("D2H copies", t.d2h, t.d2h_bytes, "the reduce-scattered gradients"),
        ):
            if nbytes:
                table.add_row(label, seconds_text(seconds), f"{size(nbytes)}, {what}, by PCIe, overlapped (FSDP)")
        table.add_row("exposed communication", seconds_text(t.exposed), "")
        if t.cpu_bytes:
            table.add_row(
                "CPU",
                seconds_text(t.cpu),
                f"{size(t.cpu_bytes)} read and written over host tensors (the offloaded AdamW step), after the GPU's",
            )
        if e.pipeline is not None and e.pipeline.span is not None:
            pipe = e.pipeline
            mine = pipe.ranks[pipe.pp_rank]
            table.add_row(
                "pipeline",
                seconds_text(pipe.span),
                f"the timetable's span: {pipe.bubble:.1%} bubble over all pp ranks ({mine.bubble:.1%} on pp rank "
                f"{mine.pp_rank}), sends over {pipe.mesh_dim} {seconds_text(mine.p2p)} on it",
            )
            table.add_row("step", seconds_text(t.seconds), "the slowest pp rank: its span, its reduction, AdamW")
        table.add_row(
            "host", seconds_text(t.host), f"{t.kernels} kernel launches, {t.dtensor_ops} DTensor ops dispatched"
        )
        console.print(table)
    if e.fit is not None:
        f = e.fit
        tried = ", ".join(f"{b}: {size(n)}" for b, n in f.tried)
        if f.sequence is not None:
            answer = (
                f"{f.sequence:,} tokens per sequence, batch {f.batch} per replica (peak {size(f.peak)})"
                if f.sequence
                else f"nothing: the shortest sequence that splits already needs {size(f.peak)}"
            )
            console.print(f"\nlongest sequence that fits {size(f.limit)}: [bold]{answer}[/bold] (tried {tried})")
            return
        answer = (
            f"batch {f.batch} per replica (peak {size(f.peak)})"
            if f.batch
            else f"nothing: batch 1 already needs {size(f.peak)}"
        )
        if f.batch == FIT_CAP:
            answer += ", where the search stops: larger batches were not tried"
        console.print(f"\nlargest batch that fits {size(f.limit)}: [bold]{answer}[/bold] (tried {tried})")


def render_compare(a: Explanation, b: Explanation, console: Console) -> None:
    """Two plans for the same model and world, side by side: peak, bytes per mesh dim, step time."""
    console.print(f"\n[bold]{a.plan}[/bold] against [bold]{b.plan}[/bold] at world {a.world_size}, rank {a.rank}")
    table = Table(header_style="bold")
    for column, justify in (("", "left"), (a.plan, "right"), (b.plan, "right"), ("difference", "right")):
        table.add_column(column, justify=justify)

    def row(label: str, x, y, text) -> None:
        if x is None and y is None:
            return
        difference = "" if x is None or y is None else ("+" if y >= x else "-") + text(abs(y - x))
        table.add_row(label, "-" if x is None else text(x), "-" if y is None else text(y), difference)

    row("peak memory", a.peak and a.peak.bytes, b.peak and b.peak.bytes, size)
    for category in ("parameters", "gathered", "gradients", "optimizer", "activations", "temporary"):
        row(f"  {category}", a.peak and a.peak.category(category), b.peak and b.peak.category(category), size)
    if (a.peak and a.peak.host) or (b.peak and b.peak.host):
        row("host memory (offload)", a.peak and a.peak.host, b.peak and b.peak.host, size)
    dims = sorted({c.mesh_dim for c in (*a.collectives, *b.collectives)})
    for dim in dims:
        x = sum(c.bytes for c in a.collectives if c.mesh_dim == dim)
        y = sum(c.bytes for c in b.collectives if c.mesh_dim == dim)
        row(f"bytes on {dim}", x, y, size)
    row("step time", a.time and a.time.seconds, b.time and b.time.seconds, seconds_text)
    row("tokens/s", a.time and a.time.tokens_per_s, b.time and b.time.tokens_per_s, lambda v: f"{v:,.0f}")
    console.print(table)


def _plane(t: TensorInfo) -> tuple[int, int]:
    """The 2-D view a picture draws: rows x columns (a vector is one row)."""
    if len(t.shape) == 0:
        return 1, 1
    if len(t.shape) == 1:
        return 1, t.shape[0]
    return t.shape[0], t.shape[1]


def _box(t: TensorInfo, offset, shape) -> tuple[int, int, int, int]:
    """A block's rows and columns in the plane: (row0, row1, col0, col1)."""
    if len(t.shape) == 0:
        return 0, 1, 0, 1
    if len(t.shape) == 1:
        return 0, 1, offset[0], offset[0] + shape[0]
    return offset[0], offset[0] + shape[0], offset[1], offset[1] + shape[1]


def grid(t: TensorInfo, max_rows: int = 16, max_cols: int = 48) -> str:
    """A small character picture of a tensor's blocks, each drawn with its symbol, and the legend."""
    rows, cols = _plane(t)
    height, width = min(rows, max_rows), min(cols, max_cols)
    cells = [["." for _ in range(width)] for _ in range(height)]
    legend = []
    for i, (offset, shape, ranks) in enumerate(t.blocks):
        symbol = SYMBOLS[i % len(SYMBOLS)]
        r0, r1, c0, c1 = _box(t, offset, shape)
        legend.append(
            f"  {symbol}: rows {r0}-{r1 - 1}, cols {c0}-{c1 - 1} on ranks {ranks_text(ranks)}"
            if r1 > r0 and c1 > c0
            else f"  {symbol}: empty on ranks {ranks_text(ranks)}"
        )
        for y in range(height):
            for x in range(width):
                if r0 <= y * rows // height < r1 and c0 <= x * cols // width < c1:
                    cells[y][x] = symbol
    picture = "\n".join("  " + "".join(row) for row in cells)
    return f"{t.name} {shape_text(t.shape)} ({t.layout}):\n{picture}\n" + "\n".join(legend)


def render_svg(e: Explanation, pattern: str | None) -> str:
    """One SVG document: for each tensor `pattern` picks, its plane split into blocks, one `rect` of
    class `shard` per block, coloured and labelled by the ranks that hold it."""
    width, margin, title_h = 640, 20, 36
    pictures, y = [], margin
    for t in (t for t in select(e, pattern) if t.blocks):
        rows, cols = _plane(t)
        scale = (width - 2 * margin) / max(cols, 1)
        height = max(24.0, min(400.0, rows * scale))
        row_h = height / max(rows, 1)
        parts = [
            f'<text x="{margin}" y="{y + 20}" font-size="14" font-family="monospace">'
            f"{html.escape(t.name)} {shape_text(t.shape)} {html.escape(t.layout)}</text>"
        ]
        top = y + title_h
        parts.append(
            f'<rect x="{margin}" y="{top}" width="{width - 2 * margin}" height="{height:.1f}" fill="none" stroke="#333"/>'
        )
        for i, (offset, shape, ranks) in enumerate(t.blocks):
            r0, r1, c0, c1 = _box(t, offset, shape)
            bx, by = margin + c0 * scale, top + r0 * row_h
            bw, bh = max((c1 - c0) * scale, 0.0), max((r1 - r0) * row_h, 0.0)
            label = ranks_text(ranks)
            parts.append(
                f'<rect class="shard" data-ranks="{label}" data-offset="{",".join(map(str, offset))}" '
                f'data-shape="{",".join(map(str, shape))}" x="{bx:.1f}" y="{by:.1f}" width="{bw:.1f}" height="{bh:.1f}" '
                f'fill="{COLOURS[i % len(COLOURS)]}" stroke="white" stroke-width="1"><title>ranks {label}</title></rect>'
            )
            if bw >= 24 and bh >= 12:
                parts.append(
                    f'<text x="{bx + bw / 2:.1f}" y="{by + bh / 2 + 4:.1f}" font-size="11" text-anchor="middle" '
                    f'font-family="monospace" fill="white">{label}</text>'
                )
        pictures.append("\n".join(parts))
        y = top + height + margin
    body = "\n".join(pictures) if pictures else f'<text x="{margin}" y="{margin + 14}">no tensor matches</text>'
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{max(y, 60):.0f}" '
        f'viewBox="0 0 {width} {max(y, 60):.0f}">\n{body}\n</svg>\n'
    )


def render_held_compare(a, b, console: Console) -> None:
    """Two plans side by side without a simulated step, which has the peak, the bytes sent and the step time:
    what rank R and the largest rank hold for training (the memory-per-rank table's columns)."""
    console.print(
        f"\n[bold]{a.plan}[/bold] against [bold]{b.plan}[/bold] at world {a.world_size}, rank {a.rank}: what each"
        " rank holds (peak memory, bytes sent and step time need the training step: drop --no-step)"
    )
    table = Table(header_style="bold")
    for column, justify in (("", "left"), (a.plan, "right"), (b.plan, "right"), ("difference", "right")):
        table.add_column(column, justify=justify)

    def row(label: str, x: int, y: int) -> None:
        table.add_row(label, size(x), size(y), ("+" if y >= x else "-") + size(abs(y - x)))

    mine, theirs = a.this_rank, b.this_rank
    for label, field in (
        ("parameters", "params"),
        ("gradients", "grads"),
        ("optimizer states", "optimizer"),
        ("gathered (largest unit)", "gathered"),
    ):
        row(f"rank {a.rank}: {label}", getattr(mine, field), getattr(theirs, field))
    row(f"rank {a.rank}: total", mine.total, theirs.total)
    row("largest rank's total", a.largest.total, b.largest.total)
    console.print(table)
