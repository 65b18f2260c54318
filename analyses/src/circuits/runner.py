"""Runs through the graph: exact edge and node patching (resumed at the first changed layer), EAP and
EAP-IG (`Runner`), and faithfulness over circuit sizes (`faithfulness_curve`).

What a runner holds: each chunk of prompts' clean and corrupted runs (`Runner._chunk`). Short prompts: every
chunk's, each sender's value in both runs. Long prompts (block by block, `layered`): a chunk is as many prompts
as fit in `HELD_BYTES` (at least one), and as many chunks' lean runs as fit in it are held (at least one); a
chunk that is not held is run again when a stage needs it (the same values, bit for bit). Every stage goes
chunk by chunk (each point of EAP-IG, each run of a faithfulness curve, each node or edge patched), the chunks
held first, so a stage runs a chunk again at most once: at 4,096 tokens on SmolLM2 one prompt's runs (3.4 GB)
are held, not every prompt's."""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_host, to_numpy
from interp.models.saes.formats import as_sae

from .._common import frozen_params, progress
from .choices import IG_ON, IG_POINTS
from .features import FeatureNodes, check_saes, feature_nodes, fired
from .graph import FRACTIONS, Graph, Task, select
from .layered import layered_attribution
from .passes import Corrupted, LeanDifferences, Stacked, _Pass, _Patching, graph_mode
from .head_names import parse_head
from .qk import qk_attribution


# bytes of the whole graph's receiver gradients past which attribution goes block by block: at 1,021 tokens on
# SmolLM2 (1.98 GB of them) the whole graph peaked at 9.15 GiB and block by block at 2.13 GiB, in the same time
LAYERED_ABOVE = 2 ** 30
# block by block, the runs held at once: a chunk is as many prompts as fit (at least one), and as many chunks as
# fit are held (at least one); at 1,024 tokens one SmolLM2 prompt's lean runs are 0.86 GB
HELD_BYTES = 2 ** 30
# EAP-IG's most steps: its integral's midpoint rule errs by O(1 / steps^2), so tens of steps are plenty (the
# default is 5) and thousands only cost: each step is a forward and a backward over every prompt
MAX_STEPS = 1000
MEMO = 64  # circuits whose faithfulness a runner remembers (a circuit drawn after its curve is not run again)
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


def _feature_nodes(model, task: Task, saes: Sequence, batch_size: int, all_features: bool) -> list:
    """The graph's `features.FeatureNodes` of `saes`: checked together (one line each), then each SAE's features
    that fire on the task's clean or corrupted prompts (`features.fired`; `all_features`: every one)."""
    if not saes:
        return []
    if getattr(model, "acts_to_saes", None):
        raise ValueError(f"the model has SAEs spliced in ({', '.join(model.acts_to_saes)}): the circuit's graph reads "
                         "the model as it is; take them out (model.reset_saes()) and give them as saes=")
    given = [s if isinstance(s, FeatureNodes) else as_sae(s) for s in saes]
    check_saes(model.cfg, [s.sae.cfg if isinstance(s, FeatureNodes) else s.cfg for s in given])
    for s in given:
        sae = s.sae if isinstance(s, FeatureNodes) else s
        if torch.device(sae.device) != torch.device(model.device):
            raise ValueError(f"the SAE at {sae.cfg.hook_name} is on {sae.device} and the model on {model.device}: "
                             "put it on the model's device (sae.to(model.device))")
    loose = [s for s in given if not isinstance(s, FeatureNodes)]
    found = iter(fired(model, task, loose, batch_size) if loose and not all_features else [])
    return [s if isinstance(s, FeatureNodes) else
            feature_nodes(model.cfg, s, None if all_features else next(found).nonzero().flatten().tolist())
            for s in given]


def goes_by_layer(graph: Graph, d_model: int, batch: int, positions: int) -> bool:
    """Whether attribution goes block by block by default (`Runner(layered=None)`): when the whole graph's
    receiver gradients for a chunk, [R, batch, positions, d_model] in float32, would pass `LAYERED_ABOVE`."""
    return len(graph.receivers) * batch * positions * d_model * 4 > LAYERED_ABOVE


