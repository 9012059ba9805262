"""How long the simulated step would take on a named accelerator: a roofline for the ops, a ring model
for the collectives, and FSDP's prefetch hiding its own collectives behind compute.

Compute: every op of the simulated step (forward, loss, backward with any recomputation, optimizer
step) costs max(FLOPs / achieved FLOP/s, bytes read and written / achieved HBM bandwidth) (the
data-sheet peaks times `FLOP_EFFICIENCY`, `HBM_EFFICIENCY`): FLOPs from torch's own
formulas (torch.utils.flop_counter), at the bf16 peak where an input is bf16 or fp16 and at the fp32
peak otherwise. torch's RuntimeEstimator does the same roofline but asks the CUDA device for its
peaks (it refuses to run without one), so explain keeps its own table of them (`GPUS`).

Communication: a collective over a group of n ranks moves (n - 1) / n of its buffer for an
all-gather, a reduce-scatter or an all-to-all and 2 (n - 1) / n for an all-reduce (ring algorithms),
at the link's bandwidth, plus the link's latency once per call. A mesh dim is inside a node when the
ranks of one of its groups span at most `gpus_per_node` consecutive ranks (mesh dims are laid out
row-major over the ranks, the last dim fastest); such dims use NVLink, the others InfiniBand.

Overlap: FSDP's all-gathers and reduce-scatters (c10d ops on their own streams, prefetched) hide
behind compute; the rest (tensor parallelism's functional collectives, which the next op waits for) do
not. GPU time = compute + exposed communication + max(0, FSDP communication - compute).

Host: eager PyTorch launches every kernel from Python and dispatches every DTensor op on the CPU
(`LAUNCH_S`, `DTENSOR_S` each). The step takes the longer of the GPU's time and the host's.

CPU offload (memory.py tells which ops and copies these are): each H2D copy of a shard before its
all-gather and each D2H copy of a reduce-scattered gradient moves its bytes over the host link (PCIe,
`Accelerator.pcie` each way, `PCIE_LATENCY` per copy; `--link host=...` sets it) and costs a launch.
FSDP2 issues the H2D copies on its all-gather copy-in stream (`foreach_all_gather`, in
`all_gather_inputs`) and the D2H copies on its reduce-scatter stream (`foreach_reduce`, non-blocking
into pinned memory), both beside the compute stream, prefetched as the collectives are: they join
FSDP's overlapped communication (added to it, as one unit's copy-in precedes its all-gather). The
ops over host tensors (the optimizer step of the offloaded parameters) run on the CPU at
`CPU_BANDWIDTH` bytes read and written per second, after the backward (the step waits for the last
D2H copy) and before the next forward (whose H2D copies read the updated parameters): step = max(GPU,
host) + CPU.
"""

from __future__ import annotations

import math
import re

from attrs import frozen


@frozen
class Accelerator:
    """Peak dense FLOP/s (bf16 on tensor cores; fp32 without TF32, as torch multiplies fp32 by
    default), HBM bandwidth and the NVLink bandwidth a collective achieves between GPUs of a node
    (NCCL's bus bandwidth, about 80% of the unidirectional line rate), all from the data sheets."""

    name: str
    bf16: float
    fp32: float
    hbm: float
    nvlink: float
    #: Host <-> GPU copies, each way: PCIe x16 (Gen4 for the A100, Gen5 for the others: 32 and 64 GB/s
    #: on the data sheet), at what pinned copies achieve (~80%). A prior, not fitted.
    pcie: float


#: Data-sheet numbers (SXM parts, dense, no sparsity).
GPUS = {
    "a100": Accelerator("A100 SXM 80GB", 312e12, 19.5e12, 2.039e12, 240e9, 25e9),
    "h100": Accelerator("H100 SXM", 989.4e12, 66.9e12, 3.35e12, 360e9, 50e9),
    "h200": Accelerator("H200 SXM", 989.4e12, 66.9e12, 4.8e12, 360e9, 50e9),
    "b200": Accelerator("B200", 2250e12, 80e12, 8.0e12, 720e9, 50e9),
}
#: NVLink's latency per collective, and InfiniBand's bandwidth per GPU (400 Gb/s NDR, ~45 GB/s
#: achieved) and latency: the defaults for a mesh dim within a node and across nodes.
NVLINK_LATENCY = 10e-6
IB_BANDWIDTH, IB_LATENCY = 45e9, 20e-6


