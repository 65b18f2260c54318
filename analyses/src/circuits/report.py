"""The report of `interp circuit` (`study.CircuitStudy.sections`): the summary, the circuit drawn (an SVG: layers
bottom to top, heads left to right, SAE features above their layer's heads), the faithfulness curve, the top edges,
nodes and SAE features, the heads that write the answer, the circuit's heads' patterns, the position-resolved curve,
and each --qk head's QK attribution."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import torch

from interp.models.placement.device import to_numpy

from .graph import Graph
from .positions import section as position_section
from ..document import Html, Section, number, png
from ..plots import text_colour

GOOD = 0.8  # the faithfulness a circuit drawn by default reaches, where one of MIB's sizes does


def sections(s, m, record) -> list[Section]:
    """The report's sections: `s` the study's settings (`study.CircuitSettings`), `m` what it measured
    (`study.CircuitMeasured`), `record` its settings.json record."""
    task, runner, curve, g = m.task, m.runner, m["faithfulness"], m.graph
    edges, nodes, circuit = m["edges"], m["nodes"], m.circuit
    c = record["circuit"]
    at = lambda f: curve.loc[(curve.fraction - f).abs().idxmin()]  # noqa: E731
    heads = c["heads"]
    summary = Section("summary", "Summary").add(
        f"Task: {task.description}. Metric: {task.metric_name}, the mean over {task.n_answers:,} answers of "
        f"{record['prompts']} prompts: {runner.clean_metric:.4g} on the clean prompts, {runner.corrupted_metric:.4g} "
        "on the corrupted ones.",
        f"Scores: {edges['method'].iloc[0]} over {g.n_edges:,} edges ({len(g.senders)} senders, {len(g.receivers)} "
        "receivers). Faithfulness is (metric of the circuit - corrupted) / (clean - corrupted), every edge outside "
        "the circuit patched from the corrupted run: 1 is the model's behaviour, 0 none of it.",
        f"Faithfulness at 1% of the edges: {at(0.01).faithfulness:.3f} ({int(at(0.01).edges)} edges after pruning); "
        f"at 5%: {at(0.05).faithfulness:.3f} ({int(at(0.05).edges)} edges). CPR (area under the curve) "
        f"{record['cpr']:.3f}, CMD (area under |1 - faithfulness|) {record['cmd']:.3f}.",
        f"The circuit drawn ({s.select} selection, {c['fraction']:.1%} of the edges"
        + (f": the smallest of the sizes above with faithfulness >= {GOOD}" if c["chosen"] and c["faithfulness"] >= GOOD
           else f": none of the sizes reaches faithfulness {GOOD}, so 5%" if c["chosen"] else "")
        + f", {c['edges']} after pruning, "
        f"faithfulness {c['faithfulness']:.3f}) holds {len(heads)} heads: {', '.join(heads[:30]) or 'none'}"
        + (" ..." if len(heads) > 30 else "")
        + (f"; and {len(c['features'])} SAE nodes: {', '.join(c['features'][:30]) or 'none'}"
           + (" ..." if len(c["features"]) > 30 else "") if "features" in c else "")
        + (f"; it feeds the inputs of {', '.join(c['read_heads'])}, whose outputs the SAE's features stand for"
           if c.get("read_heads") else "") + ".",
        *_sae_lines(record.get("saes")),
        _roles_line(record["roles"], set(heads) | set(c.get("read_heads") or ())),
        _agreement_line(record["agreement_spearman"]))
    sections = [summary,
                Section("circuit", "The circuit").add(Html(_svg(g, edges, circuit), "(drawing: open report.html)")),
                _curve_section(curve, runner.layered, int(task.clean.shape[1])),
                Section("edges", "Top edges").add(_top(edges, 25)),
                *([Section("movers", "The heads that write the answer").add(
                    "The heads whose edges into the logits score most, and their mean attention from the answer "
                    "position to the positions holding the answer's token and the wrong answer's (on the clean "
                    "prompts).", m.movers)] if m.movers is not None else []),
                Section("nodes", "Top nodes").add(_top(nodes.drop(columns=["method"]), 25)),
                *([_features_section(nodes, edges, g)] if record.get("saes") else [])]
    if m.patterns is not None:
        from interp.models.readouts.attention_view import pattern_view

        names, stack, strings = m.patterns
        view = pattern_view(strings, stack, head_names=names, title="the circuit's heads on the first clean prompt")
        sections.append(Section("patterns", "The circuit's heads: patterns").add(
            "Each head of the circuit on the first clean prompt (click a thumbnail; hover a token).",
            Html(view.fragment, "(interactive: open report.html)")))
    if m.positions:
        sections.append(position_section(curve, m.positions[1], record["positions"]))
    for r, rec in zip(m.qk, record.get("qk") or []):
        sections.append(_qk_section(r, rec, task, m.runner.model))
    return sections


def _sae_lines(saes: list | None) -> list[str]:
    """What the SAEs spliced into the graph are, and how many of their features are nodes."""
    if not saes:
        return []
    out = []
    for r in saes:
        what = "MLP" if r["hook"].endswith("hook_mlp_out") else "heads"
        left = (f"; the {r['left_out']:,} that never fire on the task's prompts (clean or corrupted) are left out as "
                f"nodes, what they would write joining {r['error_node']}" if r["left_out"] else "")
        k = f", k={r['k']}" if r["k"] else ""
        out.append(f"SAE spliced at {r['hook']} ({r['architecture']}{k}, {r['d_sae']:,} features, from "
                   f"{r['source'] or 'memory'}): in place of layer {r['hook'].split('.')[1]}'s {what}, "
                   f"{r['features']:,} features are nodes{left}; {r['error_node']} is what the SAE does not "
                   "reconstruct, so every receiver still reads exactly what the model computes.")
    return out


def _features_section(nodes: pd.DataFrame, edges: pd.DataFrame, g: Graph, n: int = 15) -> Section:
    """The SAE nodes that score most, each with its strongest edge and, for an SAE on attention's z, the head whose
    slice of its decoder row is largest (its share of the row's squared norm)."""
    top = _top(nodes[nodes.kind.isin(("feature", "error"))], n)
    strongest, heads = [], []
    by_hook = {sae.hook_name: sae for sae in g.saes}
    for r in top.itertuples():
        out = edges[edges.sender == r.node]
        best = out.loc[out.score.abs().idxmax()] if not out.empty else None
        strongest.append("" if best is None else f"-> {best.receiver} ({best.input}) {number(best.score)}")
        heads.append(_top_head(by_hook[r.hook], r.feature, g.n_heads) if r.feature >= 0 else "")
    frame = top[["node", "hook", "feature", "score", "in_circuit"]].assign(strongest_edge=strongest)
    if any(heads):
        frame = frame.assign(top_head=heads)
    return Section("features", "SAE features").add(
        "The features (and each SAE's error node) whose node scores most: a node's score is the sum of its edges' "
        "(EAP, EAP-IG) or every edge out of it patched at once (exact). `feature` is its row of W_dec; `top_head`, "
        "for an SAE on attention's z, the head whose slice of that row is largest, and its share of the row's "
        "squared norm.", frame)


def _top_head(nodes, feature: int, n_heads: int) -> str:
    """"L{l}H{h} (share)": the head of a z feature's largest decoder slice; "" for other sites."""
    if nodes.site != "z":
        return ""
    squared = nodes.sae.W_dec[feature].detach().float().reshape(n_heads, -1).square().sum(-1)
    h = int(squared.argmax())
    return f"L{nodes.layer}H{h} ({float(squared[h] / squared.sum().clamp(min=1e-30)):.2f})"


def _roles_line(roles: dict, heads: set) -> str:
    parts = []
    for label, top in roles.items():
        named = [f"{r['head']} ({r['score']:.2f}{', in' if r['head'] in heads else ', not in'})" for r in top]
        parts.append(f"{label}: {', '.join(named)}")
    return "The atlas's top heads by role (Olsson et al.'s scores on repeated random tokens) and the circuit: " + \
        "; ".join(parts) + "."


def _agreement_line(agreement: dict) -> str | None:
    if not agreement:
        return None
    return "Agreement with exact patching (Spearman of |score| ranks): " + ", ".join(
        f"{k} {v:.3f}" for k, v in agreement.items()) + "."


def _top(frame: pd.DataFrame, n: int) -> pd.DataFrame:
    return frame.reindex(frame.score.abs().sort_values(ascending=False).index).head(n)


def _curve_section(curve: pd.DataFrame, layered: bool = False, positions: int = 0) -> Section:
    import matplotlib  # start-up time: the command's --help and checks run without it

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    x = curve.fraction.clip(lower=1e-4)
    ax.plot(x, curve.faithfulness, marker="o")
    ax.set_xscale("log")
    ax.axhline(1, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("fraction of edges kept (0 drawn at 1e-4)")
    ax.set_ylabel("faithfulness")
    fig.tight_layout()
    sizes = ", ".join(f"{f:.0%}" for f in curve.fraction if 0 < f < 1)
    long = (f"At {positions:,} tokens the runner goes block by block, and each size is a patched run of every block "
            f"for every prompt: the curve is measured at {sizes} of the edges only (MIB's 10 sizes at short prompts), "
            "and 0 edges is the corrupted run by definition (faithfulness 0, not run); CPR and CMD are the areas "
            "under these points. --size draws a circuit of any other size." if layered else None)
    return Section("faithfulness", "Faithfulness over circuit sizes").add(
        long, png(fig, "faithfulness.png", "faithfulness of the circuit against its share of the edges"), curve)


def _svg(g: Graph, edges: pd.DataFrame, circuit, max_edges: int = 80) -> str:
    """The circuit as an SVG: layers bottom to top (embed below, logits above), heads left to right, the MLP
    at the right end of its layer; an edge's width is its |score|, blue positive, red negative; q edges
    solid, k dashed, v dotted. A node links to its pattern below."""
    H = g.n_heads
    s_idx, r_idx = g.edges()
    keep = to_numpy(circuit[s_idx, r_idx])
    chosen = edges[keep].copy()
    chosen = chosen.reindex(chosen.score.abs().sort_values(ascending=False).index).head(max_edges)
    if chosen.empty:
        return "<p>The circuit at this size holds no edge.</p>"
    dx, dy, pad = 56, 70 if g.saes else 46, 30  # SAE nodes sit half a row above their layer
    width = pad * 2 + dx * (H + 1)
    height = pad * 2 + dy * (g.n_layers + 1)

    kinds = dict(zip(g.senders, g.sender_kind))
    slots = _feature_slots(g, [n for n in chosen.sender.unique() if kinds.get(n) in ("feature", "error")])

    def where(name: str) -> tuple[float, float]:
        if name == "embed":
            return width / 2, height - pad
        if name == "logits":
            return width / 2, pad
        if name in slots:  # a feature or error: half a row above its layer, left to right as they come
            layer, col = slots[name]
            return pad + dx * col + dx / 2, height - pad - dy * (layer + 1.5)
        if name.startswith("MLP"):
            layer, col = int(name[3:]), H
        elif "KV" in name:
            layer, kv = name[1:].split("KV")
            layer, col = int(layer), int(kv) * (H // g.n_kv) + (H // g.n_kv - 1) / 2
        else:
            layer, head = name[1:].split("H")
            layer, col = int(layer), int(head)
        return pad + dx * col + dx / 2, height - pad - dy * (layer + 1)

    top = float(chosen.score.abs().max()) or 1.0
    lines, used = [], set()
    dash = {"q": "", "k": ' stroke-dasharray="6,3"', "v": ' stroke-dasharray="2,3"', "-": ""}
    for r in chosen.itertuples():
        (x1, y1), (x2, y2) = where(r.sender), where(r.receiver)
        x2 += {"q": -7, "k": 0, "v": 7}.get(r.input, 0)  # a head's three inputs side by side
        used.update((r.sender, r.receiver))
        color = "#2166ac" if r.score > 0 else "#b2182b"
        w = 0.6 + 4.4 * abs(r.score) / top
        tip = html.escape(f"{r.sender} -> {r.receiver} ({r.input}): {number(r.score)}")
        lines.append(f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}" '
                     f'stroke-width="{w:.2f}" stroke-opacity="0.7"{dash.get(r.input, "")}><title>{tip}</title></line>')
    dots = []
    for name in sorted(used):
        x, y = where(name)
        label = html.escape(name)
        head = name.startswith("L") and name not in slots
        shape = (f'<rect x="{x - 18:.0f}" y="{y - 9:.0f}" width="36" height="18" rx="3" fill="#fff" stroke="#555"/>'
                 if not head else f'<circle cx="{x:.0f}" cy="{y:.0f}" r="14" fill="#fff" stroke="#555"/>')
        if name in slots:
            shape = shape.replace('fill="#fff"', 'fill="#fff7d6"')  # features drawn apart from the heads
        text = f'<text x="{x:.0f}" y="{y + 3:.0f}" font-size="8" text-anchor="middle">{label}</text>'
        link = "#patterns" if head and "KV" not in name else None
        node = f"{shape}{text}<title>{label}</title>"
        dots.append(f'<a href="{link}">{node}</a>' if link else node)
    rows = "".join(f'<text x="4" y="{height - pad - dy * (l + 1) + 3:.0f}" font-size="9" fill="#777">{l}</text>'
                   for l in range(g.n_layers))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="circuit">{rows}{"".join(lines)}{"".join(dots)}</svg>'
            f"<p>The circuit's {len(chosen)} strongest edges (of {int(keep.sum())}); layer numbers at the left. "
            "Width: |score|; red: corrupting the edge lowers the metric (the edge carries the behaviour), blue: "
            "raises it. Into a head: q solid, k dashed, v dotted.</p>")


def _feature_slots(g: Graph, names: list[str]) -> dict[str, tuple[int, int]]:
    """Where the SVG puts each SAE node of `names`: (its layer, its column), the columns of a layer's nodes in
    the graph's order, wrapping past the row's width."""
    order = {n: i for i, n in enumerate(g.senders)}
    by_layer: dict[int, list[str]] = {}
    for n in sorted(names, key=order.get):
        by_layer.setdefault(g.sender_layer[order[n]], []).append(n)
    return {n: (layer, i % (g.n_heads + 1)) for layer, found in by_layer.items() for i, n in enumerate(found)}


def _qk_section(r, rec: dict, task, model, top: int = 6) -> Section:
    """A head's QK attribution: its top query senders x top key senders (mean term and mean contrast term at the
    keys it attends to most), beside its pattern on the first clean prompt; the top pairs; the check."""
    import matplotlib  # start-up time: the command's --help and checks run without it

    matplotlib.use("Agg")
    from matplotlib.figure import Figure


    mats = [(r.matrix(top, "term"), "mean term"), (r.matrix(top, "contrast"), "mean contrast term")]
    first = r.prompts == int(r.prompts.min())
    pos = int(r.query_pos[first].max())
    tokens = task.clean[int(r.prompts.min()), :pos + 1]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None].to(model.device),
                                        names_filter=lambda n: n == f"blocks.{r.layer}.attn.hook_pattern")
    pattern = to_numpy(cache[f"blocks.{r.layer}.attn.hook_pattern"][0, r.head], np.float32)
    fig = Figure(figsize=(14, 4.4))
    axes = fig.subplots(1, 3)
    for ax, (mat, label) in zip(axes, mats):
        arr = mat.to_numpy()
        bound = float(np.abs(arr).max()) or 1.0
        im = ax.imshow(arr, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        ax.set_xticks(range(arr.shape[1]), list(mat.columns), rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(arr.shape[0]), list(mat.index), fontsize=8)
        ax.set_xlabel("key-side sender")
        ax.set_ylabel("query-side sender")
        ax.set_title(f"{r.name}: {label}")
        for i in range(arr.shape[0]):
            for j in range(arr.shape[1]):
                ax.text(j, i, f"{arr[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color=text_colour(im.cmap(im.norm(arr[i, j]))))
        fig.colorbar(im, ax=ax, shrink=0.8)
    ax = axes[2]
    ax.imshow(pattern, cmap="viridis", vmin=0, vmax=max(float(pattern.max()), 1e-6), aspect="auto")
    ax.set_title(f"{r.name}: pattern, prompt {int(r.prompts.min())}")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    fig.tight_layout()
    weights = ", ".join(f"{w:.3f}" for w in rec["mean_weight_at_keys"][:8]) + (
        ", ..." if len(rec["mean_weight_at_keys"]) > 8 else "")
    fewer = rec["fewest_keys_per_query"] < rec["keys_asked"]
    keys = (f"the {rec['keys_per_query']} keys it attends to most" if not fewer else
            f"the keys it attends to most, at most {rec['keys_asked']} (--qk-keys) and never more than a query sees: "
            f"{rec['fewest_keys_per_query']}" + (f" to {rec['keys_per_query']}" if rec['keys_per_query'] !=
                                                 rec['fewest_keys_per_query'] else "") + " keys, each once")
    lines = [f"Why {r.name} attends where it does: its pre-softmax score from each answer position (the query, "
             f"{rec['queries']} of them) to {keys} (mean weights {weights}), "
             "split into (query-side sender, key-side sender) terms, every norm's scale frozen at the clean run; `bias` "
             "is the norms' and projections' constants plus what the senders leave out of the stream. The contrast "
             "term is the term at the key less its mean over every key the query sees: what sets this key apart.",
             f"Check: the terms add up to the model's score within {rec['max_abs_error']:.2g} (the contrast within "
             f"{rec['contrast_max_abs_error']:.2g})."
             + (" The scores are soft-capped: the raw score, before the cap, is decomposed." if r.softcapped else "")
             + (f" Under grouped-query attention its keys are KV head {r.kv_head}'s." if r.kv_head != r.head else "")]
    if rec.get("sae_hook"):
        lines.append(f"The senders are the features of the SAE at {rec['sae_hook']} (the stream the head's layer reads, "
                     "written as the SAE sees it): `F{index}` a feature (its activation times its decoder row), "
                     "`other_features` the features not shown, `b_dec` the SAE's decoder bias, `error` what the SAE "
                     "misses of the stream; `bias` is then the norms' and projections' constants alone.")
    if r.delta is not None:
        lines.append("Corrupted prompts: each pair's change of term (delta) and its first-order share of the attention "
                     "weight's change (weight change); their sum, "
                     + ", ".join(f"{a:+.3f}" for a in rec["mean_weight_change_first_order"])
                     + " at the keys, against the true change "
                     + ", ".join(f"{a:+.3f}" for a in rec["mean_weight_change_true"]) + ".")
    return Section(f"qk-{r.name}", f"QK attribution: {r.name}").add(
        *lines, png(fig, f"qk_{r.name}.png", f"{r.name}: mean term and contrast term by sender pair; its pattern"),
        r.pairs().head(12))
