"""The computation graph at head granularity (senders, receivers, edges; the conventions are the
package's docstring), the task it is read on, and circuits chosen from edge scores (top-n, greedy from
the logits, dangling edges pruned) with the area under their faithfulness curve."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .choices import IG_ON, METHODS, SELECTIONS
from .features import check_saes, feature_nodes

# MIB's circuit sizes: fractions of the graph's edges
FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# the sizes of a curve over long prompts (a runner that goes block by block, `Runner.layered`): each size between 0
# and 1 is a patched run of every block for every prompt (about a minute a prompt at 4,096 tokens on SmolLM2 on a
# 2-core CPU), and 0 edges is the corrupted run by definition (`Runner.faithfulness_many`)
LONG_FRACTIONS = (0.0, 0.01, 0.05, 0.2, 1.0)


def curve_fractions(layered: bool) -> tuple[float, ...]:
    """The sizes `interp circuit` measures faithfulness at: MIB's, or `LONG_FRACTIONS` block by block."""
    return LONG_FRACTIONS if layered else FRACTIONS


# ---- the graph ---------------------------------------------------------------------------------
class Graph:
    """Senders, receivers and which edges exist, for a model config.

    Order of computation: `embed` is stage 0; layer l's attention reads at stage 2l + 1 and its heads
    write there; its MLP reads and writes at stage 2l + 2 (a parallel block's MLP reads at 2l + 1, beside
    attention); `logits` read at 2 n_layers + 1. An edge s -> r exists when s writes before r reads.

    `saes`: SAEs on components' outputs whose features and error replace those components' senders
    (`features.FeatureNodes`, or SAEs: every feature a node; `features` has the conventions). Per sender:
    `sender_kind` ("embed", "head", "mlp", "feature", "error"), `sender_feature` (the feature's index in its
    SAE, else -1), `sender_sae` (its SAE's index in `saes`, else -1), `writes_at` (the hook point where its
    value joins the stream).

    A residual-stream SAE cuts the stream (`cut`): its kept features and its error are receivers of every sender
    before the cut (group (layer, "cut")) and senders to every receiver after it, which reads no earlier sender.
    `cut`: its `features.FeatureNodes`, or None."""

    def __init__(self, cfg, saes: Sequence = ()) -> None:
        L, H, KV = cfg.n_layers, cfg.n_heads, cfg.kv_heads
        self.n_layers, self.n_heads, self.n_kv = L, H, KV
        self.has_mlp = cfg.d_mlp is not None
        self.saes = tuple(feature_nodes(cfg, s) for s in saes)
        check_saes(cfg, [n.sae.cfg for n in self.saes])
        self.sae_at = {(n.layer, n.component): n for n in self.saes if n.component != "resid"}
        self.cut = next((n for n in self.saes if n.component == "resid"), None)
        parallel = bool(cfg.parallel_attn_mlp) and self.has_mlp
        s_stage = self._senders()
        cut = self.cut.names() if self.cut is not None else []
        kv_name = (lambda l, g: f"L{l}H{g}") if KV == H else (lambda l, g: f"L{l}KV{g}")
        receivers, r_input, r_reads, r_layer = [], [], [], []

        def place_cut(names: list[str]) -> None:
            """The cut's receivers (`names`) join here."""
            receivers.extend(names)
            r_input.extend(["-"] * len(names))
            r_reads.extend([self.cut.stage] * len(names))
            r_layer.extend([self.cut.layer] * len(names))

        for l in range(L):
            if cut and self.cut.stage < 2 * l + 1:  # the cut's receivers, where they read
                place_cut(cut)
                cut = []
            for kind, n, name in (("q", H, lambda l, h: f"L{l}H{h}"), ("k", KV, kv_name), ("v", KV, kv_name)):
                receivers += [name(l, i) for i in range(n)]
                r_input += [kind] * n
                r_reads += [2 * l + 1] * n
                r_layer += [l] * n
            if cut and self.cut.stage < 2 * l + 2 and not parallel:  # hook_resid_mid
                place_cut(cut)
                cut = []
            if self.has_mlp:
                receivers.append(f"MLP{l}")
                r_input.append("-")
                r_reads.append(2 * l + 1 if parallel else 2 * l + 2)
                r_layer.append(l)
        if cut:  # the last block's hook_resid_post
            place_cut(cut)
        receivers.append("logits")
        r_input.append("-")
        r_reads.append(2 * L + 1)
        r_layer.append(L)
        self.receivers, self.inputs, self.receiver_layer = receivers, r_input, r_layer
        sent, read = torch.tensor(s_stage, dtype=torch.float64), torch.tensor(r_reads, dtype=torch.float64)
        self.allowed = sent[:, None] < read[None, :]  # [S, R]
        at_cut = read == (self.cut.stage if self.cut is not None else -1.0)
        if self.cut is not None:  # no edge across the cut: what comes after reads its senders, not the earlier ones
            self.allowed &= ~((sent < self.cut.stage)[:, None] & (read > self.cut.stage)[None, :])
        # receivers of one hook point: (layer, kind) -> receiver indices
        self.groups: dict[tuple[int, str], list[int]] = {}
        for r, (l, kind) in enumerate(zip(r_layer, r_input)):
            key = (l, "cut" if at_cut[r] else "mlp" if receivers[r].startswith("MLP") else "logits" if l == L else kind)
            self.groups.setdefault(key, []).append(r)
        self.receiver_senders = self._owners()
        # the other way round: a sender node -> the receivers that are its inputs (its q, its group's k and v, ...)
        self.inputs_of: list[list[int]] = [[] for _ in self.senders]
        for r, owners in enumerate(self.receiver_senders):
            for s in owners:
                self.inputs_of[s].append(r)

    def _senders(self) -> list[int]:
        """The senders in the order of computation, each's layer, kind, feature, SAE and where it writes; their
        stages (returned)."""
        self.senders, self.sender_layer, self.sender_kind = ["embed"], [-1], ["embed"]
        self.sender_feature, self.sender_sae = [-1], [-1]
        self.writes_at, stages = ["blocks.0.hook_resid_pre"], [0]

        def add(names, layer, kind, stage, writes, sae=-1, features=()):
            self.senders += names
            self.sender_layer += [layer] * len(names)
            self.sender_kind += kind if isinstance(kind, list) else [kind] * len(names)
            self.sender_feature += list(features) + [-1] * (len(names) - len(features))
            self.sender_sae += [sae] * len(names)
            self.writes_at += [writes] * len(names)
            stages.extend([stage] * len(names))

        cut = self.cut

        def add_cut() -> None:
            add(cut.names(), cut.layer, ["feature"] * len(cut.features) + ["error"], cut.stage, cut.writes_at,
                self.saes.index(cut), cut.features)

        for l in range(self.n_layers):
            for component, stage in (("attn", 2 * l + 1), ("mlp", 2 * l + 2)):
                if cut is not None and cut.stage < stage:  # the cut's senders, where they write
                    add_cut()
                    cut = None
                if component == "mlp" and not self.has_mlp:
                    continue
                nodes = self.sae_at.get((l, component))
                if nodes is not None:
                    kinds = ["feature"] * len(nodes.features) + ["error"]
                    add(nodes.names(), l, kinds, stage, nodes.writes_at, self.saes.index(nodes), nodes.features)
                elif component == "attn":
                    add([f"L{l}H{h}" for h in range(self.n_heads)], l, "head", stage, f"blocks.{l}.hook_attn_out")
                else:
                    add([f"MLP{l}"], l, "mlp", stage, f"blocks.{l}.hook_mlp_out")
        if cut is not None:  # the last block's hook_resid_post
            add_cut()
        return stages

    def _owners(self) -> list[list[int]]:
        """Each receiver's node: the sender(s) whose input it is (the query heads a KV receiver feeds, for GQA;
        every sender of an SAE that replaces the component: each of its features reads every head's output)."""
        index = {s: i for i, s in enumerate(self.senders)}
        H, KV = self.n_heads, self.n_kv
        group = H // KV
        out: list[list[int]] = []
        cut = set(self.cut.names()) if self.cut is not None else set()
        for r, name in enumerate(self.receivers):
            l, kind = self.receiver_layer[r], self.inputs[r]
            nodes = self.sae_at.get((l, "mlp" if name.startswith("MLP") else "attn"))
            if name in cut:  # a cut's feature or error: the sender of the same name
                out.append([index[name]])
            elif name == "logits":
                out.append([])
            elif nodes is not None:
                mine = self.saes.index(nodes)
                out.append([i for i, sae in enumerate(self.sender_sae) if sae == mine])
            elif kind in ("k", "v"):
                g = int(name.rsplit("KV" if KV != H else "H", 1)[1])
                out.append([index[f"L{l}H{h}"] for h in range(g * group, (g + 1) * group)])
            else:
                out.append([index[name]])
        return out

    @property
    def n_edges(self) -> int:
        return int(self.allowed.sum())

    def edges(self) -> tuple[Tensor, Tensor]:
        """(sender index, receiver index) of every edge, in a fixed order (receivers' order, then senders')."""
        r, s = self.allowed.T.nonzero(as_tuple=True)
        return s, r

    def edge_frame(self, scores: Tensor) -> pd.DataFrame:
        """scores [S, R] -> one row per edge: sender, receiver, input, score."""
        s, r = self.edges()
        return pd.DataFrame({"sender": [self.senders[i] for i in s.tolist()],
                             "receiver": [self.receivers[i] for i in r.tolist()],
                             "input": [self.inputs[i] for i in r.tolist()],
                             "score": to_numpy(scores[s, r], np.float64)})


