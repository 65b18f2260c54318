"""Which heads and edges carry a behaviour: the computation graph at head granularity, exact activation
patching (the oracle), edge attribution patching (EAP, Syed et al. 2023) and its integrated-gradients
form (EAP-IG, Hanna et al. 2024), circuits chosen by score and judged by faithfulness over their sizes
(MIB, Mueller et al. 2025).

The graph, with the conventions of the EAP literature (ACDC's, Hanna et al.'s):

- senders: the embeddings as one node `embed` (the residual stream entering block 0: token plus
  position), each head's output without the output bias `L{l}H{h}`, each MLP's output `MLP{l}`;
- receivers: each head's q, k and v inputs (the residual stream before that layer's norm, one copy
  per input: `set_use_split_qkv_input`), each MLP's input, and `logits` (the stream before the final
  norm);
- an edge: a sender that writes before a receiver reads. The receiver's input is the sum of its
  senders' values plus the biases, so patching edge s -> r gives r the input
  `input_r - value_s + value_s(corrupted)` and leaves every other reader of s alone.

Grouped-query attention: a key/value head's k and v inputs are one input read by all the query heads
of its group, so they are one receiver, named `L{l}KV{g}` (`L{l}H{g}` under multi-head attention,
where the two coincide); its edges are scored once, for the group.

Sandwich norms (Gemma 2 / 3, OLMo 2): a head's value is its share of the normalised attention output,
`w * result_h / rms(attention output)` with the norm's scale of the same run, so the layer's output is
still the sum of its heads' values (plus the bias's share). Patching a head changes only its own
share: the scale each receiver sees is the scale of the run it reads.

Scores are `metric(run with the edge corrupted) - metric(clean run)` (patching), or its first-order
estimate `(value_s(corrupted) - value_s(clean)) . d metric / d input_r` (EAP); EAP-IG averages the
gradient over m points between the corrupted and the clean run (midpoints: alpha = (k - 1/2) / m),
interpolating the embeddings ("inputs") or every receiver's input at once ("activations"). The metric
is a mean over prompts and answer positions (`Task`). A node's score is its sender's: every edge out of
it patched at once (exact), or the sum of its edges' scores (EAP, EAP-IG: the same first-order
estimate).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.device import to_host, to_numpy

from ._common import frozen_params, progress

METHODS = ("patching", "eap", "eap-ig")
IG_ON = ("inputs", "activations")
# MIB's circuit sizes: fractions of the graph's edges
FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ---- the graph ---------------------------------------------------------------------------------
class Graph:
    """Senders, receivers and which edges exist, for a model config.

    Order of computation: `embed` is stage 0; layer l's attention reads at stage 2l + 1 and its heads
    write there; its MLP reads and writes at stage 2l + 2 (a parallel block's MLP reads at 2l + 1, beside
    attention); `logits` read at 2 n_layers + 1. An edge s -> r exists when s writes before r reads."""

    def __init__(self, cfg) -> None:
        L, H, KV = cfg.n_layers, cfg.n_heads, cfg.kv_heads
        self.n_layers, self.n_heads, self.n_kv = L, H, KV
        self.has_mlp = cfg.d_mlp is not None
        parallel = bool(cfg.parallel_attn_mlp) and self.has_mlp
        senders, s_stage, s_layer = ["embed"], [0], [-1]
        for l in range(L):
            senders += [f"L{l}H{h}" for h in range(H)]
            s_stage += [2 * l + 1] * H
            s_layer += [l] * H
            if self.has_mlp:
                senders.append(f"MLP{l}")
                s_stage.append(2 * l + 2)
                s_layer.append(l)
        kv_name = (lambda l, g: f"L{l}H{g}") if KV == H else (lambda l, g: f"L{l}KV{g}")
        receivers, r_input, r_reads, r_layer = [], [], [], []
        for l in range(L):
            for kind, n, name in (("q", H, lambda l, h: f"L{l}H{h}"), ("k", KV, kv_name), ("v", KV, kv_name)):
                receivers += [name(l, i) for i in range(n)]
                r_input += [kind] * n
                r_reads += [2 * l + 1] * n
                r_layer += [l] * n
            if self.has_mlp:
                receivers.append(f"MLP{l}")
                r_input.append("-")
                r_reads.append(2 * l + 1 if parallel else 2 * l + 2)
                r_layer.append(l)
        receivers.append("logits")
        r_input.append("-")
        r_reads.append(2 * L + 1)
        r_layer.append(L)
        self.senders, self.receivers, self.inputs = senders, receivers, r_input
        self.sender_layer, self.receiver_layer = s_layer, r_layer
        self.allowed = torch.tensor(s_stage)[:, None] < torch.tensor(r_reads)[None, :]  # [S, R]
        # receivers of one hook point: (layer, kind) -> receiver indices
        self.groups: dict[tuple[int, str], list[int]] = {}
        for r, (l, kind) in enumerate(zip(r_layer, r_input)):
            key = (l, "mlp" if receivers[r].startswith("MLP") else "logits" if l == L else kind)
            self.groups.setdefault(key, []).append(r)
        # a receiving node: which sender it is (the query heads a KV receiver feeds, for GQA)
        index = {s: i for i, s in enumerate(senders)}
        group = H // KV
        self.receiver_senders: list[list[int]] = []
        for r, name in enumerate(receivers):
            l, kind = r_layer[r], r_input[r]
            if name == "logits":
                self.receiver_senders.append([])
            elif kind in ("k", "v"):
                g = int(name.rsplit("KV" if KV != H else "H", 1)[1])
                self.receiver_senders.append([index[f"L{l}H{h}"] for h in range(g * group, (g + 1) * group)])
            else:
                self.receiver_senders.append([index[name]])
        # the other way round: a sender node -> the receivers that are its inputs (its q, its group's k and v, ...)
        self.inputs_of: list[list[int]] = [[] for _ in senders]
        for r, owners in enumerate(self.receiver_senders):
            for s in owners:
                self.inputs_of[s].append(r)

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
    rows, positions   [n] the prompt and position of each answer (the logits there are read)
    metric            (logits [n, vocab], index [n] into the answers) -> [n] per-answer values; the
                      task's metric is their mean. `name`: what it is ("logit-diff", "prob", "loss", ...)"""

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

    def __post_init__(self) -> None:
        if self.clean.shape != self.corrupted.shape:
            raise ValueError(f"clean {tuple(self.clean.shape)} and corrupted {tuple(self.corrupted.shape)} tokens "
                             "differ in shape")

    @property
    def n_answers(self) -> int:
        return int(self.rows.numel())

    def chunks(self, batch_size: int) -> Iterator[tuple[slice, Tensor]]:
        """(prompt slice, answer indices in it) per chunk of `batch_size` prompts."""
        for start in range(0, self.clean.shape[0], batch_size):
            part = slice(start, start + batch_size)
            yield part, ((self.rows >= start) & (self.rows < start + batch_size)).nonzero().flatten()


