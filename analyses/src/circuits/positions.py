"""Position-resolved edges: an edge s -> r at position class c is sender s's output at the positions of
class c as receiver r reads it there. The residual stream is per position, so an edge lives within one
position; attention moves information across positions inside a receiving head (its k and v inputs at
one position feed its output at later ones), which is why a head's key and value edges are resolved by
the key's position and its query edges by the query's.

A class is a set of token positions per prompt: every position of its own (`--positions each`: class p
is position p of the padded prompts), or a templated task's named positions (IOI's S1, S2, IO, END and
`other`, the rest: `--positions classes`), so that prompts whose templates differ in length still share
classes. `Positions` holds the labels, [n_prompts, n_positions] with each token's class.

Scores [S, R, C]: EAP and EAP-IG keep the attribution (corrupted - clean value of s) . d metric / d input_r
summed over d and the batch but apart per class (`Runner.eap(positions=...)`), so they sum over classes to
the position-free scores; exact patching (`patch_edges`) patches one sender's value into one receiver at
one class's positions only. Circuits are the top-n of the S x R x C position edges by |score| (dangling
edges pruned on the graph with positions merged, which only drops edges that dangle at every position);
faithfulness at MIB's sizes counts fractions of the position edges (n_edges x C).

Cost: the score tensor and the patching mask grow by C; the attribution passes (forwards and backwards)
do not change, the contraction of values and gradients is split per class (the same multiply-adds); a
patched run multiplies each receiver's senders by a per-position weight instead of a per-receiver one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .._common import progress
from .graph import FRACTIONS, Graph, Task, prune_dangling
from .runner import _Patching
from .tasks import IOI_CLASSES
from .graph import areas
from ..document import Section

MODES = ("none", "classes", "each")
OTHER = "other"  # the class of every position no named class holds


@dataclass(frozen=True, eq=False)
class Positions:
    """names   the C classes, in order (`each`: "0", "1", ...; IOI: S1, S2, IO, END, other)
    labels  [n_prompts, n_positions] long: each token's class, an index into `names`"""

    names: tuple[str, ...]
    labels: Tensor

    @property
    def n_classes(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"unknown position class {name!r}: this task's are {', '.join(self.names)}")
        return self.names.index(name)

    def contract(self, part: slice, diff: Tensor, grads: Tensor) -> Tensor:
        """diff [S, b, p, d] . grads [R, b, p, d], summed over d and the batch's tokens of each class: [S, R, C]."""
        labels = self.labels[part].to(diff.device)
        out = torch.zeros(diff.shape[0], grads.shape[0], self.n_classes, device=diff.device)
        for c in labels.unique().tolist():
            at = labels == c
            out[:, :, c] = diff[:, at].flatten(1).float() @ grads[:, at].flatten(1).float().T
        return out


# ---- building the classes -------------------------------------------------------------------------------
def each_position(task: Task) -> Positions:
    """A class per position of the padded prompts."""
    b, p = task.clean.shape
    return Positions(tuple(str(i) for i in range(p)), torch.arange(p).expand(b, p).clone())


def task_classes(task: Task, only: Sequence[str] | None = None) -> Positions:
    """The task's named classes (`Task.position_classes`: a dict class -> each prompt's position(s), or a
    label tensor [n_prompts, n_positions] of class ids), `only` some of them (the rest join `other`). Every
    named class must hold a position in every prompt, and no position two classes."""
    given = task.position_classes
    b, p = task.clean.shape
    if given is None:
        raise ValueError(f"the task {task.name!r} names no position classes (ioi does: S1, S2, IO, END): use "
                         "--positions each, or give Task.position_classes")
    if isinstance(given, Tensor):
        return _from_labels(given, (b, p), only)
    for name in only or ():
        if name not in given:
            raise ValueError(f"unknown position class {name!r}: this task's are {', '.join(given)}")
    names = [n for n in given if only is None or n in only]
    labels = torch.full((b, p), -1, dtype=torch.long)
    for c, name in enumerate(names):
        spots = given[name]
        if len(spots) != b:
            raise ValueError(f"position class {name!r} gives {len(spots)} prompts' positions, the task has {b}")
        missing = [i for i, at in enumerate(spots) if at is None or (not isinstance(at, int) and len(at) == 0)]
        if missing:
            raise ValueError(f"position class {name!r} is missing from prompt(s) {_few(missing)} of {b}: classes "
                             "must be shared by every prompt (leave it out, or use --positions each)")
        for i, at in enumerate(spots):
            for q in ([at] if isinstance(at, int) else list(at)):
                if not -p <= q < p:
                    raise ValueError(f"position class {name!r}: prompt {i}'s position {q} is outside its {p} tokens")
                if labels[i, q] >= 0:
                    raise ValueError(f"position {q} of prompt {i} is in two classes ({names[labels[i, q]]!r} and "
                                     f"{name!r})")
                labels[i, q] = c
    if bool((labels < 0).any()):
        labels[labels < 0] = len(names)
        names.append(OTHER)
    return Positions(tuple(names), labels)


