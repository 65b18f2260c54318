"""Runs through the graph: exact edge and node patching (resumed at the first changed layer), EAP and
EAP-IG (`Runner`), and faithfulness over circuit sizes (`faithfulness_curve`)."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.models.device import to_host
from interp.models.memory import per_token_bytes

from .._common import frozen_params, progress
from .graph import FRACTIONS, IG_ON, Graph, Task, select
from .layered import SENDER_CHUNK, layered_attribution
from .passes import Stacked, _Pass, graph_mode
from .qk import parse_head, qk_attribution


# bytes of the whole graph's receiver gradients past which attribution goes block by block: at 1,021 tokens on
# SmolLM2 (1.98 GB of them) the whole graph peaked at 9.15 GiB and block by block at 2.13 GiB, in the same time
LAYERED_ABOVE = 2 ** 30
IG_POINTS = ("midpoint", "left")  # where EAP-IG takes its gradients between the corrupted (0) and clean (1) run
EAP_KL = ("EAP takes the metric's gradient at the clean run, where KL from the clean run is least (gradient 0, every "
          "score 0): use EAP-IG or exact patching (--method eap-ig or patching) with the kl metric")


def _check_sandwich(model) -> None:
    if model.cfg.sandwich_norms and not all(type(b.ln1_post).__name__ == "RMSNorm" for b in model.blocks):
        raise NotImplementedError("circuits: sandwich norms other than RMSNorm are not split into head shares")


def _final(model, resid: Tensor, task: Task, answers: Tensor, start: int) -> Tensor:
    """Per-answer metric values from the final residual stream of prompts [start, ...]."""
    rows, pos = task.rows[answers] - start, task.positions[answers]
    x = resid[rows.to(resid.device), pos.to(resid.device)][:, None]
    logits = model(x, "logits", start_at_layer=model.cfg.n_layers)[:, 0]
    return task.metric(logits.float(), answers)


def goes_by_layer(graph: Graph, d_model: int, batch: int, positions: int) -> bool:
    """Whether attribution goes block by block by default (`Runner(layered=None)`): when the whole graph's
    receiver gradients for a chunk, [R, batch, positions, d_model] in float32, would pass `LAYERED_ABOVE`."""
    return len(graph.receivers) * batch * positions * d_model * 4 > LAYERED_ABOVE


def cache_bytes(cfg, graph: Graph, n_prompts: int, positions: int, batch_size: int, element_size: int = 4,
                layered: bool = False) -> int:
    """Peak bytes of a `Runner` beyond the model: what it caches for every prompt, clean and corrupted (each
    sender's value and each block's input at every position: 2 (senders + layers + 1) x positions x d_model
    values; `layered`: each sender's difference and both runs' block inputs, (senders + 2 (layers + 1)) x
    positions x d_model), plus one chunk's working set: a forward's activations, and the receivers' inputs and
    gradients that attribution holds (all of them; `layered`: one block's, and a few senders' differences)."""
    runs = 1 if layered else 2  # runs whose senders' values are cached (layered: their difference)
    cached = (runs * len(graph.senders) + 2 * (graph.n_layers + 1)) * positions * cfg.d_model * element_size
    if layered:
        per_block = max(sum(len(rs) for (l, _), rs in graph.groups.items() if l == layer)
                        for layer in range(graph.n_layers + 1))  # one block's receivers
        held = 2 * (per_block + min(SENDER_CHUNK, len(graph.senders))) * cfg.d_model * 4
    else:
        held = 2 * (len(graph.senders) + len(graph.receivers)) * cfg.d_model * 4
    return n_prompts * cached + batch_size * positions * (per_token_bytes(cfg) + held)


class Runner:
    """Clean and corrupted runs of a task on a model, cached per chunk of prompts, and the scores."""

    def __init__(self, model, task: Task, *, batch_size: int = 16, show_progress: bool | None = None,
                 layered: bool | None = None) -> None:
        """`layered`: EAP and EAP-IG one block at a time (`layered`: memory that grows with positions x d_model,
        not with the receivers' gradients); None: so when the whole graph's gradients would pass `LAYERED_ABOVE`
        bytes (prompts of ~500 tokens on SmolLM2)."""
        if not getattr(model, "native", True):
            raise NotImplementedError("circuits need interp's own transformer (per-head inputs and outputs); this "
                                      "model is wrapped (run by transformers): load a natively supported family")
        _check_sandwich(model)
        self.model, self.task, self.graph = model, task, Graph(model.cfg)
        self.batch_size, self.show_progress = batch_size, show_progress
        self.chunks = list(task.chunks(batch_size))
        if layered is None:
            layered = goes_by_layer(self.graph, model.cfg.d_model, min(batch_size, task.clean.shape[0]),
                                    task.clean.shape[1])
        self.layered = bool(layered)
        # Block by block, the cache is lean: each sender's corrupted - clean value (all that attribution reads)
        # rather than both runs' values, half the bytes (3 GB per 4,096-token prompt on SmolLM2); a patched run
        # forms the corrupted values again, block by block, from the corrupted stream (`_lean_patched`).
        self.lean = self.layered
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
            p = _Pass(self.model, self.graph, store=len(self.graph.senders))
            lean = self.lean and which == "corrupted"
            if lean:  # each value written over the clean one as corrupted - clean
                p.values = Stacked(len(self.graph.senders), minus=self._cache[i]["clean"][0])
            resid: dict[int, Tensor] = {}
            hooks = p.hooks() + [(f"blocks.{l}.hook_resid_pre", _keeper(resid, l)) for l in range(self.graph.n_layers)]
            with graph_mode(self.model), self.model.hooks(hooks):
                final = self.model(tokens[part].to(self.model.device), stop_at_layer=self.model.cfg.n_layers)
            values = _final(self.model, final, self.task, answers, part.start)
            total += float(values.double().sum())
            kept = p.values.stacked
            if lean:
                self._cache[i]["diff"], kept = kept, None
                self._cache[i]["clean"] = (None,) + self._cache[i]["clean"][1:]
            self._cache.setdefault(i, {})[which] = (kept, [resid[l] for l in range(self.graph.n_layers)], final)
        return total / self.task.n_answers

    def _differences(self, i: int, s: int = 0, e: int | None = None) -> Tensor:
        """Senders s..e's corrupted - clean values in chunk i, [e - s, b, p, d]: cached (`lean`) or formed."""
        c = self._cache[i]
        if self.lean:
            return c["diff"][s:e]
        return c["corrupted"][0][s:e] - c["clean"][0][s:e]

    def patched(self, mask: Tensor, *, show_progress: bool | None = False) -> float:
        """The metric with every edge where `mask` [S, R] is 1 patched from the corrupted run (a float
        mask mixes: 0.5 is halfway). Resumes from the clean stream below the first receiver it changes."""
        g = self.graph
        mask = (mask.to(torch.float32) * g.allowed)
        touched = mask.any(0).nonzero().flatten()
        if touched.numel() == 0:
            return self.clean_metric
        start = min(g.receiver_layer[r] for r in touched.tolist())
        return self._patched_run(lambda i, part, corrupted: _Patching(g, mask, corrupted), start, show_progress)

    def _patched_run(self, patching, start: int, show_progress: bool | None = False) -> float:
        """The metric with each chunk's receivers changed by `patching(i, part, corrupted values)` (a
        `receive`), resumed from the clean stream at layer `start`."""
        g = self.graph
        total = 0.0
        with torch.no_grad(), graph_mode(self.model):
            for i, (part, answers) in progress(list(enumerate(self.chunks)), desc="patched run", enabled=show_progress):
                if self.lean:
                    final = self._lean_patched(i, part, patching, start)
                    total += float(_final(self.model, final, self.task, answers, part.start).double().sum())
                    continue
                clean, resid, final = self._cache[i]["clean"]
                receive = patching(i, part, Corrupted(self._cache[i]["corrupted"][0]))
                p = _Pass(self.model, g, receive, given=list(clean), start=min(start, g.n_layers))
                with self.model.hooks(p.hooks()):
                    if start >= g.n_layers:  # only the logits change
                        final = receive((g.n_layers, "logits"), final, list(clean))
                    else:
                        final = self.model(resid[start], start_at_layer=start, stop_at_layer=g.n_layers)
                total += float(_final(self.model, final, self.task, answers, part.start).double().sum())
        return total / self.task.n_answers

    def _lean_patched(self, i: int, part: slice, patching, start: int) -> Tensor:
        """The final stream of chunk i's patched run on the lean cache, block by block from `start`: each block's
        senders' corrupted values formed again from the corrupted stream entering it (the cached run's, bit for
        bit) just before the patched block reads them, and dropped once their differences are buffered."""
        model, g = self.model, self.graph
        _, resid, final = self._cache[i]["clean"]
        start = min(start, g.n_layers)
        below = sum(1 for l in g.sender_layer if l < start) if start > 0 else 0
        source = LeanDifferences(self._cache[i]["diff"], below)
        receive = patching(i, part, source)
        p = _Pass(model, g, receive, given=[None] * below, start=start)
        if start >= g.n_layers:  # only the logits change
            return receive((g.n_layers, "logits"), final, p.values)
        x, corrupted = resid[start], self._cache[i]["corrupted"][1]
        for l in range(start, g.n_layers):
            formed = _Pass(model, g, start=l)
            with model.hooks(formed.hooks()):
                model(corrupted[l], start_at_layer=l, stop_at_layer=l + 1)
            source.extend(formed.values)
            with model.hooks(p.hooks()):
                x = model(x, start_at_layer=l, stop_at_layer=l + 1)
        return x

    # -- why a head attends where it does --
    def qk_attribution(self, head, key_pos=None, top_keys: int = 3, corrupted: bool = True):
        """Head `head` ("L1H0", "1.0" or (layer, head))'s scores from each answer position of the clean
        prompts (the query) to `key_pos` (None: the `top_keys` keys it attends to most), decomposed into
        (query-side sender, key-side sender) terms; with `corrupted`, each pair's change of term in the
        corrupted run and its first-order share of the attention weight's change (`qk.qk_attribution`)."""
        layer, h = parse_head(head, self.model.cfg)
        t = self.task

        def given(which: str, part: slice):  # the cached runs: only the head's block runs again
            i = part.start // self.batch_size
            values, resid, _ = self._cache[i][which]
            return values, resid[layer]

        return qk_attribution(self.model, t.clean, layer, h, t.positions, key_pos=key_pos, top_keys=top_keys,
                              corrupted=t.corrupted if corrupted else None, batch_size=self.batch_size, rows=t.rows,
                              given=None if self.lean else given)  # a lean cache keeps no sender's value

    # -- scores --
    def eap(self, positions=None) -> Tensor:
        """EAP edge scores [S, R]: (corrupted - clean value of s) . d metric / d input_r at the clean run.
        Refused for the kl metric, whose gradient at the clean run is 0 (every score would be 0). With
        `positions` (`positions.Positions`): [S, R, C], the sum kept apart per position class."""
        if self.task.metric_name == "kl":
            raise ValueError(EAP_KL)
        return self._attribution([None], positions)

    def eap_ig(self, steps: int = 5, on: str = "inputs", positions=None, points: str = "midpoint") -> Tensor:
        """EAP-IG edge scores [S, R] with `steps` points between the corrupted (0) and the clean run (1), on the
        embeddings (`on="inputs"`) or on every receiver's input at once (`"activations"`); [S, R, C] with
        `positions`, as `eap`. `points`: "midpoint", (k + 1/2) / steps (the integral's midpoint rule), or
        "left", k / steps from the corrupted run (hannamw/EAP-IG's own points: its scores, to round-off)."""
        if on not in IG_ON:
            raise ValueError(f"EAP-IG interpolates 'inputs' or 'activations', got {on!r}")
        if steps < 1:
            raise ValueError(f"EAP-IG needs at least one step, got {steps}")
        if points not in IG_POINTS:
            raise ValueError(f"EAP-IG's points are {' or '.join(map(repr, IG_POINTS))}, got {points!r}")
        offset = 0.5 if points == "midpoint" else 0.0
        return self._attribution([((k + offset) / steps, on) for k in range(steps)], positions)

    def _attribution(self, points: list, positions=None) -> Tensor:
        g, model = self.graph, self.model
        extra = () if positions is None else (positions.n_classes,)
        scores = torch.zeros(len(g.senders), len(g.receivers), *extra, dtype=torch.float64)
        jobs = [(i, point) for i in range(len(self.chunks)) for point in points]
        with frozen_params(model), graph_mode(model):
            for i, point in progress(jobs, desc="attribution", enabled=self.show_progress):
                part, answers = self.chunks[i]
                if self.layered:  # block by block, contracted as each block's gradients come
                    layered_attribution(self, i, point, scores, 1 / len(points), positions)
                    continue
                grads = self._gradients(i, part, answers, point)
                if positions is not None:  # [S, b, p, d] . [R, b, p, d] summed per class: [S, R, C]
                    part_scores = positions.contract(part, self._differences(i), grads)
                else:
                    diff = self._differences(i).flatten(1).float()  # [S, b*p*d]
                    part_scores = diff @ grads.flatten(1).float().T
                scores += to_host(part_scores).double() / len(points)
        return (scores * g.allowed.reshape(g.allowed.shape + (1,) * len(extra))).float()

    def _final_metric(self, final: Tensor, answers: Tensor, start: int) -> Tensor:
        return _final(self.model, final, self.task, answers, start)

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
                    resid = self._cache[i]["clean"][1]
                    change = self._differences(i, s, s + 1)[0]
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

    def __init__(self, g: Graph, mask: Tensor, source) -> None:
        """`source`: each sender's value now less its corrupted value (`Corrupted`, `LeanDifferences`)."""
        self.g, self.mask, self.source = g, mask, source
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
        if senders.numel() <= self.STACK and not self.source.lean:
            picked = senders.tolist()
            diff = torch.stack([self.source.difference(s, values, x.dtype) for s in picked])  # [k, b, p, d]
            change = self._product(sub[picked], diff, x)
        else:
            self._fill(values, x)
            allowed = self.g.allowed[:n, rs]
            change = self._buffered(sub, (1 - sub) * allowed, bool(allowed.all()), senders, x)
        return self._applied(x, change)

    def _buffered(self, sub: Tensor, kept: Tensor, reads_all: bool, senders: Tensor, x: Tensor) -> Tensor:
        """The change from the buffer of differences: the patched senders' (`sub`), or, for a receiver that reads
        every earlier sender (`reads_all`), the running sum less the kept ones', whichever has fewer senders."""
        rows = kept.flatten(1).any(1).nonzero().flatten()
        if reads_all and rows.numel() < senders.numel():
            return self.total[None] - self._product(kept[rows], self.diff[rows], x)
        return self._product(sub[senders], self.diff[senders], x)

    @staticmethod
    def _applied(x: Tensor, change: Tensor) -> Tensor:
        """x less the change ([n_receivers, b, p, d]), per head ([b, p, n, d]) or for the one receiver."""
        if x.dim() == 4:
            return x - change.permute(1, 2, 0, 3)
        return x - change[0]

    def _fill(self, values, x) -> None:
        if self.diff is None:
            shape = (x.shape[0], x.shape[1], x.shape[-1])  # every receiver reads the stream [b, p, d_model]
            self.diff = torch.empty((len(self.g.senders),) + shape, dtype=x.dtype, device=x.device)
            self.total = torch.zeros(shape, dtype=x.dtype, device=x.device)
        for s in range(self.filled, len(values)):
            self.source.difference(s, values, x.dtype, out=self.diff[s])
            self.total += self.diff[s]
            if self.source.lean:  # read from the buffer from now on: the value is not held twice
                values[s] = None
                self.source.release(s)
        self.filled = len(values)

    @staticmethod
    def _product(w: Tensor, diff: Tensor, x: Tensor) -> Tensor:
        """sum_k w[k, r] diff[k] for each receiver r: [n_receivers, b, p, d]."""
        w = w.to(device=x.device, dtype=x.dtype)
        if w.shape[0] == 0:
            return torch.zeros((w.shape[1],) + diff.shape[1:], dtype=x.dtype, device=x.device)
        return (w.T @ diff.flatten(1)).view(w.shape[1], *diff.shape[1:])


class Corrupted:
    """A patching's source (`_Patching`): value now - the cached corrupted value of each sender."""

    lean = False

    def __init__(self, corrupted: Tensor) -> None:
        self.corrupted = corrupted

    def difference(self, s: int, values, dtype, out: Tensor | None = None) -> Tensor:
        return torch.sub(values[s], self.corrupted[s].to(dtype), out=out)


class LeanDifferences:
    """A patching's source on a lean cache (`Runner.lean`). Below the resumed run's first block each value now
    is the clean one, so its difference is the cached corrupted - clean negated (bit for bit clean - corrupted);
    from there on, the value now less the corrupted value formed again block by block (`extend`). Read once
    each (`_Patching` buffers them, then `release`s)."""

    lean = True

    def __init__(self, cached: Tensor, below: int) -> None:
        self.cached, self.below, self.formed = cached, below, []

    def extend(self, values) -> None:
        self.formed.extend(values)

    def difference(self, s: int, values, dtype, out: Tensor | None = None) -> Tensor:
        if s < self.below:
            return torch.neg(self.cached[s].to(dtype), out=out)
        return torch.sub(values[s], self.formed[s - self.below].to(dtype), out=out)

    def release(self, s: int) -> None:
        if s >= self.below:
            self.formed[s - self.below] = None


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