# ---- tasks -------------------------------------------------------------------------------------
@dataclass
class Task:
    """Clean and corrupted prompts of equal token length, and where the metric reads the answers.

    clean, corrupted  [batch, pos] token ids (right padding is harmless under causal attention: the
                      answers never read it)
    rows, positions   [n] the prompt and position of each answer (the logits there are read); a prompt may
                      appear in several rows (answers at several positions: induction, a file's "answers");
                      positions count from 0 in the padded prompt (`tasks.tensor_task` resolves negative ones
                      against each prompt's own length)
    metric            (logits [n, vocab], index [n] into the answers) -> [n] per-answer values; the
                      task's metric is their mean over all answers of all prompts. `name`: what it is
                      ("logit-diff", "logit", "prob", "loss", "prob-diff", "kl"; `tasks` says which way each goes)"""

    name: str
    clean: Tensor
    corrupted: Tensor
    rows: Tensor
    positions: Tensor
    metric: Callable[[Tensor, Tensor], Tensor]
    metric_name: str
    description: str = ""
    prompts: list[str] = field(default_factory=list)
    answer_tokens: Tensor | None = None  # [n] each answer's (first) token, to see which heads attend to it
    wrong_tokens: Tensor | None = None
    # named token positions for position-resolved edges (`positions.task_classes`): a dict class -> each
    # prompt's position (or positions), or a label tensor [batch, pos] of class ids; IOI names S1, S2, IO, END
    position_classes: dict[str, list] | Tensor | None = None

    def __post_init__(self) -> None:
        if self.clean.shape != self.corrupted.shape:
            raise ValueError(f"clean {tuple(self.clean.shape)} and corrupted {tuple(self.corrupted.shape)} tokens "
                             "differ in shape")
        if self.rows.shape != self.positions.shape or self.rows.dim() != 1:
            raise ValueError(f"rows {tuple(self.rows.shape)} and positions {tuple(self.positions.shape)} must both be "
                             "[n], one per answer")
        b, p = self.clean.shape
        if self.rows.numel() and not (0 <= int(self.rows.min()) and int(self.rows.max()) < b
                                      and 0 <= int(self.positions.min()) and int(self.positions.max()) < p):
            raise ValueError(f"answer rows must lie in 0 .. {b - 1} and positions in 0 .. {p - 1} (the prompts are "
                             f"[{b}, {p}]; tasks.tensor_task takes negative positions)")

    @property
    def n_answers(self) -> int:
        return int(self.rows.numel())

    def chunks(self, batch_size: int) -> Iterator[tuple[slice, Tensor]]:
        """(prompt slice, answer indices in it) per chunk of `batch_size` prompts."""
        for start in range(0, self.clean.shape[0], batch_size):
            part = slice(start, start + batch_size)
            yield part, ((self.rows >= start) & (self.rows < start + batch_size)).nonzero().flatten()



