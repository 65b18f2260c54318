"""`CircuitStudy` (`interp circuit`): which heads and edges carry a task's behaviour, scored by exact
patching, EAP or EAP-IG (`graph.py`, `runner.py`), circuits chosen at MIB's sizes and judged by faithfulness, the
circuit's overlap with the atlas's induction and duplicate-token heads, and a report that draws it.

    from interp.analyses.circuits.study import CircuitSettings, CircuitStudy
    from interp.analyses.study import run
    run(CircuitStudy(), model, "out/ioi", CircuitSettings(model="smollm2-135m", task="ioi", method="eap-ig"))

Writes edges.parquet (sender, receiver, input, score, method; `exact` with --oracle edges), nodes.parquet
(node, layer, head, kind, score, method, in_circuit; `exact` with an oracle), faithfulness.csv (fraction,
edges, faithfulness), settings.json and the report. With `qk` (`--qk 1.0,L1H2`): qk.parquet (head, query_sender,
key_sender, mean_term, mean_abs_term, mean_contrast, mean_delta, mean_weight_change: each sender pair's share of the
head's score from the answer position, `qk.qk_attribution`) and a report section per head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from interp.models.placement.device import to_numpy
from interp.models.placement.memory import FIXED_BYTES, GiB, available_bytes, held_weight_bytes
from interp.models.readouts.head_statistics import attention_rows, for_each_layer_qk, layer_scoring
from interp.models.rope.choice import choose as choose_rope
from interp.models.saes.formats import load_sae
from interp.errors import as_user_errors

from .._common import spearman
from .graph import IG_ON, METHODS, SELECTIONS, Graph, Task, areas, curve_fractions, select
from .positions import check_mode as check_positions, measure as measure_positions, positions_for
from .positions import record as position_record
from .head_names import parse_head, parse_heads
from .qk import check_model
from .cost import PATTERN_MAX, duration, estimate, machine_flops
from .features import check_saes, sae_config
from .runner import IG_POINTS, LAYERED_ABOVE, Runner, faithfulness_curve, steps_refused
from .passkey import passkey_task
from .report import GOOD, _top, sections as report_sections
from .tasks import METRICS, TASKS, build_task, context, read_task_file
from ..document import Section
from ..heads import induction_scores
from ..study import Measured, Study, StudySettings, Table

ALL_TASKS = TASKS + ("passkey",)
DEFAULT_PASSKEY, MIN_PASSKEY = 1024, 128  # the passkey task's prompt length in tokens: default, shortest
# exact edge patching is one forward per edge: past this many edges it is refused (with the way round)
MAX_PATCHED_EDGES = 20_000
PATTERN_KEYS, PATTERN_TAIL = 8, 16  # a long prompt's pattern view (past cost.PATTERN_MAX positions): `_patterns`
ROLE_TOP = 3  # the atlas's heads of a role: the top 3 by its score (as the KV precision study names them)


@dataclass(frozen=True, kw_only=True, eq=False)
class CircuitSettings(StudySettings):
    """task     "ioi", "induction", "greater-than", or a JSON-lines file (`tasks.read_task_file`)
    method   "patching" (exact, one run per edge), "eap", "eap-ig"
    steps    EAP-IG's interpolation points; ig: "inputs" (the embeddings) or "activations"; ig_points:
             "midpoint" ((k + 1/2) / steps) or "left" (k / steps, hannamw/EAP-IG's)
    metric   None: the task's own (logit-diff; prob-diff for greater-than; loss for a file without wrong answers)
    prompts  None: the task's default (64)
    select   "top" (the n edges of largest |score|) or "greedy" (grown from the logits); dangling edges pruned
    size     the fraction of edges in the circuit the report draws and names; None (the default): the smallest
             of MIB's sizes whose faithfulness reaches `GOOD` (0.8), else 5%
    oracle   "none", "nodes" (exact node patching: one run per node), "edges" (exact edge patching), to
             report how the fast scores agree (Spearman of |score| ranks)
    qk       None, or heads ("1.0,L1H2", or ((1, 0), (1, 2)), the form `check` returns): decompose each one's scores from the answer position into sender
             pairs (`qk.qk_attribution`), at the `qk_keys` keys it attends to most
    positions "none", or edges resolved by position (`positions`): "each" (a class per position), "classes"
             (the task's named positions: IOI's S1, S2, IO, END, other) or some class names ("S2,END"); scored
             by the same method, with a faithfulness curve beside the plain one
    length   the passkey task's prompt length in tokens (default 1024; `passkey.passkey_task`); EAP and EAP-IG go
             block by block past ~500 tokens (`layered`), in memory that grows with the length, not its square; at
             most the model's context, or what the RoPE scaling it runs with gives (`tasks.context`)
    rope_scaling the command's --rope-scaling (any spelling of `interp.models.rope.choice`), which the model is
             loaded with: `check` reads the passkey length against the context it gives (None: the model's own)
    sae      None, or SAEs by path or name (`interp.load_sae`'s; "a,b" or a tuple, the form `check` returns) on
             components' outputs (attn.hook_z, hook_attn_out, hook_mlp_out): their features and errors replace those
             components' senders (`features`); on the residual stream (hook_resid_pre / mid / post, one at most): its
             features and error cut the stream (`cut`); the features that fire on none of the prompts are left out. A
             residual-stream SAE at the stream a `qk` head's layer L reads (blocks.L.hook_resid_pre, or
             blocks.L-1.hook_resid_post) serves `qk` instead: layer L's heads' scores are split in its features
             (`qk_features`), and it is no node of the graph"""

    task: str = "ioi"
    method: str = "eap-ig"
    steps: int = 5
    ig: str = "inputs"
    ig_points: str = "midpoint"
    metric: str | None = None
    prompts: int | None = None
    seed: int = 0
    batch_size: int = 16
    select: str = "top"
    size: float | None = None
    oracle: str = "none"
    qk: str | tuple[tuple[int, int], ...] | None = None
    qk_keys: int = 3
    positions: str = "none"
    length: int | None = None
    rope_scaling: str | dict | None = None
    sae: str | tuple[str, ...] | None = None


def _heads(qk, cfg) -> list[tuple[int, int]]:
    """The --qk heads: as `check` returned them, or parsed here for a caller of `run` who skipped `check`."""
    if qk is None:
        return []
    return parse_heads(qk, cfg) if isinstance(qk, str) else [parse_head(h, cfg) for h in qk]


def chosen_size(curve: pd.DataFrame) -> float:
    """The smallest fraction on the curve (short of the whole model) whose faithfulness reaches `GOOD`, else 5%."""
    good = curve[(curve.fraction > 0) & (curve.fraction < 1) & (curve.faithfulness >= GOOD)]
    return float(good.fraction.min()) if not good.empty else 0.05


def _edge_cost_line(n_edges: int) -> str:
    return (f"exact edge patching is one forward per edge, and this model's graph has {n_edges:,} edges (at most "
            f"{MAX_PATCHED_EDGES:,}): use --method eap-ig (--oracle nodes checks it against exact node patching)")


@dataclass(frozen=True, kw_only=True, eq=False)
class CircuitMeasured(Measured):
    """Beside the tables: the task and its runner (clean and corrupted metrics), the graph and its scores
    [senders, receivers], the circuit drawn (a boolean [senders, receivers]) with its faithfulness and size
    (a fraction of the edges), the atlas's heads by role, the heads that write the answer (None: the task has
    no answer token), the circuit's heads' patterns on the first clean prompt ((names, [n, p, p], tokens) or
    None) and the agreement with exact patching ({"nodes" | "edges": Spearman})."""

    task: Task
    runner: Runner
    graph: Graph
    scores: torch.Tensor
    circuit: torch.Tensor
    drawn: float
    size: float
    roles: dict[str, list[dict]]
    movers: pd.DataFrame | None
    patterns: tuple[list[str], np.ndarray, list[str]] | None
    agreement: dict[str, float]
    qk: list = ()  # QKAttribution per head asked for (--qk)
    positions: tuple = ()  # with --positions: (Positions, positions.measure's dict)


def _check_passkey_length(cfg, s: CircuitSettings) -> None:
    """--length against the context the model reads: n_ctx, or what the chosen --rope-scaling gives (factor f on
    an original length L: f * L, `tasks.context`), as `interp extrapolate` reads a rotary model past n_ctx."""
    scaled = cfg if s.rope_scaling is None else cfg.replace(rope_scaling=choose_rope(cfg, s.rope_scaling))
    longest, length = context(scaled), s.length or DEFAULT_PASSKEY
    if MIN_PASSKEY <= length <= longest:
        return
    flag = f"--length {length}" + (" (the default)" if s.length is None else "")
    if longest > cfg.n_ctx:
        scaling = scaled.rope_scaling
        of = f"{scaling.factor:g} x {scaling.original_max_position or cfg.n_ctx:,}"
        raise ValueError(f"{flag}: the passkey prompts need {MIN_PASSKEY} .. {longest:,} tokens (the context "
                         f"--rope-scaling {s.rope_scaling} gives this model: {of})")
    way = (f"; a --rope-scaling such as yarn:{-(-length // cfg.n_ctx)} stretches a rotary model's"
           if length > cfg.n_ctx and cfg.positional == "rotary" else "")
    raise ValueError(f"{flag}: the passkey prompts need {MIN_PASSKEY} .. {longest:,} tokens (the model's context"
                     f"{way})")


def _task(model, s: CircuitSettings) -> Task:
    if s.task == "passkey":
        return passkey_task(model, s.length or DEFAULT_PASSKEY, s.prompts or 2, seed=s.seed,
                            metric=s.metric or "logit-diff")
    return build_task(model, s.task, n_prompts=s.prompts, seed=s.seed, metric=s.metric)


def check_memory(model, task: Task, batch_size: int, available: int | None = None, *, method: str = "eap-ig",
                 steps: int = 5, ig: str = "inputs", oracle: str = "none", graph: Graph | None = None) -> str:
    """Before any run: refuse, in one line, EAP-IG steps past `runner.MAX_STEPS`, and a task whose stages' peak
    memory (`cost.estimate`: the runs held, and each stage's working set) would not fit beside the model on its
    device, naming the most prompts that fit (the whole graph) or the longest prompts (block by block, where a
    prompt's runs are held at a time); else the estimate's line: memory and time (`cost.CircuitCost.line`).
    `graph`: the graph the runs make (default the model's head graph; with SAEs, every feature a node)."""
    cfg = model.cfg
    graph = Graph(cfg) if graph is None else graph
    n, positions = int(task.clean.shape[0]), int(task.clean.shape[1])
    element = next(model.parameters()).element_size()
    fixed = FIXED_BYTES + held_weight_bytes(cfg, element, getattr(model.offload, "kind", None))
    flops = machine_flops(cfg, model.device)

    def cost(n: int, positions: int):
        return estimate(cfg, n, positions, batch_size, method=method, steps=steps, ig=ig, oracle=oracle,
                        element_size=element, flops=flops, graph=graph)

    found = cost(n, positions)
    if method == "eap-ig" and (refused := steps_refused(steps)) is not None:
        raise ValueError(f"{refused}; these would take about {duration(found.seconds['eap-ig'])} here")
    available = available_bytes(model.device) if available is None else available
    if available is None or fixed + found.peak <= available:
        return found.line(fixed)
    needed = fixed + found.peak
    where = "this machine's" if torch.device(model.device).type == "cpu" else f"{model.device}'s"
    fits = lambda found: fixed + found.peak <= available  # noqa: E731
    if found.held < found.chunks or cost(1, positions).peak == found.peak:  # more prompts cost no more memory
        low = _most(positions, lambda p: fits(cost(n, p)))  # the longest prompts that fit
        raise ValueError(f"prompts of {positions} tokens: about {needed / GiB:.1f} GiB needed (its peak in "
                         f"{found.peak_stage}, {found.held * found.per_chunk} prompt(s)' runs held at a time: "
                         f"{len(graph.senders)} senders at every position), more than {where} "
                         f"{available / GiB:.1f} GiB free; prompts of at most about {low:,} tokens fit")
    low = _most(n, lambda k: fits(cost(k, positions)))  # the most prompts that fit
    raise ValueError(f"--prompts {n}: about {needed / GiB:.1f} GiB needed for {n} prompts of {positions} tokens (its "
                     f"peak in {found.peak_stage}: the clean and corrupted runs, {len(graph.senders)} senders "
                     f"cached at every position), more than {where} {available / GiB:.1f} GiB free; at most about "
                     f"{low:,} prompts fit (--prompts)")


def _most(high: int, fits) -> int:
    """The largest k in 0..high with fits(k) (fits: true up to some k, false past it), by bisection."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _check_saes(cfg, s: CircuitSettings) -> CircuitSettings:
    """--sae: each SAE's config read (no weight) and checked against the model's and each other's (one line each,
    `features.check_saes`); the names as a tuple. A residual-stream SAE at the stream a --qk head's layer reads
    serves --qk: that layer's heads are split in its features (`qk_features`), the graph is left as it is; any other
    SAE (a residual one too: a cut of the stream, `cut`) becomes nodes of the graph."""
    names = _sae_names(s.sae)
    if not names:
        return replace(s, sae=None)
    configs = [(n, sae_config(n)) for n in names]
    qk_layers = {l for l, _ in _heads(s.qk, cfg)}
    stream = [(n, c) for n, c in configs if _serves_qk(c.hook_name, cfg, qk_layers)]
    served: dict[int, str] = {}
    for n, c in stream:
        layer = _stream_layer(c.hook_name, cfg)
        if layer in served:
            raise ValueError(f"--sae {served[layer]} and {n} are both at the stream layer {layer}'s heads read: give one")
        if c.d_in != cfg.d_model:
            raise ValueError(f"the SAE at {c.hook_name} reads d_in={c.d_in}, but the residual stream has width "
                             f"d_model={cfg.d_model}: it was trained on another model")
        served[layer] = n
    graph = [c for n, c in configs if not _serves_qk(c.hook_name, cfg, qk_layers)]
    check_saes(cfg, graph)
    cut = next((c for c in graph if ".hook_resid_" in c.hook_name), None)
    if cut is not None and s.task == "passkey":  # long prompts: with every feature a receiver, block by block?
        receivers, batch = len(Graph(cfg).receivers) + cut.d_sae + 1, min(s.batch_size, s.prompts or 2)
        if receivers * batch * (s.length or DEFAULT_PASSKEY) * cfg.d_model * 4 > LAYERED_ABOVE:  # `goes_by_layer`'s
            raise ValueError(f"--sae: the SAE at {cut.hook_name} cuts the residual stream, which the passkey task's "
                             "long prompts (attributed block by block) do not take: give a shorter --length, or an "
                             "SAE on hook_z, hook_attn_out or hook_mlp_out")
    return replace(s, sae=names)


def _serves_qk(hook: str, cfg, qk_layers) -> bool:
    """Whether an SAE at `hook` serves --qk: a residual-stream SAE at the stream a --qk head's layer reads."""
    return _stream_layer(hook, cfg) in qk_layers


def _stream_layer(hook: str, cfg) -> int | None:
    """The layer whose heads read the residual stream at `hook` (blocks.L.hook_resid_pre: L; blocks.L.hook_resid_post:
    L + 1, where there is one); None for any other hook."""
    parts = (hook or "").split(".")
    if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    layer = int(parts[1]) + (parts[2] == "hook_resid_post")
    return layer if parts[2] in ("hook_resid_pre", "hook_resid_post") and layer < cfg.n_layers else None


def _sae_names(sae) -> tuple[str, ...]:
    if sae is None:
        return ()
    return tuple(n.strip() for n in (sae.split(",") if isinstance(sae, str) else sae) if n.strip())


def _setup(model, s: CircuitSettings, stage) -> tuple:
    """(task, position classes or None, runner, QK attributions): the task built, the SAEs read, the memory and
    the exact patching's edges checked, the clean and corrupted runs made."""
    with as_user_errors(ValueError, NotImplementedError):
        heads = _heads(s.qk, model.cfg)
        if heads:
            check_model(model)
        task = stage("task", lambda: _task(model, s))
        pos = positions_for(task, s.positions)
        loaded = [load_sae(n, device=model.device) for n in _sae_names(s.sae)]
        qk_layers = {l for l, _ in heads}
        by_layer = {_stream_layer(sae.cfg.hook_name, model.cfg): sae for sae in loaded  # --qk's, by the layer it serves
                    if _serves_qk(sae.cfg.hook_name, model.cfg, qk_layers)}
        saes = [sae for sae in loaded if not _serves_qk(sae.cfg.hook_name, model.cfg, qk_layers)]
        if saes:
            check_saes(model.cfg, [sae.cfg for sae in saes])
        every = Graph(model.cfg, saes)  # every feature a node: the most the runs can hold
        classes = pos.n_classes if pos is not None and s.method == "patching" else 1
        if pos is not None and s.method == "patching" and every.n_edges * classes > MAX_PATCHED_EDGES and not saes:
            raise ValueError(_edge_cost_line(every.n_edges * classes))
        print("circuit: " + check_memory(model, task, s.batch_size, method=s.method, steps=s.steps, ig=s.ig,
                                         oracle=s.oracle, graph=every))
        runner = stage("clean and corrupted", lambda: Runner(model, task, batch_size=s.batch_size,
                                                             show_progress=s.progress, saes=saes))
        patched = runner.graph.n_edges * classes  # with SAEs, known once the features that fire are
        if saes and (s.method == "patching" or s.oracle == "edges") and patched > MAX_PATCHED_EDGES:
            raise ValueError(_edge_cost_line(patched) + " (with the SAEs' features that fire on the prompts)")
        qk = [stage(f"qk L{l}H{h}", lambda l=l, h=h: runner.qk_attribution((l, h), top_keys=s.qk_keys,
                                                                           sae=by_layer.get(l)))
              for l, h in heads]
    if (note := _qk_keys_note(qk, s.qk_keys)) is not None:
        print(note)
    return task, pos, runner, qk


class CircuitStudy(Study):
    name, title = "circuit", "Circuit"
    one_device = "its runner stacks and patches every layer's node values on one device"
    tables = (Table("edges", ("sender", "receiver", "input", "score", "method")),
              Table("nodes", ("node", "layer", "head", "kind", "score", "method", "in_circuit")),
              Table("faithfulness", ("fraction", "edges", "faithfulness"), csv=True),
              Table("qk", ("head", "query_sender", "key_sender", "mean_term", "mean_abs_term", "mean_contrast"),
                    optional=True),
              Table("position_edges", ("sender", "receiver", "input", "position", "score"), optional=True),
              Table("position_faithfulness", ("fraction", "edges", "faithfulness"), optional=True, csv=True))

    def check(self, cfg, s: CircuitSettings):
        if s.task not in ALL_TASKS:
            if not Path(s.task).suffix and not Path(s.task).exists():
                raise ValueError(f"unknown task {s.task!r}: choose one of {', '.join(ALL_TASKS)}, or give a JSON-lines "
                                 "file")
            read_task_file(s.task)
        if s.length is not None and s.task != "passkey":
            raise ValueError(f"--length sets the passkey task's prompt length; the {s.task!r} task sets its own")
        if s.task == "passkey":
            _check_passkey_length(cfg, s)
        if s.method not in METHODS:
            raise ValueError(f"unknown method {s.method!r}: choose one of {', '.join(METHODS)}")
        if s.offload is not None and s.method in ("eap", "eap-ig"):
            raise ValueError(f"--offload {s.offload} with --method {s.method}: {s.method.upper()} takes gradients "
                             "through every layer, and an offloaded model gives none (autograd would hold every "
                             "layer's weights): use --method patching (forward passes only), or run without --offload")
        if s.ig not in IG_ON:
            raise ValueError(f"--ig must be one of {', '.join(IG_ON)}, got {s.ig!r}")
        if s.ig_points not in IG_POINTS:
            raise ValueError(f"--ig-points must be one of {', '.join(IG_POINTS)}, got {s.ig_points!r}")
        if s.metric is not None and s.metric not in METRICS:
            raise ValueError(f"unknown metric {s.metric!r}: choose one of {', '.join(METRICS)}")
        if s.select not in SELECTIONS:
            raise ValueError(f"unknown selection {s.select!r}: choose one of {', '.join(SELECTIONS)}")
        if s.oracle not in ("none", "nodes", "edges"):
            raise ValueError(f"--oracle must be none, nodes or edges, got {s.oracle!r}")
        for name, value, low in (("--steps", s.steps, 1), ("--batch-size", s.batch_size, 1),
                                 ("--prompts", s.prompts if s.prompts is not None else 1, 1)):
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if isinstance(s.qk, str):  # parsed here, once: `measure` reads the heads `check` returns
            s = replace(s, qk=tuple(parse_heads(s.qk, cfg)))
        if s.qk_keys < 1:
            raise ValueError(f"--qk-keys must be at least 1, got {s.qk_keys}")
        check_positions(s.task, s.positions)
        if s.size is not None and not 0 < s.size <= 1:
            raise ValueError(f"--size is a fraction of the edges in (0, 1], got {s.size}")
        s = _check_saes(cfg, s)
        n_edges = Graph(cfg).n_edges  # with SAEs, counted again once the features that fire are known (`_setup`)
        if (s.method == "patching" or s.oracle == "edges") and n_edges > MAX_PATCHED_EDGES:
            raise ValueError(_edge_cost_line(n_edges))
        return s, []

    def measure(self, model, s: CircuitSettings, stage):
        task, pos, runner, qk = _setup(model, s, stage)
        g = runner.graph
        if s.method == "patching":
            scores = stage("patching", runner.patch_edges)
        elif s.method == "eap":
            scores = stage("eap", runner.eap)
        else:
            scores = stage("eap-ig", lambda: runner.eap_ig(s.steps, s.ig, points=s.ig_points))
        method = s.method if s.method != "eap-ig" else f"eap-ig ({s.ig}, {s.steps} {s.ig_points} steps)"
        edges = g.edge_frame(scores).assign(method=method)
        node_scores = scores.sum(1) if s.method != "patching" else None
        exact_nodes = exact_edges = None
        if s.oracle == "nodes" or s.method == "patching":
            exact_nodes = stage("exact nodes", runner.patch_nodes)
        if s.oracle == "edges":
            exact_edges = scores if s.method == "patching" else stage("exact edges", runner.patch_edges)
            edges["exact"] = g.edge_frame(exact_edges)["score"]
        if node_scores is None:
            node_scores = exact_nodes
        fractions = curve_fractions(runner.layered)
        curve = stage("faithfulness", lambda: faithfulness_curve(runner, scores, fractions, s.select, s.progress))
        size = s.size if s.size is not None else chosen_size(curve)
        circuit = select(g, scores, max(1, int(round(size * g.n_edges))), s.select)
        drawn = runner.faithfulness(circuit)
        nodes = _node_frame(g, node_scores, method, circuit)
        if exact_nodes is not None:
            nodes["exact"] = to_numpy(exact_nodes, np.float64)
        s_edges, r_edges = g.edges()
        agreement = {}
        if exact_nodes is not None and s.method != "patching":
            agreement["nodes"] = spearman(node_scores.abs(), exact_nodes.abs())
        if exact_edges is not None and s.method != "patching":
            agreement["edges"] = spearman(scores[s_edges, r_edges].abs(), exact_edges[s_edges, r_edges].abs())
        tables = {"edges": edges, "nodes": nodes, "faithfulness": curve}
        by_position = ()
        if pos is not None:
            measured = stage("positions", lambda: measure_positions(runner, pos, s.method, s.steps, s.ig, fractions,
                                                                    s.progress, points=s.ig_points))
            tables["position_edges"], tables["position_faithfulness"] = measured["edges"], measured["curve"]
            by_position = (pos, measured)
        runner.release()  # the last stage that patches is done: the report's forwards run without the held runs
        roles = stage("roles", lambda: _roles(model))
        movers = stage("movers", lambda: _movers(model, task, edges))
        shown = pd.concat([nodes[nodes.in_circuit & (nodes.kind == "head")], _read_heads(g, edges, circuit)],
                          ignore_index=True)
        patterns = stage("patterns", lambda: _patterns(model, task, shown))
        if qk:
            tables["qk"] = pd.concat([r.pairs().assign(head=r.name) for r in qk], ignore_index=True)[
                ["head", *qk[0].pairs().columns]]
        self.written = tuple(tables)
        return CircuitMeasured(tables=tables, task=task, runner=runner, graph=g, scores=scores, circuit=circuit,
                               drawn=drawn, size=size, roles=roles, movers=movers, patterns=patterns,
                               agreement=agreement, qk=qk, positions=by_position)

    def record(self, s: CircuitSettings, m: CircuitMeasured) -> dict:
        task, runner, curve = m.task, m.runner, m["faithfulness"]
        circuit = m.circuit
        heads = m["nodes"][m["nodes"].in_circuit & (m["nodes"].kind == "head")]["node"].tolist()
        features = m["nodes"][m["nodes"].in_circuit & m["nodes"].kind.isin(("feature", "error"))]["node"].tolist()
        read = _read_heads(runner.graph, m["edges"], circuit)["node"].tolist()
        return {"task": s.task, "task_description": task.description, "metric": task.metric_name,
                "method": s.method, "steps": s.steps if s.method == "eap-ig" else None,
                "ig": s.ig if s.method == "eap-ig" else None,
                "ig_points": s.ig_points if s.method == "eap-ig" else None, "prompts": int(task.clean.shape[0]),
                "answers": task.n_answers, "seed": s.seed, "select": s.select, "oracle": s.oracle,
                "clean_metric": runner.clean_metric, "corrupted_metric": runner.corrupted_metric,
                "n_edges": runner.graph.n_edges, **areas(curve),
                "circuit": {"fraction": m.size, "chosen": s.size is None, "edges": int(circuit.sum()),
                            "faithfulness": m.drawn, "heads": heads,
                            **({"features": features, "read_heads": read} if runner.graph.saes else {})},
                "roles": {k: v for k, v in m.roles.items()},
                "movers": None if m.movers is None else m.movers.to_dict("records"),
                "agreement_spearman": m.agreement,
                "qk": [_qk_record(r, s.qk_keys) for r in m.qk] if m.qk else None,
                "saes": [_sae_record(n) for n in runner.graph.saes] or None,
                "positions": position_record(m.positions[0], s.positions, m.positions[1]) if m.positions else None}

    def sections(self, s: CircuitSettings, m: CircuitMeasured, record) -> list[Section]:
        return report_sections(s, m, record)

    written: tuple[str, ...] | None = None  # the tables the last `measure` made (set there)

    def files(self) -> str:
        """What `run` wrote (the command's last line): qk.* and position_*.* only when they were measured
        (--qk, --positions); before a run, the tables every run writes."""
        written = self.written
        names = [t.name for t in self.tables if (t.name in written if written is not None else not t.optional)]
        return ", ".join(["report.md", *(f"{n}.*" for n in names)])


# ---- measuring helpers -------------------------------------------------------------------------------
def _node_frame(g: Graph, scores, method: str, circuit) -> pd.DataFrame:
    # a node is in the circuit when it sends one of its edges or receives one into its own input (a query, an
    # MLP's input); a GQA key/value input read by several heads puts none of them in by itself
    in_circuit = circuit.any(1).clone()
    for r in circuit.any(0).nonzero().flatten().tolist():
        if len(g.receiver_senders[r]) == 1:
            in_circuit[g.receiver_senders[r]] = True
    rows = []
    for i, name in enumerate(g.senders):
        kind = g.sender_kind[i]
        head = int(name.split("H")[1]) if kind == "head" else -1
        row = {"node": name, "layer": g.sender_layer[i], "head": head, "kind": kind,
               "score": float(scores[i]), "method": method, "in_circuit": bool(in_circuit[i])}
        if g.saes:  # which SAE and feature (-1: not a feature; the error's hook is its SAE's)
            sae = g.sender_sae[i]
            row.update(feature=g.sender_feature[i], hook=g.saes[sae].hook_name if sae >= 0 else "")
        rows.append(row)
    return pd.DataFrame(rows)


def _read_heads(g: Graph, edges: pd.DataFrame, circuit) -> pd.DataFrame:
    """The heads of layers whose attention an SAE's features replace (no sender of their own) whose inputs the
    circuit feeds: node, layer, head, and score (the sum of |score| of the circuit's edges into them)."""
    if not any(n.component == "attn" for n in g.saes):
        return pd.DataFrame(columns=["node", "layer", "head", "score"])
    s_idx, r_idx = g.edges()
    into = edges[to_numpy(circuit[s_idx, r_idx])]
    replaced = {n.layer for n in g.saes if n.component == "attn"}
    rows = {}
    for r in into.itertuples():
        l = g.receiver_layer[g.receivers.index(r.receiver)]
        if l in replaced and r.receiver.startswith("L"):
            group = g.n_heads // g.n_kv if "KV" in r.receiver else 1  # a KV receiver feeds its group's heads
            first = int(r.receiver.rsplit("KV" if "KV" in r.receiver else "H", 1)[1]) * group
            for h in range(first, first + group):
                rows[(l, h)] = rows.get((l, h), 0.0) + abs(float(r.score))
    return pd.DataFrame([{"node": f"L{l}H{h}", "layer": l, "head": h, "score": v}
                         for (l, h), v in sorted(rows.items())], columns=["node", "layer", "head", "score"])


def _sae_record(nodes) -> dict:
    """An SAE spliced into the graph, for settings.json: where, what, and how many of its features are nodes."""
    c = nodes.sae.cfg
    return {"hook": c.hook_name, "source": c.source, "architecture": c.architecture, "d_in": c.d_in,
            "d_sae": c.d_sae, "k": c.k, "features": len(nodes.features), "left_out": c.d_sae - len(nodes.features),
            "error_node": nodes.names()[-1]}


def _roles(model) -> dict:
    """The atlas's induction and duplicate-token heads: the top `ROLE_TOP` by Olsson et al.'s scores on
    repeated random tokens (`heads.induction_scores`)."""

    frame = induction_scores(model, seq_len=50, batch_size=8)
    out = {}
    for kind, label in (("induction", "induction"), ("duplicate_token", "duplicate")):
        top = frame[frame.kind == kind].nlargest(ROLE_TOP, "score")
        out[label] = [{"head": f"L{int(r.layer)}H{int(r.head)}", "score": float(r.score)} for r in top.itertuples()]
    return out


def _movers(model, task, edges: pd.DataFrame, top: int = 5) -> pd.DataFrame | None:
    """The heads whose edges into the logits score most (|score|), and where they look from the answer
    position: their mean attention to the positions holding the answer's token and the wrong answer's
    (IOI's name movers attend to the indirect object; an induction head to the token it copies)."""
    if task.answer_tokens is None:
        return None
    into = edges[(edges.receiver == "logits") & edges.sender.str.match(r"L\d+H\d+$")]
    into = _top(into, top)
    heads = [tuple(int(x) for x in name[1:].split("H")) for name in into.sender]
    sums = {h: [0.0, 0.0] for h in heads}
    for part, answers in task.chunks(16):
        rows, pos = task.rows[answers] - part.start, task.positions[answers]
        tokens = task.clean[part].to(model.device)
        queries, which = torch.unique(pos, return_inverse=True)
        got = _pattern_rows(model, tokens, heads, queries)  # {layer: [b, head, queries, keys]}
        for l, h in heads:
            a = got[l][rows, h, which].cpu()  # [n, keys]: each answer position's attention
            on = tokens[rows].cpu()
            sums[(l, h)][0] += float((a * (on == task.answer_tokens[answers, None])).sum())
            if task.wrong_tokens is not None:
                sums[(l, h)][1] += float((a * (on == task.wrong_tokens[answers, None])).sum())
    n = task.n_answers
    return pd.DataFrame({"head": list(into.sender), "score_into_logits": into.score.to_numpy(),
                         "attention_to_answer": [sums[h][0] / n for h in heads],
                         "attention_to_wrong": [sums[h][1] / n if task.wrong_tokens is not None else float("nan")
                                                for h in heads]})


def _pattern_rows(model, tokens, heads, queries: torch.Tensor) -> dict:
    """{layer: the pattern's rows at `queries` (absolute positions), float32 [batch, head, len(queries), keys]}
    for the layers of `heads`, from one fused forward (`for_each_layer_qk`) and each layer's q and k
    (`attention_rows`): no layer's whole pattern is built (at 4,096 tokens one layer's would take GBs)."""
    got: dict[int, torch.Tensor] = {}

    def keep(l, q, k, v):
        got[l] = attention_rows(q, k, queries, layer_scoring(model, l))

    for_each_layer_qk(model, tokens, keep, layers={l for l, _ in heads})
    return got


def _patterns(model, task, heads: pd.DataFrame, limit: int = 24):
    """The circuit's heads' patterns on the task's first clean prompt (its real tokens): (names, [n, p, p],
    tokens). Past `PATTERN_MAX` positions, only the positions that matter are shown, rows and columns both:
    the keys each head attends to most from the answer position (`PATTERN_KEYS` each), the first token and
    the last `PATTERN_TAIL` (a 4,096-token prompt's full patterns would take GBs and show nothing)."""
    if heads.empty:
        return None
    heads = _top(heads, limit)
    pairs = [(int(r.layer), int(r.head)) for r in heads.itertuples()]
    answer = int(task.positions[task.rows == 0].max())
    n = answer + 1
    tokens = task.clean[:1, :n].to(model.device)
    qk: dict[int, tuple] = {}  # each layer's q and k of this one prompt (MBs): one forward, any rows after it
    for_each_layer_qk(model, tokens, lambda l, q, k, v: qk.__setitem__(l, (q, k)), layers={l for l, _ in pairs})
    rows = lambda at: {l: attention_rows(q, k, at, layer_scoring(model, l))[0] for l, (q, k) in qk.items()}  # noqa: E731
    shown = torch.arange(n)
    if n > PATTERN_MAX:
        answer_rows = rows(torch.tensor([answer]))  # [head, 1, key] per layer
        top = torch.stack([answer_rows[l][h, 0] for l, h in pairs]).cpu().topk(PATTERN_KEYS, dim=-1).indices
        shown = torch.unique(torch.cat([top.flatten(), torch.tensor([0]), torch.arange(n - PATTERN_TAIL, n)]))
    got = {l: p[:, :, shown.to(p.device)] for l, p in rows(shown).items()}
    stack = torch.stack([got[l][h] for l, h in pairs])
    try:
        strings = model.to_str_tokens(tokens[0])
    except Exception:  # no tokenizer: positions
        strings = [str(i) for i in range(n)]
    if n > PATTERN_MAX:
        strings = [f"{strings[i]} @{i}" for i in shown.tolist()]
    return list(heads.node), to_numpy(stack, np.float32), strings


# ---- QK attribution (--qk) -----------------------------------------------------------------------------------
def _qk_record(r, keys_asked: int) -> dict:
    fewest, most = r.keys_seen()
    at_keys = lambda t: [float(x) for x in r.mean_at_keys(t)]  # noqa: E731  (over the queries that have a k-th key)
    out = {"head": r.name, "kv_head": r.kv_head, "queries": int(r.terms.shape[0]), "keys_per_query": most,
           "fewest_keys_per_query": fewest, "keys_asked": keys_asked,
           "sae_hook": r.sae_hook, "softcapped": r.softcapped, "max_abs_error": r.max_error, "contrast_max_abs_error": r.contrast_max_error,
           "mean_weight_at_keys": at_keys(r.pattern), "mean_score_at_keys": at_keys(r.score)}
    if r.delta is not None:
        out.update(delta_max_abs_error=r.delta_max_error,
                   mean_weight_change_first_order=at_keys(r.weight_first_order),
                   mean_weight_change_true=at_keys(r.weight_true))
    return out


def _qk_keys_note(qk: list, asked: int) -> str | None:
    """One line when some head's queries see fewer keys than --qk-keys asks for: each such query is split at every
    key it sees (never at copies of one), and how many that is."""
    short = [(r.name, *r.keys_seen()) for r in qk if r.keys_seen()[0] < asked]
    if not short:
        return None
    seen = ", ".join(f"{name} {lo}" + (f" to {hi}" if hi != lo else "") for name, lo, hi in short)
    return (f"note: --qk-keys {asked} is more keys than some queries see ({seen} keys visible from the answer "
            "positions): each of those is split at every key it sees, once each (settings.json: qk keys_per_query, "
            "fewest_keys_per_query)")