# ---- runs through the graph ----------------------------------------------------------------------
@contextlib.contextmanager
def graph_mode(model) -> Iterator[None]:
    """Each receiver reads its own copy of the stream (`hook_q_input` / k / v, `hook_mlp_in`) inside the
    block; the model's switches as they were afterwards."""
    flags = dict(model.runtime.hook_flags)
    try:
        if flags.get("use_attn_in"):
            model.set_use_attn_in(False)
        model.set_use_split_qkv_input(True)
        if model.cfg.d_mlp is not None:
            model.set_use_hook_mlp_in(True)
        yield
    finally:
        model.set_use_split_qkv_input(flags.get("use_split_qkv_input", False))
        if model.cfg.d_mlp is not None:
            model.set_use_hook_mlp_in(flags.get("use_hook_mlp_in", False))
        if flags.get("use_attn_in"):
            model.set_use_attn_in(True)


class _Pass:
    """One forward through the graph's hook points: collects every sender's value (in order) and lets
    `receive(group, x)` change each receiver's input. Senders of layers below `start` (a run resumed
    from a cached stream) are given."""

    def __init__(self, model, graph: Graph, receive=None, given: list[Tensor] | None = None, start: int = 0,
                 embed=None) -> None:
        self.model, self.graph, self.receive, self.embed = model, graph, receive, embed
        below = 0 if start == 0 else sum(1 for l in graph.sender_layer if l < start)  # embed's is -1
        self.values: list[Tensor] = list(given[:below]) if given is not None else []
        self.start = start
        self._results: dict[int, Tensor] = {}
        self._scale: dict[int, Tensor] = {}

    def hooks(self) -> list:
        model, g = self.model, self.graph
        sandwich = model.cfg.sandwich_norms
        out = []
        if self.start == 0:
            out.append(("blocks.0.hook_resid_pre", self._embed))
        for l in range(self.start, g.n_layers):
            for kind in ("q", "k", "v"):
                out.append((f"blocks.{l}.hook_{kind}_input", self._receiver(l, kind)))
            out.append((f"blocks.{l}.attn.hook_result", self._heads(l, sandwich)))
            if sandwich:
                out.append((f"blocks.{l}.ln1_post.hook_scale", self._keep_scale(l)))
                out.append((f"blocks.{l}.hook_attn_out", self._shares(l)))
            if g.has_mlp:
                out.append((f"blocks.{l}.hook_mlp_in", self._receiver(l, "mlp")))
                out.append((f"blocks.{l}.hook_mlp_out", self._mlp))
        out.append((f"blocks.{g.n_layers - 1}.hook_resid_post", self._receiver(g.n_layers, "logits")))
        return out

    def _embed(self, x, hook):
        if self.embed is not None:
            x = self.embed(x)
        self.values.append(x)
        return x

    def _mlp(self, x, hook):
        self.values.append(x)
        return x

    def _heads(self, l: int, sandwich: bool):
        def hook(x, hook):
            if sandwich:
                self._results[l] = x
            else:
                self.values.extend(x.unbind(2))
            return x
        return hook

    def _keep_scale(self, l: int):
        def hook(x, hook):
            self._scale[l] = x
            return x
        return hook

    def _shares(self, l: int):
        norm = self.model.blocks[l].ln1_post

        def hook(x, hook):
            # RMSNorm: out = w * (attn_out / scale), attn_out = sum_h result_h + b_O: head h's share
            # is w * result_h / scale (computed as the norm does, in float32, then cast back)
            r, scale = self._results.pop(l), self._scale.pop(l)
            self.values.extend((norm.w * (r.float() / scale[:, :, None]).to(x.dtype)).unbind(2))
            return x
        return hook

    def _receiver(self, l: int, kind: str):
        def hook(x, hook):
            return x if self.receive is None else self.receive((l, kind), x, self.values)
        return hook