#: Eager PyTorch on the host: seconds per kernel launched (Python, dispatcher, CUDA launch) and per
#: DTensor op dispatched (sharding propagation, redistribution, wrapping), on top of its local kernels.
#: A step whose GPU work is shorter than its host work runs at the host's pace. LAUNCH_S is a prior;
#: DTENSOR_S is fitted (benchmarks/explain_calibration.py, benchmarks/RESULTS.md): the four TP plans of
#: the 1B model on 2 and 4 x H100 (torch 2.11) ran 2.4-3.3x the 40 us prior's estimate; 120 us per op
#: puts all four within 19% (the extra step of activation checkpointing's recomputation alone says
#: 113 us: 1,248 more DTensor ops, 145 ms more).
LAUNCH_S = 5e-6
DTENSOR_S = 120e-6
#: What kernels reach of the data-sheet peaks: cuBLAS GEMMs of transformer sizes some 70% of the dense
#: bf16 peak, elementwise and reduction kernels some 80% of HBM bandwidth. Priors, not fitted.
FLOP_EFFICIENCY = 0.7
HBM_EFFICIENCY = 0.8
#: CPU offload: the fixed cost of one host <-> GPU copy (a DMA on the copy engine), and the bytes per
#: second that ops over host tensors read and write on the CPU. The optimizer step is the one such op:
#: torch's fused AdamW has a CPU kernel (torch 2.4 and newer), counted as 32 bytes per fp32 parameter
#: element (reads parameter, gradient and two states; its schema writes all four). Priors, not fitted:
#: on one thread (what torchrun gives each worker: OMP_NUM_THREADS=1) of this project's AMD EPYC
#: development machine it ran 1.0-1.7 G elements/s (34-55 GB/s so counted; torch 2.13); servers' single
#: cores differ, so 30 GB/s. foreach AdamW, which has no CPU kernels, ran 5-10x slower there, and the
#: per-parameter loop (torch's default for CPU tensors) 3-4x slower.
PCIE_LATENCY = 10e-6
CPU_BANDWIDTH = 30e9


@frozen
class Link:
    bandwidth: float  # bytes per second
    latency: float  # seconds per collective call


@frozen
class Hardware:
    """What the estimate assumes: the accelerator's peaks, and the links by mesh dim."""

    gpu: str
    bf16: float
    fp32: float
    hbm: float
    gpus_per_node: int = 8
    intra: Link = Link(360e9, NVLINK_LATENCY)
    inter: Link = Link(IB_BANDWIDTH, IB_LATENCY)
    #: Given links, by dim name (`dp`, or `mesh.dp`).
    links: tuple[tuple[str, Link], ...] = ()
    #: The host's time per kernel launched and per DTensor op dispatched (eager mode).
    launch: float = 0.0
    dtensor: float = 0.0
    #: The fractions of the peaks kernels reach (`FLOP_EFFICIENCY`, `HBM_EFFICIENCY`).
    flop_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    #: CPU offload: the host <-> GPU link (each way) and the CPU's bytes per second over host tensors.
    pcie: Link = Link(50e9, PCIE_LATENCY)
    cpu: float = CPU_BANDWIDTH


def hardware(
    gpu: str = "h100",
    flops: float | None = None,
    hbm: float | None = None,
    links: str | None = None,
    gpus_per_node: int = 8,
) -> Hardware:
    """A named accelerator, with any of its numbers replaced: `flops` (the bf16 peak; fp32 scales
    with it), `hbm` (bytes/s), `links` (`dp=50GB/s,tp=450GB/s:5us`; `host` names the PCIe link of CPU
    offload's copies, `mesh.host` a mesh dim called host)."""
    if gpu not in GPUS:
        raise ValueError(f"unknown accelerator {gpu!r}: one of {', '.join(GPUS)}")
    card = GPUS[gpu]
    bf16, fp32 = card.bf16, card.fp32
    if flops is not None:
        bf16, fp32 = flops, fp32 * flops / card.bf16
    given = parse_links(links) if links else ()
    # `host` is the PCIe link (its latency defaults to a copy's, not NVLink's).
    pcie = dict(parse_links(links, PCIE_LATENCY) if links else ()).get("host", Link(card.pcie, PCIE_LATENCY))
    return Hardware(
        card.name if flops is None and hbm is None else f"{card.name} (given peaks)",
        bf16,
        fp32,
        hbm if hbm is not None else card.hbm,
        gpus_per_node,
        Link(card.nvlink, NVLINK_LATENCY),
        Link(IB_BANDWIDTH, IB_LATENCY),
        tuple((dim, link) for dim, link in given if dim != "host"),
        LAUNCH_S,
        DTENSOR_S,
        FLOP_EFFICIENCY,
        HBM_EFFICIENCY,
        pcie,
        CPU_BANDWIDTH,
    )


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_number(text: str, what: str = "bytes/s") -> float:
    """`50GB/s`, `3.35T`, `989e12`, `450 GB/s` -> a number (decimal prefixes)."""
    found = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgtp]?)(?:b/s|flop/s|flops|b)?\s*", text.lower())
    if not found:
        raise ValueError(f"{text!r} is not a number of {what} (like 50GB/s or 989e12)")
    return float(found.group(1)) * _UNITS[found.group(2)]