def _from_labels(labels: Tensor, shape: tuple[int, int], only) -> Positions:
    if tuple(labels.shape) != shape or labels.dtype.is_floating_point or int(labels.min()) < 0:
        raise ValueError(f"position class labels must be class ids >= 0 of shape {list(shape)} (the prompts'), got "
                         f"{labels.dtype} {list(labels.shape)}")
    names = tuple(str(c) for c in range(int(labels.max()) + 1))
    for c in range(len(names)):
        lacking = (~(labels == c).any(1)).nonzero().flatten().tolist()
        if lacking:
            raise ValueError(f"position class {c} is missing from prompt(s) {_few(lacking)} of {shape[0]}: classes "
                             "must be shared by every prompt")
    if only:
        raise ValueError("classes given as a label tensor are numbered: take them all (--positions classes)")
    return Positions(names, labels.long())


def _few(items: list[int], n: int = 5) -> str:
    return ", ".join(map(str, items[:n])) + (f" ... ({len(items)})" if len(items) > n else "")


def parse_mode(mode: str) -> tuple[str, list[str] | None]:
    """"none", "each", "classes", or class names "S2,END" (classes, only those): (mode, names or None)."""
    if mode in MODES:
        return mode, None
    names = [n.strip() for n in mode.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--positions must be one of {', '.join(MODES)} or class names (S2,END), got {mode!r}")
    return "classes", names


def positions_for(task: Task, mode: str) -> Positions | None:
    """The task's `Positions` for a `--positions` value (None for "none"), checked before any run."""
    kind, only = parse_mode(mode)
    if kind == "none":
        return None
    return each_position(task) if kind == "each" else task_classes(task, only)


# ---- patching ---------------------------------------------------------------------------------------------
class _PositionPatching(_Patching):
    """receive(): input_r[b, p] - sum_s mask[s, r, class of (b, p)] (value_s - value_s corrupted)[b, p]. The
    differences are kept in a buffer, written as each sender computes them, with their running sum; a receiver
    that reads every earlier sender takes whichever of the two forms (the patched senders, or the sum less the
    kept ones) has fewer senders, as `runner._Patching` does."""

    def __init__(self, g: Graph, mask: Tensor, labels: Tensor, source) -> None:
        super().__init__(g, mask, source)  # the differences' buffer and running sum (`_Patching._fill`)
        self.labels = labels

    def __call__(self, group, x, values):
        rs = self.g.groups[group]
        n = len(values)
        sub = self.mask[:n, rs]  # [n, k, C]
        senders = sub.flatten(1).any(1).nonzero().flatten()
        if senders.numel() == 0:
            return x
        self._fill(values, x)
        allowed = self.g.allowed[:n, rs]
        return self._applied(x, self._buffered(sub, allowed[..., None] * (1 - sub), bool(allowed.all()), senders, x))

    def _product(self, w: Tensor, diff: Tensor, x: Tensor) -> Tensor:
        """sum_m w[m, r, class(b, p)] diff[m, b, p] for each receiver r: [n_receivers, b, p, d]."""
        if w.shape[0] == 0:
            return torch.zeros((w.shape[1],) + diff.shape[1:], dtype=x.dtype, device=x.device)
        weights = w.to(device=x.device, dtype=x.dtype)[:, :, self.labels.to(x.device)]  # [m, k, b, p]
        return torch.einsum("mkbp,mbpd->kbpd", weights, diff)


def patched(runner, positions: Positions, mask: Tensor, *, show_progress: bool | None = False) -> float:
    """The metric with every position edge where `mask` [S, R, C] is 1 patched from the corrupted run (a
    float mask mixes), resumed from the clean stream below the first receiver it changes."""
    g = runner.graph
    if tuple(mask.shape) != (len(g.senders), len(g.receivers), positions.n_classes):
        raise ValueError(f"a position mask is [senders, receivers, classes] = "
                         f"{[len(g.senders), len(g.receivers), positions.n_classes]}, got {list(mask.shape)}")
    mask = mask.to(torch.float32) * g.allowed[..., None]
    touched = mask.flatten(2).any(2).any(0).nonzero().flatten()
    if touched.numel() == 0:
        return runner.clean_metric
    start = min(g.receiver_layer[r] for r in touched.tolist())
    labels = positions.labels
    return runner._patched_run(lambda i, part, source: _PositionPatching(g, mask, labels[part], source),
                               start, show_progress)


def patch_edges(runner, positions: Positions, edges: Sequence[tuple[int, int, int]] | None = None) -> Tensor:
    """Exact position-edge patching: [S, R, C] with metric(edge s -> r patched at class c only) - metric(clean)
    for each (s, r, c) in `edges` (default all: one run each)."""
    g, C = runner.graph, positions.n_classes
    if edges is None:
        s, r = g.edges()
        edges = [(a, b, c) for a, b in zip(s.tolist(), r.tolist()) for c in range(C)]
    out = torch.zeros(len(g.senders), len(g.receivers), C)
    for s, r, c in progress(edges, desc="patching position edges", enabled=runner.show_progress):
        mask = torch.zeros(len(g.senders), len(g.receivers), C)
        mask[s, r, c] = 1
        out[s, r, c] = patched(runner, positions, mask) - runner.clean_metric
    return out


# ---- circuits ---------------------------------------------------------------------------------------------
def n_position_edges(graph: Graph, positions: Positions) -> int:
    return graph.n_edges * positions.n_classes


def select_positions(graph: Graph, scores: Tensor, n: int) -> Tensor:
    """bool [S, R, C]: the `n` position edges of largest |score|, less those whose edge dangles once the
    positions are merged (no path from the embeddings, or none on to the logits, at any position)."""
    allowed = graph.allowed[..., None].expand_as(scores)
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    if n > 0:
        flat = scores.abs().masked_fill(~allowed, -1.0).flatten()
        keep.view(-1)[flat.argsort(descending=True, stable=True)[:n]] = True
        keep &= allowed
    return keep & prune_dangling(graph, keep.any(2))[..., None]


def faithfulness(runner, positions: Positions, circuit: Tensor) -> float:
    """`Runner.faithfulness` of a bool [S, R, C] circuit: every position edge outside it patched."""
    value = patched(runner, positions, (~circuit) & runner.graph.allowed[..., None])
    return (value - runner.corrupted_metric) / (runner.clean_metric - runner.corrupted_metric)


def faithfulness_curve(runner, positions: Positions, scores: Tensor, fractions: Sequence[float] = FRACTIONS,
                       show_progress: bool | None = None) -> pd.DataFrame:
    """Faithfulness of the top-n position circuits at each `fraction` of the position edges (n_edges x C):
    fraction, edges (kept after pruning), faithfulness."""
    total, rows = n_position_edges(runner.graph, positions), []
    for f in progress(list(fractions), desc="faithfulness (positions)", enabled=show_progress):
        n = int(round(f * total)) if f < 1 else total
        circuit = select_positions(runner.graph, scores, max(n, 1) if f > 0 else 0)
        rows.append({"fraction": float(f), "edges": int(circuit.sum()),
                     "faithfulness": faithfulness(runner, positions, circuit)})
    return pd.DataFrame(rows)


def edge_frame(graph: Graph, positions: Positions, scores: Tensor) -> pd.DataFrame:
    """scores [S, R, C] -> one row per position edge with a score other than 0: sender, receiver, input,
    position (the class), score."""
    s, r = graph.edges()
    block = scores[s, r]  # [E, C]
    e, c = block.nonzero(as_tuple=True)
    return pd.DataFrame({"sender": np.asarray(graph.senders, dtype=object)[to_numpy(s[e])],
                         "receiver": np.asarray(graph.receivers, dtype=object)[to_numpy(r[e])],
                         "input": np.asarray(graph.inputs, dtype=object)[to_numpy(r[e])],
                         "position": np.asarray(positions.names, dtype=object)[to_numpy(c)],
                         "score": to_numpy(block[e, c], np.float64)})


def measure(runner, positions: Positions, method: str, steps: int = 5, ig: str = "inputs",
            fractions: Sequence[float] = FRACTIONS, show_progress: bool | None = None, points: str = "midpoint") -> dict:
    """Position-resolved scores by `method` ("eap", "eap-ig", "patching"; EAP-IG at `points`, as
    `Runner.eap_ig`), their edge frame, the faithfulness curve and the seconds each took: what `interp
    circuit --positions` adds."""
    t0 = time.perf_counter()
    if method == "patching":
        scores = patch_edges(runner, positions)
    elif method == "eap":
        scores = runner.eap(positions=positions)
    else:
        scores = runner.eap_ig(steps, ig, positions=positions, points=points)
    t1 = time.perf_counter()
    curve = faithfulness_curve(runner, positions, scores, fractions, show_progress)
    t2 = time.perf_counter()
    return {"scores": scores, "edges": edge_frame(runner.graph, positions, scores), "curve": curve,
            "n_edges": n_position_edges(runner.graph, positions),
            "score_seconds": t1 - t0, "curve_seconds": t2 - t1}


# ---- the study's checks and report ------------------------------------------------------------------------
def check_mode(task: str, mode: str) -> None:
    """`--positions` against the task's name, before the model loads: classes need a task that names them
    (ioi), and class names must be the task's."""

    kind, only = parse_mode(mode)
    if kind != "classes":
        return
    if task != "ioi":
        raise ValueError(f"the task {task!r} names no position classes (ioi does: {', '.join(IOI_CLASSES)}): use "
                         "--positions each")
    for name in only or ():
        if name not in IOI_CLASSES:
            raise ValueError(f"unknown position class {name!r}: this task's are {', '.join(IOI_CLASSES)}")


def record(positions: Positions, mode: str, measured: dict) -> dict:

    curve = measured["curve"]
    return {"mode": parse_mode(mode)[0], "classes": positions.n_classes,
            "names": list(positions.names) if len(positions.names) <= 16 else None,
            "n_edges": measured["n_edges"],
            "score_seconds": round(measured["score_seconds"], 2), "curve_seconds": round(measured["curve_seconds"], 2),
            **areas(curve)}


def section(plain: pd.DataFrame, measured: dict, rec: dict):
    """The report's comparison: both curves side by side, and the strongest position edges."""

    curve = measured["curve"]
    both = pd.DataFrame({"fraction": curve.fraction, "edges (positions)": curve.edges,
                         "faithfulness (positions)": curve.faithfulness,
                         "edges (plain)": plain.edges.to_numpy(),
                         "faithfulness (plain)": plain.faithfulness.to_numpy()})
    at = lambda c, f: float(c.loc[(c.fraction - f).abs().idxmin()].faithfulness)  # noqa: E731
    kinds = "each position its own class" if rec["mode"] == "each" else "classes " + ", ".join(rec["names"] or [])
    edges = measured["edges"]
    top = edges.reindex(edges.score.abs().sort_values(ascending=False).index).head(25)
    return Section("positions", "Position-resolved edges").add(
        f"Each edge split by where it acts ({kinds}: {rec['classes']} classes, {rec['n_edges']:,} position edges); "
        f"scored in {rec['score_seconds']:.1f} s, the curve in {rec['curve_seconds']:.1f} s. Faithfulness at 1% of "
        f"the position edges {at(curve, 0.01):.3f} and at 5% {at(curve, 0.05):.3f}, against {at(plain, 0.01):.3f} "
        f"and {at(plain, 0.05):.3f} for the same fractions of the plain edges; CPR {rec['cpr']:.3f}, CMD "
        f"{rec['cmd']:.3f}.", both, top)