def _check_sandwich(model) -> None:
    if model.cfg.sandwich_norms and not all(type(b.ln1_post).__name__ == "RMSNorm" for b in model.blocks):
        raise NotImplementedError("circuits: sandwich norms other than RMSNorm are not split into head shares")


def _final(model, resid: Tensor, task: Task, answers: Tensor, start: int) -> Tensor:
    """Per-answer metric values from the final residual stream of prompts [start, ...]."""
    rows, pos = task.rows[answers] - start, task.positions[answers]
    x = resid[rows.to(resid.device), pos.to(resid.device)][:, None]
    logits = model(x, "logits", start_at_layer=model.cfg.n_layers)[:, 0]
    return task.metric(logits.float(), answers)


class Runner:
    """Clean and corrupted runs of a task on a model, cached per chunk of prompts, and the scores."""

    def __init__(self, model, task: Task, *, batch_size: int = 16, show_progress: bool | None = None) -> None:
        if not getattr(model, "native", True):
            raise NotImplementedError("circuits need interp's own transformer (per-head inputs and outputs); this "
                                      "model is wrapped (run by transformers): load a natively supported family")
        _check_sandwich(model)
        self.model, self.task, self.graph = model, task, Graph(model.cfg)
        self.batch_size, self.show_progress = batch_size, show_progress
        self.chunks = list(task.chunks(batch_size))
        self._cache: dict[int, dict] = {}
        with torch.no_grad():
            clean = self._values("clean")
            corrupted = self._values("corrupted")
        self.clean_metric, self.corrupted_metric = clean, corrupted
        if not (math.isfinite(clean) and math.isfinite(corrupted)):
            raise ValueError(f"the task's metric is not finite (clean {clean}, corrupted {corrupted}): check the "
                             "prompts and answers")
        if abs(clean - corrupted) <= 1e-6 * max(1.0, abs(clean)):
            raise ValueError(f"the task's metric does not differ between clean and corrupted prompts ({clean:.6g}): "
                             "nothing to attribute; the corrupted prompts must change the answer")

    # -- runs --
    def _values(self, which: str) -> float:
        """Run every chunk of the clean or corrupted prompts, keeping the senders' values and each block's
        input; the metric."""
        tokens = self.task.clean if which == "clean" else self.task.corrupted
        total = 0.0
        for i, (part, answers) in enumerate(self.chunks):
            p = _Pass(self.model, self.graph)
            resid: dict[int, Tensor] = {}
            hooks = p.hooks() + [(f"blocks.{l}.hook_resid_pre", _keeper(resid, l)) for l in range(self.graph.n_layers)]
            with graph_mode(self.model), self.model.hooks(hooks):
                final = self.model(tokens[part].to(self.model.device), stop_at_layer=self.model.cfg.n_layers)
            values = _final(self.model, final, self.task, answers, part.start)
            total += float(values.double().sum())
            self._cache.setdefault(i, {})[which] = (torch.stack(p.values), [resid[l] for l in range(self.graph.n_layers)],
                                                    final)
        return total / self.task.n_answers

    def patched(self, mask: Tensor, *, show_progress: bool | None = False) -> float:
        """The metric with every edge where `mask` [S, R] is 1 patched from the corrupted run (a float
        mask mixes: 0.5 is halfway). Resumes from the clean stream below the first receiver it changes."""
        g = self.graph
        mask = (mask.to(torch.float32) * g.allowed)
        touched = mask.any(0).nonzero().flatten()
        if touched.numel() == 0:
            return self.clean_metric
        start = min(g.receiver_layer[r] for r in touched.tolist())
        total = 0.0
        with torch.no_grad(), graph_mode(self.model):
            for i, (part, answers) in progress(list(enumerate(self.chunks)), desc="patched run", enabled=show_progress):
                clean, resid, final = self._cache[i]["clean"]
                corrupted = self._cache[i]["corrupted"][0]
                receive = _Patching(g, mask, corrupted)
                p = _Pass(self.model, g, receive, given=list(clean), start=min(start, g.n_layers))
                with self.model.hooks(p.hooks()):
                    if start >= g.n_layers:  # only the logits change
                        final = receive((g.n_layers, "logits"), final, list(clean))
                    else:
                        final = self.model(resid[start], start_at_layer=start, stop_at_layer=g.n_layers)
                total += float(_final(self.model, final, self.task, answers, part.start).double().sum())
        return total / self.task.n_answers

    # -- scores --
    def eap(self) -> Tensor:
        """EAP edge scores [S, R]: (corrupted - clean value of s) . d metric / d input_r at the clean run."""
        return self._attribution([None])

    def eap_ig(self, steps: int = 5, on: str = "inputs") -> Tensor:
        """EAP-IG edge scores [S, R] with `steps` midpoints between the corrupted and the clean run, on the
        embeddings (`on="inputs"`) or on every receiver's input at once (`"activations"`)."""
        if on not in IG_ON:
            raise ValueError(f"EAP-IG interpolates 'inputs' or 'activations', got {on!r}")
        if steps < 1:
            raise ValueError(f"EAP-IG needs at least one step, got {steps}")
        return self._attribution([((k + 0.5) / steps, on) for k in range(steps)])

    def _attribution(self, points: list) -> Tensor:
        g, model = self.graph, self.model
        scores = torch.zeros(len(g.senders), len(g.receivers), dtype=torch.float64)
        jobs = [(i, point) for i in range(len(self.chunks)) for point in points]
        with frozen_params(model), graph_mode(model):
            for i, point in progress(jobs, desc="attribution", enabled=self.show_progress):
                part, answers = self.chunks[i]
                grads = self._gradients(i, part, answers, point)
                clean = self._cache[i]["clean"][0]
                diff = (self._cache[i]["corrupted"][0] - clean).flatten(1).float()  # [S, b*p*d]
                scores += to_host(diff @ grads.flatten(1).float().T).double() / len(points)
        return (scores * g.allowed).float()

    def _gradients(self, i: int, part: slice, answers: Tensor, point) -> Tensor:
        """d (sum of this chunk's metric values / all answers) / d input_r, stacked [R, b, p, d]."""
        g, model = self.graph, self.model
        inputs: dict[tuple, Tensor] = {}
        embed = None
        receivers_at = None
        if point is not None:
            alpha, on = point
            clean0, corrupt0 = self._cache[i]["clean"][1][0], self._cache[i]["corrupted"][1][0]
            if on == "inputs":
                embed = lambda x: (corrupt0 + alpha * (clean0 - corrupt0)).requires_grad_(True)
            else:
                receivers_at = alpha
        if embed is None:
            embed = lambda x: x.detach().requires_grad_(True)
        clean_in = self._receiver_inputs(i, "clean") if receivers_at is not None else None
        corrupt_in = self._receiver_inputs(i, "corrupted") if receivers_at is not None else None

        def receive(group, x, values):
            if receivers_at is not None:  # the value at the interpolated point, the gradient through x
                target = corrupt_in[group] + receivers_at * (clean_in[group] - corrupt_in[group])
                x = x + (target - x).detach()
            inputs[group] = x
            return x

        p = _Pass(model, g, receive, embed=embed)
        with model.hooks(p.hooks()):
            final = model(self.task.clean[part].to(model.device), stop_at_layer=g.n_layers)
            metric = _final(model, final, self.task, answers, part.start).sum() / self.task.n_answers
        keys = list(inputs)
        grads = dict(zip(keys, torch.autograd.grad(metric, [inputs[k] for k in keys], allow_unused=True)))
        out = torch.zeros((len(g.receivers),) + final.shape, dtype=final.dtype, device=final.device)
        for group, rs in g.groups.items():
            grad = grads.get(group)
            if grad is None:
                continue
            if grad.dim() == 4:  # [b, p, n, d]: one receiver per head
                out[rs] = grad.permute(2, 0, 1, 3).detach()
            else:
                out[rs[0]] = grad.detach()
        return out

    def _receiver_inputs(self, i: int, which: str) -> dict:
        """Each receiver group's input in the clean or corrupted run of chunk i (no gradient)."""
        key = f"{which}_inputs"
        if key not in self._cache[i]:
            inputs = {}

            def receive(group, x, values):
                inputs[group] = x.detach()
                return x

            part = self.chunks[i][0]
            tokens = (self.task.clean if which == "clean" else self.task.corrupted)[part]
            with torch.no_grad(), graph_mode(self.model), self.model.hooks(_Pass(self.model, self.graph, receive).hooks()):
                self.model(tokens.to(self.model.device), stop_at_layer=self.graph.n_layers)
            self._cache[i][key] = inputs
        return self._cache[i][key]

    def patch_edges(self, edges: Sequence[tuple[int, int]] | None = None) -> Tensor:
        """Exact edge patching: [S, R] with metric(edge s -> r patched) - metric(clean) for each edge
        (default every edge: one run each, resumed at the receiver's layer)."""
        g = self.graph
        if edges is None:
            s, r = g.edges()
            edges = list(zip(s.tolist(), r.tolist()))
        out = torch.zeros(len(g.senders), len(g.receivers))
        for s, r in progress(edges, desc="patching edges", enabled=self.show_progress):
            mask = torch.zeros(len(g.senders), len(g.receivers))
            mask[s, r] = 1
            out[s, r] = self.patched(mask) - self.clean_metric
        return out

    def patch_nodes(self, senders: Sequence[int] | None = None) -> Tensor:
        """Exact node patching: [S] with metric(every edge out of s patched) - metric(clean) for each sender in
        `senders` (default all; the others 0). Patched where the
        sender writes (its value in the stream swapped for the corrupted one: nothing below it has changed, so
        every reader gets exactly what the edges' mask would give), resumed at its layer, on the fused path."""
        g, model, L = self.graph, self.model, self.graph.n_layers
        out = torch.zeros(len(g.senders))
        with torch.no_grad():
            todo = range(len(g.senders)) if senders is None else senders
            for s in progress(todo, desc="patching nodes", enabled=self.show_progress):
                name, layer = g.senders[s], g.sender_layer[s]
                total = 0.0
                for i, (part, answers) in enumerate(self.chunks):
                    clean, resid, _ = self._cache[i]["clean"]
                    change = self._cache[i]["corrupted"][0][s] - clean[s]
                    add = lambda x, hook: x + change.to(x.dtype)  # noqa: E731
                    if name == "embed":
                        start, point = 0, "blocks.0.hook_resid_pre"
                    else:
                        start, point = layer, f"blocks.{layer}.hook_{'mlp' if name.startswith('MLP') else 'attn'}_out"
                    with model.hooks([(point, add)]):
                        final = model(resid[start], start_at_layer=start, stop_at_layer=L)
                    total += float(_final(model, final, self.task, answers, part.start).double().sum())
                out[s] = total / self.task.n_answers - self.clean_metric
        return out

    def faithfulness(self, circuit: Tensor) -> float:
        """(metric(circuit) - metric(corrupted)) / (metric(model) - metric(corrupted)), with every edge
        outside the bool [S, R] `circuit` patched from the corrupted run: 1 is the model, 0 the corrupted run."""
        value = self.patched((~circuit) & self.graph.allowed)
        return (value - self.corrupted_metric) / (self.clean_metric - self.corrupted_metric)


