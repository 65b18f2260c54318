"""`interp kv precision`: the KV-cache compression study of one model, a `Study` (`interp.analyses.study`).

    kv.parquet        precision, perplexity, loss, loss_diff, bytes_per_token
    kv_heads.parquet  precision, layer, head, kv_head, kl, z_rel_change
    kv_mixed.parquet  k, selection, seed, precision, perplexity, loss, bytes_per_token
    kv_sensitivity.parquet  layer, kv_head, loss, kl, gradient (the three rankings)
    report.html, report.md, figures/, settings.json

Stages (each with a progress bar): uniform precisions; per-head pattern KL; the three sensitivity
rankings; the mixed-precision caches; head roles from the atlas's analyzers (previous-token and
induction by detect_head on the same text, sinks by attention to token 0) to say how they fare.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
import pandas as pd
import torch

from interp.kernels.kv_quant import check_precision, code_shape

from .. import plots
from .._common import spearman
from ..document import Section, head_name, png
from ..heads import detect_heads
from ..sinks import attention_sinks
from ..study import Measured, Study, StudySettings, Table, fit_default
from .precision import head_table, kv_sensitivity, mixed_precision, precision_table, recovered_gap

KEEP_FRACTIONS = (0.1, 0.2, 0.5)


@dataclass(frozen=True, kw_only=True, eq=False)
class PrecisionSettings(StudySettings):
    """precisions: the uniform caches (`interp.kernels.kv_quant.PRECISIONS`); seeds: the random selections
    per k; sensitivity_tokens: tokens per sequence for the per-KV-head loss and gradient rankings."""

    precisions: tuple[str, ...] = ("fp32", "int8", "fp8", "int4")
    seeds: tuple[int, ...] = (0, 1, 2)
    sensitivity_tokens: int = 1024


@dataclass(frozen=True, kw_only=True, eq=False)
class PrecisionMeasured(Measured):
    """Beside the tables: the atlas's top heads by role ({role: [(layer, head)]}), the numbers of
    KV heads kept in fp32 (`ks`) out of `n_kv`, the tokens' [rows, length] and the sensitivity rankings' length."""

    roles: dict[str, list[tuple[int, int]]]
    ks: list[int]
    n_kv: int
    tokens: list[int]
    sensitivity_tokens: int


class PrecisionStudy(Study):
    name = "kv-precision"
    title = "KV-cache compression"
    tables = (Table("kv", ("precision", "perplexity", "loss", "loss_diff", "bytes_per_token")),
              Table("kv_heads", ("precision", "layer", "head", "kv_head", "kl", "z_rel_change")),
              Table("kv_mixed", ("k", "selection", "seed", "precision", "perplexity", "loss", "bytes_per_token")),
              Table("kv_sensitivity", ("layer", "kv_head", "loss", "kl", "gradient")))

    def uses_kv_cache(self, settings) -> bool:
        return True

    def check(self, cfg, s: PrecisionSettings):
        precisions = tuple(check_precision(p) for p in s.precisions)
        if not precisions:
            raise ValueError("--precisions is empty")
        data, note = fit_default(s.data, cfg.n_ctx)
        if data.length > cfg.n_ctx:
            raise ValueError(f"sequences of {data.length} tokens are longer than this model's context "
                             f"(n_ctx={cfg.n_ctx}); use --seq-len {cfg.n_ctx} or shorter rows")
        for p in precisions:
            code_shape(p, cfg.head_dim)  # int4 with an odd d_head fails here, as the cache would
        data.check(cfg.d_vocab)
        s.placement.check_fits(cfg, data.rows, data.length)
        return dataclasses.replace(s, precisions=precisions, data=data), [note] if note else []

    def measure(self, model, s: PrecisionSettings, stage):
        tokens = s.data.tokens(model)
        table = stage("uniform precisions", lambda: precision_table(model, tokens, s.precisions, s.progress))
        quantized = [p for p in s.precisions if p not in ("fp32",)]
        heads = stage("per-head pattern KL", lambda: head_table(model, tokens, quantized or ("int4",)))
        sens_tokens = tokens[:, :s.sensitivity_tokens]
        # the int4 KLs just computed serve the kl ranking when it is measured on the same tokens
        reuse = heads if "int4" in set(heads["precision"]) and sens_tokens.shape == tokens.shape else None
        sens = stage("sensitivity rankings", lambda: kv_sensitivity(model, sens_tokens, reuse, "int4", s.progress))
        n_kv = model.cfg.n_layers * model.cfg.kv_heads
        ks = sorted({max(1, round(f * n_kv)) for f in KEEP_FRACTIONS})
        mixed = stage("mixed precision", lambda: mixed_precision(model, tokens, sens, ks, seeds=s.seeds, uniform=(),
                                                                progress_bar=s.progress))
        uniform = table.assign(k=[n_kv if p == "fp32" else 0 for p in table["precision"]], selection="uniform", seed=-1)
        mixed = pd.concat([uniform[mixed.columns], mixed], ignore_index=True)
        roles = stage("head roles", lambda: _roles(model, tokens))
        return PrecisionMeasured(tables={"kv": table, "kv_heads": heads, "kv_mixed": mixed, "kv_sensitivity": sens},
                                 roles=roles, ks=ks, n_kv=n_kv, tokens=list(tokens.shape),
                                 sensitivity_tokens=int(sens_tokens.shape[1]))

    def record(self, s: PrecisionSettings, m: PrecisionMeasured) -> dict:
        return dict(precisions=list(s.precisions), tokens=m.tokens, seeds=list(s.seeds),
                    sensitivity_tokens=m.sensitivity_tokens, ks=m.ks)

    def sections(self, s: PrecisionSettings, m: PrecisionMeasured, record) -> list[Section]:
        return _sections(s.model, m["kv"], m["kv_heads"], m["kv_mixed"], m["kv_sensitivity"], m.roles, m.ks, m.n_kv,
                         record["data_description"])


def _roles(model, tokens) -> dict:
    """{role: top 3 heads} from the atlas's analyzers on the same text."""
    scores = detect_heads(model, tokens, kinds=("previous_token", "induction"))
    sinks = attention_sinks(model, tokens, n_sink=1)
    top = lambda f, col: [(int(r.layer), int(r.head)) for r in f.nlargest(3, col).itertuples()]  # noqa: E731
    return {"previous-token": top(scores[scores.kind == "previous_token"], "score"),
            "induction": top(scores[scores.kind == "induction"], "score"),
            "sink": top(sinks[sinks.key == 0], "alpha")}