# ---- circuits ----------------------------------------------------------------------------------------


def top_edges(graph: Graph, scores: Tensor, n: int) -> Tensor:
    """bool [S, R]: the `n` edges of largest |score|."""
    s, r = graph.edges()
    keep = torch.zeros_like(graph.allowed)
    if n > 0:
        order = scores[s, r].abs().argsort(descending=True, stable=True)[:n]
        keep[s[order], r[order]] = True
    return keep


def greedy_edges(graph: Graph, scores: Tensor, n: int) -> Tensor:
    """bool [S, R]: grown from the logits (Hanna et al. 2024): at each step the edge of largest |score|
    among those into a node already in the circuit joins it, with its sender."""

    edges_of = {r: graph.allowed[:, r].nonzero().flatten().tolist() for r in range(len(graph.receivers))}
    keep = torch.zeros_like(graph.allowed)
    heap: list = []
    opened: set[int] = set()

    def open_receiver(r: int) -> None:
        if r not in opened:
            opened.add(r)
            for s in edges_of[r]:
                heapq.heappush(heap, (-abs(float(scores[s, r])), s, r))

    open_receiver(len(graph.receivers) - 1)  # the logits
    joined: set[int] = set()
    count = 0
    while heap and count < n:
        _, s, r = heapq.heappop(heap)
        keep[s, r] = True
        count += 1
        if s not in joined:
            joined.add(s)
            for r2 in graph.inputs_of[s]:
                open_receiver(r2)
    return keep