def _keeper(store: dict, l: int):
    def hook(x, hook):
        store[l] = x.detach()
        return x
    return hook


class _Patching:
    """receive(): input_r - sum_s mask[s, r] (value_s now - value_s corrupted). A few senders are stacked.
    Past that the differences are read from a buffer, each written once as its sender computes it, with
    their running sum: a receiver reads every sender computed before it (but a parallel block's MLP), so
    its change is also that sum less sum_s (1 - mask[s, r]) times the differences, and whichever of the
    two forms has fewer senders is used (a circuit's complement: few kept edges, one product)."""

    STACK = 16  # senders up to which a receiver's change is stacked rather than read from the buffer

    def __init__(self, g: Graph, mask: Tensor, corrupted: Tensor) -> None:
        self.g, self.mask, self.corrupted = g, mask, corrupted
        self.diff: Tensor | None = None
        self.total: Tensor | None = None  # sum of the differences written so far
        self.filled = 0

    def __call__(self, group, x, values):
        rs = self.g.groups[group]
        n = len(values)
        sub = self.mask[:n, rs]
        senders = sub.any(1).nonzero().flatten()
        if senders.numel() == 0:
            return x
        if senders.numel() <= self.STACK:
            picked = senders.tolist()
            diff = torch.stack([values[s] - self.corrupted[s].to(x.dtype) for s in picked])  # [k, b, p, d]
            change = self._product(sub[picked], diff, x)
        else:
            self._fill(values, x)
            kept = (1 - sub) * self.g.allowed[:n, rs]
            rows = kept.any(1).nonzero().flatten()
            if bool(self.g.allowed[:n, rs].all()) and rows.numel() < senders.numel():
                change = self.total[None] - self._product(kept[rows], self.diff[rows], x)
            else:
                change = self._product(sub[senders], self.diff[senders], x)
        if x.dim() == 4:
            return x - change.permute(1, 2, 0, 3)
        return x - change[0]

    def _fill(self, values, x) -> None:
        if self.diff is None:
            self.diff = torch.empty((len(self.g.senders),) + values[0].shape, dtype=x.dtype, device=x.device)
            self.total = torch.zeros(values[0].shape, dtype=x.dtype, device=x.device)
        for s in range(self.filled, len(values)):
            torch.sub(values[s], self.corrupted[s].to(x.dtype), out=self.diff[s])
            self.total += self.diff[s]
        self.filled = len(values)

    @staticmethod
    def _product(w: Tensor, diff: Tensor, x: Tensor) -> Tensor:
        """sum_k w[k, r] diff[k] for each receiver r: [n_receivers, b, p, d]."""
        w = w.to(device=x.device, dtype=x.dtype)
        if w.shape[0] == 0:
            return torch.zeros((w.shape[1],) + diff.shape[1:], dtype=x.dtype, device=x.device)
        return (w.T @ diff.flatten(1)).view(w.shape[1], *diff.shape[1:])