def run_bytes(cfg, graph: Graph, positions: int, element_size: int = 4, lean: bool = False) -> int:
    """Bytes of one prompt's cached runs: each sender's value in both runs (`lean`: their difference) and both
    runs' block inputs and final streams, each positions x d_model."""
    rows = (1 if lean else 2) * len(graph.senders) + 2 * (graph.n_layers + 1)
    return rows * positions * cfg.d_model * element_size


def chunking(cfg, graph: Graph, n_prompts: int, positions: int, batch_size: int, layered: bool,
             element_size: int = 4) -> tuple[int, int]:
    """(prompts per chunk, chunks held at once) of a `Runner`: `batch_size` and every chunk; block by block, as
    many prompts as fit in `HELD_BYTES` (at most `batch_size`, at least one) and as many such chunks as fit."""
    if not layered:
        return batch_size, max(1, -(-n_prompts // batch_size))
    per = run_bytes(cfg, graph, positions, element_size, lean=True)
    size = max(1, min(batch_size, n_prompts, HELD_BYTES // per))
    chunks = -(-n_prompts // size)
    return size, max(1, min(chunks, HELD_BYTES // (size * per)))


def steps_refused(steps: int) -> str | None:
    """Why EAP-IG refuses `steps` points (one line), or None."""
    if steps < 1:
        return f"EAP-IG needs at least one step, got {steps}"
    if steps > MAX_STEPS:
        return (f"--steps {steps:,}: EAP-IG takes at most {MAX_STEPS:,} steps (its integral's midpoint rule errs by "
                "O(1/steps^2): tens of steps are plenty, the default is 5, and each step is a forward and a backward "
                "over every prompt)")
    return None


class Runner:
    """Clean and corrupted runs of a task on a model, cached per chunk of prompts, and the scores."""

    def __init__(self, model, task: Task, *, batch_size: int = 16, show_progress: bool | None = None,
                 layered: bool | None = None, hold: int | None = None, saes: Sequence = (),
                 all_features: bool = False) -> None:
        """`layered`: EAP and EAP-IG one block at a time (`layered`: memory that grows with positions x d_model,
        not with the receivers' gradients); None: so when the whole graph's gradients would pass `LAYERED_ABOVE`
        bytes (prompts of ~500 tokens on SmolLM2). `hold`: the chunks whose runs are kept at once (None: every
        chunk's; block by block, as many as fit in `HELD_BYTES`, and a chunk is as many prompts as fit in it).
        `saes`: SAEs on components' outputs whose features and errors replace those components' senders
        (`features`; on the model's device); only the features that fire on the task's prompts are nodes, unless
        `all_features` (or given as `features.FeatureNodes`, taken as they are)."""
        if not getattr(model, "native", True):
            raise NotImplementedError("circuits need interp's own transformer (per-head inputs and outputs); this "
                                      "model is wrapped (run by transformers): load a natively supported family")
        _check_sandwich(model)
        self.model, self.task = model, task
        self.graph = Graph(model.cfg, _feature_nodes(model, task, saes, batch_size, all_features))
        self.batch_size, self.show_progress = batch_size, show_progress
        n, positions = task.clean.shape
        if layered is None:
            layered = goes_by_layer(self.graph, model.cfg.d_model, min(batch_size, n), positions)
        self.layered = bool(layered)
        if self.layered and self.graph.cut is not None:
            raise ValueError(f"the SAE at {self.graph.cut.hook_name} cuts the residual stream, which block-by-block "
                             "attribution (long prompts) does not take: use shorter prompts, or an SAE on hook_z, "
                             "hook_attn_out or hook_mlp_out")
        # Block by block, the cache is lean: each sender's corrupted - clean value (all that attribution reads)
        # rather than both runs' values, half the bytes (3 GB per 4,096-token prompt on SmolLM2); a patched run
        # forms the corrupted values again, block by block, from the corrupted stream (`_lean_patched`).
        self.lean = self.layered
        element = next(model.parameters()).element_size()
        self.chunk_size, held = chunking(model.cfg, self.graph, n, positions, batch_size, self.layered, element)
        self.chunks = list(task.chunks(self.chunk_size))
        self.hold = held if hold is None else max(1, int(hold))
        g = self.graph
        self._below = [0] + [sum(1 for l in g.sender_layer if l < start) for start in range(1, g.n_layers + 1)]
        self._cache: dict[int, dict] = {}  # chunk -> its runs (`_build`), the most recently used last
        self._memo: dict[bytes, float] = {}  # a circuit's faithfulness, by the circuit (`faithfulness_many`)
        clean = corrupted = 0.0
        with torch.no_grad():
            for i in range(len(self.chunks)):
                c, k = self._build(i)
                clean += c
                corrupted += k
        clean, corrupted = clean / task.n_answers, corrupted / task.n_answers
        self.clean_metric, self.corrupted_metric = clean, corrupted
        if not (math.isfinite(clean) and math.isfinite(corrupted)):
            raise ValueError(f"the task's metric is not finite (clean {clean}, corrupted {corrupted}): check the "
                             "prompts and answers")
        if abs(clean - corrupted) <= 1e-6 * max(1.0, abs(clean)):
            raise ValueError(f"the task's metric does not differ between clean and corrupted prompts ({clean:.6g}): "
                             "nothing to attribute; the corrupted prompts must change the answer")

    # -- runs --
    def _build(self, i: int) -> tuple[float, float]:
        """Run chunk i's clean and corrupted prompts, keeping the senders' values (lean: their difference) and each
        block's input, in place of the least recently used chunk's past `hold`; the sums of their metric values."""
        while len(self._cache) >= self.hold:
            self._cache.pop(next(iter(self._cache)))
        entry: dict = {}
        clean, corrupted = self._run(i, "clean", entry), self._run(i, "corrupted", entry)
        entry["written_from"] = self.graph.n_layers  # lean: the first block whose senders' differences a patched
        self._cache[i] = entry                       # run wrote over (`_lean_patched`); none yet
        return clean, corrupted

    def _run(self, i: int, which: str, entry: dict) -> float:
        """Chunk i's clean or corrupted run into `entry`: (senders' values, block inputs, final stream); the sum of
        its metric values. Lean, the corrupted run writes each value over the clean one as corrupted - clean."""
        part, answers = self.chunks[i]
        tokens = self.task.clean if which == "clean" else self.task.corrupted
        p = _Pass(self.model, self.graph, store=len(self.graph.senders))
        lean = self.lean and which == "corrupted"
        if lean:
            p.values = Stacked(len(self.graph.senders), minus=entry["clean"][0])
        resid: dict[int, Tensor] = {}
        hooks = p.hooks() + [(f"blocks.{l}.hook_resid_pre", _keeper(resid, l)) for l in range(self.graph.n_layers)]
        with graph_mode(self.model), self.model.hooks(hooks):
            final = self.model(tokens[part].to(self.model.device), stop_at_layer=self.model.cfg.n_layers)
        values = _final(self.model, final, self.task, answers, part.start)
        kept = p.values.stacked
        if lean:
            entry["diff"], kept = kept, None
            entry["clean"] = (None,) + entry["clean"][1:]
        entry[which] = (kept, [resid[l] for l in range(self.graph.n_layers)], final)
        return float(values.double().sum())

    def _chunk(self, i: int) -> dict:
        """Chunk i's runs: held, or run again (`_build`: the same values, bit for bit)."""
        if i in self._cache:
            self._cache[i] = self._cache.pop(i)  # now the most recently used
        else:
            with torch.no_grad():
                self._build(i)
        return self._cache[i]

    def _order(self) -> list[int]:
        """The chunks, those held first: a stage that goes chunk by chunk runs again only those not held."""
        n = len(self.chunks)
        return [i for i in range(n) if i in self._cache] + [i for i in range(n) if i not in self._cache]

    def release(self) -> None:
        """Drop every chunk's runs (each is run again when next needed)."""
        self._cache.clear()

    def _differences(self, i: int, s: int = 0, e: int | None = None) -> Tensor:
        """Senders s..e's corrupted - clean values in chunk i, [e - s, b, p, d]: cached (`lean`) or formed."""
        c = self._chunk(i)
        if self.lean:
            if (len(self.graph.senders) if e is None else e) > self._below[c["written_from"]]:
                self._form_again(i)
            return c["diff"][s:e]
        return c["corrupted"][0][s:e] - c["clean"][0][s:e]

    def _form_again(self, i: int) -> None:
        """Chunk i's lean differences that a patched run wrote over, formed again block by block from both runs'
        block inputs: the runs' own values, bit for bit (each block run alone is the block the run ran)."""
        model, g, c = self.model, self.graph, self._cache[i]
        s = self._below[c["written_from"]]
        with torch.no_grad(), graph_mode(model):
            for l in range(c["written_from"], g.n_layers):
                formed = []
                for which in ("corrupted", "clean"):
                    p = _Pass(model, g, start=l)
                    with model.hooks(p.hooks()):
                        model(c[which][1][l], start_at_layer=l, stop_at_layer=l + 1)
                    formed.append(p.values)
                for corrupted, clean in zip(*formed):
                    torch.sub(corrupted, clean, out=c["diff"][s])
                    s += 1
        c["written_from"] = g.n_layers

    def patched(self, mask: Tensor, *, show_progress: bool | None = False) -> float:
        """The metric with every edge where `mask` [S, R] is 1 patched from the corrupted run (a float
        mask mixes: 0.5 is halfway). Resumes from the clean stream below the first receiver it changes."""
        return self.patched_many([mask], show_progress=show_progress)[0]

    def patched_many(self, masks: Sequence[Tensor], *, show_progress: bool | None = False,
                     desc: str = "patched run") -> list[float]:
        """`patched` of each mask, chunk by chunk: each chunk's runs held, or run again once for all of them."""
        g, out, jobs = self.graph, [], []
        for mask in masks:
            mask = mask.to(torch.float32) * g.allowed
            touched = mask.any(0).nonzero().flatten()
            if touched.numel() == 0:
                out.append(self.clean_metric)
                continue
            start = min(g.receiver_layer[r] for r in touched.tolist())
            jobs.append((lambda i, part, source, mask=mask: _Patching(g, mask, source), start))
            out.append(None)
        found = iter(self._patched_runs(jobs, show_progress, desc))
        return [next(found) if value is None else value for value in out]

    def _patched_run(self, patching, start: int, show_progress: bool | None = False) -> float:
        """The metric with each chunk's receivers changed by `patching(i, part, source)` (a `receive`; source: the
        senders' differences, `Corrupted` or `LeanDifferences`), resumed from the clean stream at layer `start`."""
        return self._patched_runs([(patching, start)], show_progress)[0]

    def _patched_runs(self, jobs: Sequence[tuple[Callable, int]], show_progress: bool | None = False,
                      desc: str = "patched run") -> list[float]:
        """`_patched_run` of each (patching, start), chunk by chunk (the held chunks first); each metric summed over
        the chunks in their order."""
        g = self.graph
        sums = [[0.0] * len(self.chunks) for _ in jobs]
        steps = [(i, j) for i in self._order() for j in range(len(jobs))]
        with torch.no_grad(), graph_mode(self.model):
            for i, j in progress(steps, desc=desc, enabled=show_progress):
                (part, answers), (patching, start) = self.chunks[i], jobs[j]
                if self.lean:
                    final = self._lean_patched(i, part, patching, start)
                else:
                    c = self._chunk(i)
                    clean, resid, final = c["clean"]
                    receive = patching(i, part, Corrupted(c["corrupted"][0]))
                    p = _Pass(self.model, g, receive, given=list(clean), start=min(start, g.n_layers))
                    with self.model.hooks(p.hooks()):
                        if start >= g.n_layers:  # only the logits change
                            final = receive((g.n_layers, "logits"), final, list(clean))
                        else:
                            final = self.model(resid[start], start_at_layer=start, stop_at_layer=g.n_layers)
                sums[j][i] = float(_final(self.model, final, self.task, answers, part.start).double().sum())
        out = []
        for row in sums:
            total = 0.0
            for value in row:  # in the chunks' order, whichever order they ran in
                total += value
            out.append(total / self.task.n_answers)
        return out

    def _lean_patched(self, i: int, part: slice, patching, start: int) -> Tensor:
        """The final stream of chunk i's patched run on the lean cache, block by block from `start`: each block's
        senders' corrupted values formed again from the corrupted stream entering it (the cached run's, bit for
        bit) just before the patched block reads them; their differences are written over the cached ones
        (`LeanDifferences`), so the run resumes no later than the first block a run wrote over."""
        model, g = self.model, self.graph
        c = self._chunk(i)
        _, resid, final = c["clean"]
        start = min(start, g.n_layers, c["written_from"])
        below = self._below[start]
        source = LeanDifferences(c["diff"], below)
        receive = patching(i, part, source)
        p = _Pass(model, g, receive, given=[None] * below, start=start)
        if start >= g.n_layers:  # only the logits change
            return receive((g.n_layers, "logits"), final, p.values)
        c["written_from"] = start
        x, corrupted = resid[start], c["corrupted"][1]
        for l in range(start, g.n_layers):
            formed = _Pass(model, g, start=l)
            with model.hooks(formed.hooks()):
                model(corrupted[l], start_at_layer=l, stop_at_layer=l + 1)
            source.extend(formed.values)
            with model.hooks(p.hooks()):
                x = model(x, start_at_layer=l, stop_at_layer=l + 1)
        return x

    # -- why a head attends where it does --
    def qk_attribution(self, head, key_pos=None, top_keys: int = 3, corrupted: bool = True, sae=None):
        """Head `head` ("L1H0", "1.0" or (layer, head))'s scores from each answer position of the clean
        prompts (the query) to `key_pos` (None: the `top_keys` keys it attends to most), decomposed into
        (query-side sender, key-side sender) terms; with `corrupted`, each pair's change of term in the
        corrupted run and its first-order share of the attention weight's change (`qk.qk_attribution`). `sae`: a
        residual SAE at the stream the head's layer reads, whose features become the senders (`qk_features`)."""
        layer, h = parse_head(head, self.model.cfg)
        t = self.task

        def given(which: str, part: slice):  # the cached runs: only the head's block runs again
            values, resid, _ = self._chunk(part.start // self.chunk_size)[which]
            return values, resid[layer]

        # a lean cache keeps no sender's value; a graph of SAE features keeps the features', not the heads' the
        # head-level split reads: both run the forward to the head's layer again
        reuse = not self.lean and not self.graph.saes
        return qk_attribution(self.model, t.clean, layer, h, t.positions, key_pos=key_pos, top_keys=top_keys,
                              corrupted=t.corrupted if corrupted else None, batch_size=self.chunk_size, rows=t.rows,
                              given=given if reuse else None, sae=sae)

    # -- scores --
    def eap(self, positions=None) -> Tensor:
        """EAP edge scores [S, R]: (corrupted - clean value of s) . d metric / d input_r at the clean run.
        Refused for the kl metric, whose gradient at the clean run is 0 (every score would be 0). With
        `positions` (`positions.Positions`): [S, R, C], the sum kept apart per position class."""
        if self.task.metric_name == "kl":
            raise ValueError(EAP_KL)
        return self._attribution(1, lambda k: None, positions)

    def eap_ig(self, steps: int = 5, on: str = "inputs", positions=None, points: str = "midpoint") -> Tensor:
        """EAP-IG edge scores [S, R] with `steps` points between the corrupted (0) and the clean run (1), on the
        embeddings (`on="inputs"`) or on every receiver's input at once (`"activations"`); [S, R, C] with
        `positions`, as `eap`. `points`: "midpoint", (k + 1/2) / steps (the integral's midpoint rule), or
        "left", k / steps from the corrupted run (hannamw/EAP-IG's own points: its scores, to round-off). The
        points are made one at a time; at most `MAX_STEPS`."""
        if on not in IG_ON:
            raise ValueError(f"EAP-IG interpolates 'inputs' or 'activations', got {on!r}")
        refused = steps_refused(steps)
        if refused is not None:
            raise ValueError(refused)
        if points not in IG_POINTS:
            raise ValueError(f"EAP-IG's points are {' or '.join(map(repr, IG_POINTS))}, got {points!r}")
        offset = 0.5 if points == "midpoint" else 0.0
        return self._attribution(steps, lambda k: ((k + offset) / steps, on), positions)

    def _attribution(self, n_points: int, point: Callable[[int], object], positions=None) -> Tensor:
        """The scores averaged over `n_points` points, `point(k)` each (None: EAP's clean run; (alpha, on): an
        EAP-IG point), chunk by chunk (the held chunks first)."""
        g, model = self.graph, self.model
        extra = () if positions is None else (positions.n_classes,)
        scores = torch.zeros(len(g.senders), len(g.receivers), *extra, dtype=torch.float64)
        jobs = ((i, k) for i in self._order() for k in range(n_points))
        held: tuple = (None, None)  # (chunk, its senders' differences): formed once for all of its points
        with frozen_params(model), graph_mode(model):
            for i, k in progress(jobs, total=len(self.chunks) * n_points, desc="attribution",
                                 enabled=self.show_progress):
                part, answers = self.chunks[i]
                if self.layered:  # block by block, contracted as each block's gradients come
                    layered_attribution(self, i, point(k), scores, 1 / n_points, positions)
                    continue
                grads = self._gradients(i, part, answers, point(k))
                if held[0] != i:
                    held = (None, None)  # the last chunk's differences freed before this one's are formed
                    held = (i, self._differences(i))
                if positions is not None:  # [S, b, p, d] . [R, b, p, d] summed per class: [S, R, C]
                    part_scores = positions.contract(part, held[1], grads)
                else:
                    diff = held[1].flatten(1).float()  # [S, b*p*d]
                    part_scores = diff @ grads.flatten(1).float().T
                scores += to_host(part_scores).double() / n_points
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
            c = self._chunk(i)
            clean0, corrupt0 = c["clean"][1][0], c["corrupted"][1][0]
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

        p = _Pass(model, g, receive, embed=embed, features=False)  # reads no sender's value
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
        key, c = f"{which}_inputs", self._chunk(i)
        if key not in c:
            inputs = {}

            def receive(group, x, values):
                inputs[group] = x.detach()
                return x

            part = self.chunks[i][0]
            tokens = (self.task.clean if which == "clean" else self.task.corrupted)[part]
            p = _Pass(self.model, self.graph, receive, features=False)
            with torch.no_grad(), graph_mode(self.model), self.model.hooks(p.hooks()):
                self.model(tokens.to(self.model.device), stop_at_layer=self.graph.n_layers)
            c[key] = inputs
        return c[key]

    def patch_edges(self, edges: Sequence[tuple[int, int]] | None = None) -> Tensor:
        """Exact edge patching: [S, R] with metric(edge s -> r patched) - metric(clean) for each edge
        (default every edge: one run each, resumed at the receiver's layer), chunk by chunk."""
        g = self.graph
        if edges is None:
            s, r = g.edges()
            edges = list(zip(s.tolist(), r.tolist()))
        edges = [(s, r) for s, r in edges if g.allowed[s, r]]  # the rest are not edges: 0

        def job(s: int, r: int):
            def patching(i, part, source):  # its mask made when it runs, not held for every edge
                mask = torch.zeros(len(g.senders), len(g.receivers))
                mask[s, r] = 1
                return _Patching(g, mask, source)
            return patching, g.receiver_layer[r]

        values = self._patched_runs([job(s, r) for s, r in edges], self.show_progress, "patching edges")
        out = torch.zeros(len(g.senders), len(g.receivers))
        for (s, r), value in zip(edges, values):
            out[s, r] = value - self.clean_metric
        return out

    def patch_nodes(self, senders: Sequence[int] | None = None) -> Tensor:
        """Exact node patching: [S] with metric(every edge out of s patched) - metric(clean) for each sender in
        `senders` (default all; the others 0). Patched where the
        sender writes (its value in the stream swapped for the corrupted one: nothing below it has changed, so
        every reader gets exactly what the edges' mask would give), resumed at its layer, on the fused path;
        chunk by chunk."""
        g, model, L = self.graph, self.model, self.graph.n_layers
        out = torch.zeros(len(g.senders))
        todo = list(range(len(g.senders)) if senders is None else senders)
        sums = [[0.0] * len(self.chunks) for _ in todo]
        steps = [(i, j) for i in self._order() for j in range(len(todo))]
        with torch.no_grad():
            for i, j in progress(steps, desc="patching nodes", enabled=self.show_progress):
                s, (part, answers) = todo[j], self.chunks[i]
                change = self._differences(i, s, s + 1)[0]
                resid = self._chunk(i)["clean"][1]
                add = lambda x, hook: x + change.to(x.dtype)  # noqa: E731
                start, point = max(0, g.sender_layer[s]), g.writes_at[s]  # where its value joins the stream
                with model.hooks([(point, add)]):
                    final = model(resid[start], start_at_layer=start, stop_at_layer=L)
                sums[j][i] = float(_final(model, final, self.task, answers, part.start).double().sum())
        for s, row in zip(todo, sums):
            total = 0.0
            for value in row:  # in the chunks' order
                total += value
            out[s] = total / self.task.n_answers - self.clean_metric
        return out

    def faithfulness(self, circuit: Tensor) -> float:
        """(metric(circuit) - metric(corrupted)) / (metric(model) - metric(corrupted)), with every edge
        outside the bool [S, R] `circuit` patched from the corrupted run: 1 is the model, 0 the corrupted run."""
        return self.faithfulness_many([circuit])[0]

    def faithfulness_many(self, circuits: Sequence[Tensor], *, show_progress: bool | None = False) -> list[float]:
        """`faithfulness` of each circuit, their patched runs chunk by chunk (`patched_many`). A circuit among the
        last `MEMO` asked is not run again: its faithfulness is remembered (the circuit a report draws is one of
        its curve's). Block by block (long prompts), a circuit of no edge is not run: with every edge patched from
        the corrupted run, every receiver reads the corrupted run's input, so its faithfulness is 0 by definition
        (the whole graph's runs it, a check of the patching that costs one short run)."""
        keys = [hashlib.blake2b(to_numpy(c.bool()).tobytes(), digest_size=16).digest() for c in circuits]
        if self.layered:
            for k, c in zip(keys, circuits):
                if not bool(c.any()):
                    self._memo.setdefault(k, 0.0)
        new = list(dict.fromkeys(k for k in keys if k not in self._memo))
        at = {k: i for i, k in enumerate(keys)}
        masks = [(~circuits[at[k]].bool()) & self.graph.allowed for k in new]
        values = self.patched_many(masks, show_progress=show_progress, desc="faithfulness") if masks else []
        found = {k: self._memo[k] for k in keys if k in self._memo}
        found.update({k: (v - self.corrupted_metric) / (self.clean_metric - self.corrupted_metric)
                      for k, v in zip(new, values)})
        for k, value in found.items():  # the most recently asked last
            self._memo.pop(k, None)
            self._memo[k] = value
        while len(self._memo) > MEMO:
            self._memo.pop(next(iter(self._memo)))
        return [found[k] for k in keys]


def _keeper(store: dict, l: int):
    def hook(x, hook):
        store[l] = x.detach()
        return x
    return hook


def faithfulness_curve(runner: Runner, scores: Tensor, fractions: Sequence[float] = FRACTIONS, how: str = "top",
                       show_progress: bool | None = None) -> pd.DataFrame:
    """Faithfulness of the circuits of each size: `fraction` of the graph's edges chosen (`select`),
    `edges` kept after pruning, `faithfulness` (see `Runner.faithfulness`), their patched runs chunk by chunk
    (`Runner.faithfulness_many`: the faithfulness of one of these circuits asked again costs nothing)."""
    g, circuits = runner.graph, []
    for f in fractions:
        n = int(round(f * g.n_edges)) if f < 1 else g.n_edges
        circuits.append(select(g, scores, max(n, 1) if f > 0 else 0, how))
    values = runner.faithfulness_many(circuits, show_progress=show_progress)
    return pd.DataFrame([{"fraction": float(f), "edges": int(c.sum()), "faithfulness": v}
                         for f, c, v in zip(fractions, circuits, values)])