def prune_dangling(graph: Graph, circuit: Tensor) -> Tensor:
    """`circuit` less the edges that cannot matter: from a sender no path from the embeddings reaches, or
    into a node with no path on to the logits (repeated until nothing changes, in one pass each way, since
    the graph is ordered)."""
    S, R = circuit.shape
    edges = circuit & graph.allowed
    reached = torch.zeros(S, dtype=torch.bool)
    reached[0] = True  # embed
    runs = _runs(graph)  # consecutive senders with the same inputs (an SAE's nodes), which feed none of each other
    for s, e in runs[1:]:  # senders in the order of computation
        rs = graph.inputs_of[s]
        reached[s:e] = bool(rs) and bool((edges[:, rs] & reached[:, None]).any())
    edges = edges & reached[:, None]
    useful = torch.zeros(R, dtype=torch.bool)  # receivers with a path on to the logits
    useful[R - 1] = True
    for s, e in reversed(runs):  # a node's receivers are decided before the senders that feed them
        if bool((edges[s:e] & useful).any()):
            useful[graph.inputs_of[s]] = True
    return edges & useful[None, :]


def _runs(graph: Graph) -> list[tuple[int, int]]:
    """(first, end) of each run of consecutive senders whose inputs are the same receivers; embed alone first."""
    out = [(0, 1)]
    for s in range(1, len(graph.senders)):
        if len(out) > 1 and graph.inputs_of[s] and graph.inputs_of[s] == graph.inputs_of[out[-1][0]]:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


def select(graph: Graph, scores: Tensor, n: int, how: str = "top") -> Tensor:
    """`n` edges by `how` ("top" or "greedy"), dangling ones pruned."""
    if how not in SELECTIONS:
        raise ValueError(f"unknown selection {how!r}: choose one of {', '.join(SELECTIONS)}")
    pick = top_edges if how == "top" else greedy_edges
    return prune_dangling(graph, pick(graph, scores, n))


def areas(curve: pd.DataFrame) -> dict:
    """MIB's summaries of a faithfulness curve over edge fractions in [0, 1]: CPR, the area under it
    (higher is better), and CMD, the area under |1 - faithfulness| (lower is better)."""
    x, y = curve["fraction"].to_numpy(float), curve["faithfulness"].to_numpy(float)
    trapz = getattr(np, "trapezoid", None) or np.trapz
    return {"cpr": float(trapz(y, x)), "cmd": float(trapz(np.abs(1 - y), x))}