# ---- circuits ----------------------------------------------------------------------------------------
SELECTIONS = ("top", "greedy")


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
    import heapq

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
    for s in range(1, S):  # senders in the order of computation
        rs = graph.inputs_of[s]
        reached[s] = bool(rs) and bool((edges[:, rs] & reached[:, None]).any())
    edges = edges & reached[:, None]
    useful = torch.zeros(R, dtype=torch.bool)  # receivers with a path on to the logits
    useful[R - 1] = True
    for s in range(S - 1, -1, -1):  # a node's receivers are decided before the senders that feed them
        if bool((edges[s] & useful).any()):
            useful[graph.inputs_of[s]] = True
    return edges & useful[None, :]


def select(graph: Graph, scores: Tensor, n: int, how: str = "top") -> Tensor:
    """`n` edges by `how` ("top" or "greedy"), dangling ones pruned."""
    if how not in SELECTIONS:
        raise ValueError(f"unknown selection {how!r}: choose one of {', '.join(SELECTIONS)}")
    pick = top_edges if how == "top" else greedy_edges
    return prune_dangling(graph, pick(graph, scores, n))


def faithfulness_curve(runner: Runner, scores: Tensor, fractions: Sequence[float] = FRACTIONS, how: str = "top",
                       show_progress: bool | None = None) -> pd.DataFrame:
    """Faithfulness of the circuits of each size: `fraction` of the graph's edges chosen (`select`),
    `edges` kept after pruning, `faithfulness` (see `Runner.faithfulness`)."""
    g, rows = runner.graph, []
    for f in progress(list(fractions), desc="faithfulness", enabled=show_progress):
        n = int(round(f * g.n_edges)) if f < 1 else g.n_edges
        circuit = select(g, scores, max(n, 1) if f > 0 else 0, how)
        rows.append({"fraction": float(f), "edges": int(circuit.sum()), "faithfulness": runner.faithfulness(circuit)})
    return pd.DataFrame(rows)


def areas(curve: pd.DataFrame) -> dict:
    """MIB's summaries of a faithfulness curve over edge fractions in [0, 1]: CPR, the area under it
    (higher is better), and CMD, the area under |1 - faithfulness| (lower is better)."""
    x, y = curve["fraction"].to_numpy(float), curve["faithfulness"].to_numpy(float)
    trapz = getattr(np, "trapezoid", None) or np.trapz
    return {"cpr": float(trapz(y, x)), "cmd": float(trapz(np.abs(1 - y), x))}