def _sections(name, table, heads, mixed, sens, roles, ks, n_kv, data) -> list[Section]:
    summary = Section("summary", "Summary")
    rows = "; ".join(f"{r.precision} {r.perplexity:.3f} ({r.bytes_per_token:,.0f} B/token)" for r in table.itertuples())
    ten = min(ks, key=lambda k: abs(k - 0.1 * n_kv))
    gap = recovered_gap(mixed, ten)
    best = max((s for s in gap if s != "random"), key=lambda s: gap[s]) if gap else None
    summary.add(f"{name} on {data}. Perplexity by KV-cache precision: {rows}.",
                (f"Keeping {ten} of {n_kv} KV heads ({ten / n_kv:.0%}) in fp32 and the rest in int4, the {best} ranking "
                 f"recovers {gap[best]:.0%} of the int4 -> fp32 loss gap (kl {gap.get('kl', math.nan):.0%}, loss "
                 f"{gap.get('loss', math.nan):.0%}, gradient {gap.get('gradient', math.nan):.0%}, random "
                 f"{gap.get('random', math.nan):.0%} on average over seeds).") if best else None)
    uni = Section("precisions", "Uniform precisions").add(
        "Every KV head in one precision: perplexity (exp of the mean next-token loss), the loss change from fp32, "
        "and the bytes per token the cache holds (codes and float32 scales, keys and values, all layers).",
        table[["precision", "perplexity", "loss_diff", "bytes_per_token"]].round(5).astype({"bytes_per_token": int}))
    per_head = Section("heads", "Which heads change")
    for p in [p for p in ("int4", "fp8", "int8") if p in set(heads["precision"])]:
        h = heads[heads["precision"] == p]
        top = h.nlargest(10, "kl")
        per_head.add(f"{p}: the 10 query heads whose attention rows move most (KL(p_full || p_{p}), nats, mean over "
                     f"queries; z_rel_change = ||z_q - z|| / ||z||): "
                     + ", ".join(f"{head_name(r.layer, r.head)} {r.kl:.3f}" for r in top.itertuples()) + ".",
                     png(plots.plot_head_scores(h.rename(columns={"kl": "score"}), "score",
                                                title=f"pattern KL under {p} (nats)"), f"kv_kl_{p}.png"))
    if "int4" in set(heads["precision"]):
        h = heads[heads["precision"] == "int4"].copy()
        h["rank"] = h["kl"].rank(ascending=False).astype(int)
        fare = [dict(role=role, head=head_name(l, hd), int4_kl=round(float(h[(h.layer == l) & (h["head"] == hd)]["kl"].iloc[0]), 4),
                     rank=f"{int(h[(h.layer == l) & (h['head'] == hd)]['rank'].iloc[0])} of {len(h)}")
                for role, hs in roles.items() for l, hd in hs]
        per_head.add("How the atlas's heads fare under int4 (rank 1 = the most changed head):", pd.DataFrame(fare))
    mix = Section("mixed", "Mixed precision chosen by the analysis")
    mix.add(f"The top k KV heads by each ranking kept in fp32, the rest int4, against k random KV heads ({mixed['seed'].max() + 1} "
            "seeds) and the uniform caches. Rankings: loss (measured loss increase with that KV head alone in int4), kl "
            "(mean int4 pattern KL of its query heads), gradient (first-order estimate from one backward pass).",
            mixed.assign(selection=[f"uniform {p}" if s == "uniform" else s for s, p in zip(mixed["selection"], mixed["precision"])])
            .groupby(["k", "selection"], as_index=False, sort=False)
            .agg(perplexity=("perplexity", "mean"), bytes_per_token=("bytes_per_token", "mean"), runs=("loss", "size"))
            .round(4).astype({"bytes_per_token": int}),
            png(plots.mixed_precision_curve(mixed), "kv_mixed.png"))
    ranks = Section("sensitivity", "The three rankings").add(
        "Spearman correlation between the rankings over KV heads: "
        + ", ".join(f"{a}-{b} {spearman(torch.tensor(sens[a].to_numpy()), torch.tensor(sens[b].to_numpy())):.2f}" for a, b in
                    (("loss", "kl"), ("loss", "gradient"), ("kl", "gradient"))) + ".",
        sens.assign(head=[f"L{r.layer}KV{r.kv_head}" for r in sens.itertuples()]).nlargest(10, "loss")[
            ["head", "loss", "kl", "gradient"]].round(5))
    return [summary, uni, per_head, mix, ranks]