def parse_size(text: str) -> int:
    """`80GiB`, `80GB`, `85899345920` -> bytes (GiB binary, GB decimal)."""
    found = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not found:
        raise ValueError(f"{text!r} is not a size (like 80GiB)")
    power = "kmgt".index(found.group(2)) + 1 if found.group(2) else 0
    return int(float(found.group(1)) * (1024 if found.group(3) else 1000) ** power)


def parse_links(text: str, default_latency: float = NVLINK_LATENCY) -> tuple[tuple[str, Link], ...]:
    """`dp=50GB/s,tp=450GB/s:5us` -> ((dim, Link), ...); latency defaults to `default_latency`."""
    links = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        dim, _, value = part.partition("=")
        rate, _, latency = value.partition(":")
        if not dim or not rate:
            raise ValueError(f"{part!r}: a link is DIM=BANDWIDTH[:LATENCY], like dp=50GB/s:20us")
        seconds = default_latency
        if latency:
            found = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)\s*", latency)
            if not found:
                raise ValueError(f"{latency!r} is not a latency (like 20us)")
            seconds = float(found.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[found.group(2)]
        links.append((dim.strip(), Link(parse_number(rate), seconds)))
    return tuple(links)


#: What a simulated step's ops cost: ((kind, FLOPs, bytes, low precision, recomputed), how many), sorted.
Tally = tuple[tuple[tuple[str, int, int, bool, bool], int], ...]


@frozen
class DimTime:
    mesh_dim: str
    link: str  # "nvlink" | "infiniband" | "given"
    group: int  # ranks in one group
    bytes: int  # bytes the collectives' buffers hold over the step
    seconds: float
    overlapped: bool  # FSDP's: hidden behind compute where compute is longer


@frozen
class StepTime:
    gpu: str
    seconds: float  # the step: compute + exposed communication, or the host's time if longer
    host: float  # the CPU's time to launch the step's kernels and dispatch its DTensor ops
    kernels: int
    dtensor_ops: int
    compute: float
    recompute: float  # the part of compute that recomputes checkpointed activations
    communication: float  # all collectives, overlapped or not
    exposed: float  # communication not hidden behind compute
    dims: tuple[DimTime, ...]
    flops: int  # counted over the step, recomputation included
    model_flops: int  # without recomputation
    tokens_per_s: float  # batch x sequence x replicas / step
    mfu: float  # model FLOPs / (step x bf16 peak)
    #: CPU offload: the copies over the host link (overlapped with compute, in `communication`), and
    #: the ops over host tensors on the CPU (the optimizer step; in `seconds`, after the GPU's work).
    h2d: float = 0.0
    h2d_bytes: int = 0
    d2h: float = 0.0
    d2h_bytes: int = 0
    cpu: float = 0.0
    cpu_bytes: int = 0


@frozen
class Fit:
    """--fit: the largest per-replica batch whose predicted peak is at most `limit` (0: not even 1); under
    context parallelism, the longest sequence at that batch (0: not even the shortest that splits)."""

    limit: int
    batch: int
    peak: int  # at that batch (or sequence)
    tried: tuple[tuple[int, int], ...]  # (batch, peak) of every step simulated; (sequence, peak) for a sequence
    sequence: int | None = None  # tokens per sequence, when the search was over the sequence length


def _unit_dims(units) -> set[str]:
    """The `mesh.dim` names (and flattened `world[dp*ep]` ones) the collectives of units over `units` run on."""
    dims = {"world"} if units else set()
    for ref in units:
        if ref.flat:
            dims.add(str(ref))
        else:
            dims.update(f"{ref.mesh}.{d}" for d in ref.dims)
    return dims


def _ring(op: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if "gather" in op or "scatter" in op or "alltoall" in op or "all_to_all" in op:
        return (n - 1) / n
    if "reduce" in op:
        return 2 * (n - 1) / n
    return 1.0


def dim_layout(meshes, world_size: int, gpus_per_node: int, flat=()) -> dict[str, tuple[int, bool]]:
    """`mesh.dim` (and `world`, and each flattened ref of `flat`, `world[dp*ep]`) -> (group size, inside
    one node). A group's ranks span from its first to its last: the sum of (size - 1) x stride over its
    dims, plus one."""
    layout = {"world": (world_size, world_size <= gpus_per_node)}
    strides = {}
    for mesh, dims in meshes:
        sizes = [n for _, n in dims]
        for i, (dim, n) in enumerate(dims):
            strides[(mesh, dim)] = (n, math.prod(sizes[i + 1 :]))
            layout[f"{mesh}.{dim}"] = (n, n * strides[(mesh, dim)][1] <= gpus_per_node)
    for ref in flat:
        parts = [strides[(ref.mesh, d)] for d in ref.dims]
        span = 1 + sum((n - 1) * stride for n, stride in parts)
        layout[str(ref)] = (math.prod(n for n, _ in parts), span <= gpus_per_node)
    return layout


def link_of(mesh_dim: str, layout: dict, world_size: int, hw: Hardware) -> tuple[Link, str, int]:
    """The link a mesh dim's traffic takes, its kind ("given", "nvlink", "infiniband") and the dim's
    group size; `layout` is `dim_layout`'s."""
    n, inside = layout.get(mesh_dim, (world_size, world_size <= hw.gpus_per_node))
    given = dict(hw.links)
    short = mesh_dim.rpartition(".")[2]
    if mesh_dim in given:
        return given[mesh_dim], "given", n
    if short in given:
        return given[short], "given", n
    return (hw.intra, "nvlink", n) if inside else (hw.inter, "infiniband", n)


def step_time(
    tally: Tally,
    collectives,
    meshes,
    world_size: int,
    hw: Hardware,
    tokens: int,
    replicas: int,
    flat=(),
    units=None,
) -> StepTime:
    """`units`: the meshes of the plan's fully_shard and replicate blocks (MeshRefs), whose dims alone carry
    FSDP's and DDP's overlapped collectives; None: every c10d eager collective is taken as theirs."""
    data_parallel = None if units is None else _unit_dims(units)
    compute = recompute = 0.0
    flops = model_flops = 0
    kernels = dtensor_ops = 0
    copied = {"h2d": [0, 0], "d2h": [0, 0]}  # bytes, copies
    cpu_bytes = 0
    for (kind, op_flops, moved, low, recomputed), count in tally:
        if kind == "dtensor":
            dtensor_ops += count
            continue
        if kind in copied:
            copied[kind][0] += moved * count
            copied[kind][1] += count
            kernels += count
            continue
        if kind == "cpu":
            cpu_bytes += moved * count
            continue
        kernels += count if kind == "kernel" else 0
        seconds = max(
            op_flops / ((hw.bf16 if low else hw.fp32) * hw.flop_efficiency), moved / (hw.hbm * hw.hbm_efficiency)
        )
        seconds *= count
        compute += seconds
        flops += op_flops * count
        if recomputed:
            recompute += seconds
        else:
            model_flops += op_flops * count
    layout = dim_layout(meshes, world_size, hw.gpus_per_node, flat)
    per_dim: dict[tuple[str, bool], list] = {}
    for c in collectives:
        link, kind, n = link_of(c.mesh_dim, layout, world_size, hw)
        seconds = c.bytes * _ring(c.op, n) / link.bandwidth + c.count * link.latency if n > 1 else 0.0
        fsdp = c.op.endswith("_")  # c10d's eager ops: FSDP's; functional ones: DTensor's
        if data_parallel is not None:
            # ... on a dim a unit runs over: expert parallelism's own eager ones (its counts' all-to-all,
            # the gather of a shared batch) wait for their result, on a dim no unit uses
            fsdp = fsdp and "alltoall" not in c.op and c.mesh_dim in data_parallel
        row = per_dim.setdefault((c.mesh_dim, fsdp), [kind, n, 0, 0.0])
        row[2] += c.bytes
        row[3] += seconds
    dims = tuple(DimTime(d, k, n, b, s, fsdp) for (d, fsdp), (k, n, b, s) in sorted(per_dim.items()))
    h2d, d2h = (copied[k][0] / hw.pcie.bandwidth + copied[k][1] * hw.pcie.latency for k in ("h2d", "d2h"))
    overlapped = sum(d.seconds for d in dims if d.overlapped) + h2d + d2h
    exposed_tp = sum(d.seconds for d in dims if not d.overlapped)
    exposed = exposed_tp + max(0.0, overlapped - compute)
    host = kernels * hw.launch + dtensor_ops * hw.dtensor
    cpu = cpu_bytes / hw.cpu
    seconds = max(compute + exposed, host) + cpu
    return StepTime(
        hw.gpu,
        seconds,
        host,
        kernels,
        dtensor_ops,
        compute,
        recompute,
        overlapped + exposed_tp,
        exposed,
        dims,
        flops,
        model_flops,
        tokens * replicas / seconds if seconds else 0.0,
        model_flops / (seconds * hw.bf16) if seconds else 0.0,
        h2d,
        copied["h2d"][0],
        d2h,
        copied["d2h"][0],
        cpu,
        cpu_bytes,
    )
