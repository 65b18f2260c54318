"""`FeaturesStudy` (`interp features MODEL --sae PATH`): what an attention layer's heads move, read through a sparse
autoencoder on its output (Kissane et al. 2024, arXiv 2406.17759).

    from interp.analyses.features.study import FeaturesSettings, FeaturesStudy
    from interp.analyses.study import run
    run(FeaturesStudy(), model, "out/features", FeaturesSettings(model="attn-only-2l", sae="path/to/sae", data=...))

One streamed pass over the text (`passes.feature_pass`: the model to the SAE's block, fused; the SAE's encode) feeds
every per-feature measure at once; memory is one batch plus the running sums. Tables:

- features: per feature, how often it is active (activation > 0) and how strongly, its top head (by decoder norm),
  and whether the report shows it;
- decoder_norms (hook_z): each feature's decoder norm on each head and its share (`heads.decoder_norms`);
- attribution (hook_z): each head's direct attribution to each active feature's pre-activation, summed over the
  positions where it is active, with the constant and the pre-activation it adds up to (`heads.AttributionSums`);
- head_features (hook_z): each head's top features, by attribution and by decoder-norm share
  (`heads.head_top_features`);
- contexts: each feature's k max-activating contexts, one row per window token (`contexts.RunningTopK`);
- logit_effects: each feature's most raised and lowered tokens (`logits.logit_effect`).

An SAE on a d_model-wide hook (resid_pre / mid / post, attn_out, mlp_out) is read too: its features have contexts and
logit effects, but no heads, so the three head tables are left out (said in the report). An attention-output SAE
whose input normalisation is not linear is refused (its pre-activation does not split by head: `encoder.refusal`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import pandas as pd

from interp.errors import check_int
from interp.models.placement.device import to_numpy
from interp.models.saes import load_sae
from interp.models.saes.files import read as read_sae_files
from interp.models.saes.formats import resolve_sae
from interp.models.saes.sae import SAEConfig

from .._common import progress
from ..study import Measured, Study, StudySettings, Table, fit_default
from .contexts import CONTEXT_COLUMNS, WINDOW, RunningTopK
from .encoder import linear_encoder, refusal
from .heads import ATTRIBUTION_COLUMNS, NORM_COLUMNS, TOP_COLUMNS, AttributionSums, decoder_norms, head_top_features
from .logits import LOGIT_COLUMNS, logit_effect, token_strings
from .passes import Activity, feature_pass
from .report import report_sections
from .site import Site, batches, check_width, site_of

TOP_K, SHOWN, BATCH, LOGIT_TOKENS, HEAD_TOP = 10, 16, 8, 10, 10
FEATURE_COLUMNS = ("feature", "n_active", "positions", "frequency", "mean_activation", "max_activation", "top_head",
                   "top_head_share", "shown")


@dataclass(frozen=True, kw_only=True, eq=False)
class FeaturesSettings(StudySettings):
    """sae: the SAE's folder or file (anything `interp.models.saes.load_sae` reads); top_k: contexts per feature;
    features: how many the report shows; batch_size: rows of the text per forward; logit_tokens: tokens raised and
    lowered per feature; window: tokens kept before and after each context; through_norm: the logit effect through
    the final norm's frozen linear part (`logits`)."""

    sae: str = ""
    top_k: int = TOP_K
    features: int = SHOWN
    batch_size: int = BATCH
    logit_tokens: int = LOGIT_TOKENS
    window: tuple[int, int] = WINDOW
    through_norm: bool = True


@dataclass(frozen=True, kw_only=True, eq=False)
class FeaturesMeasured(Measured):
    """Beside the tables: the SAE's site and config, the features the report shows (in order), {token id: text}
    for the tokens the contexts and logits name, and the split's check: the largest |pre-activation - heads -
    constant| over features and the largest |pre-activation| it is measured against (None without heads)."""

    site: Site
    sae_cfg: object
    shown: list[int]
    strings: dict
    residual: tuple[float, float] | None


def sae_config(path: str):
    """The SAE's config, read before the model loads and before any weight (`interp.models.saes`: a local folder, a
    zoo SAE or a Hugging Face folder); a missing or unreadable SAE is one line."""
    folder, where = resolve_sae(path)
    files = read_sae_files(folder, where=where)
    return SAEConfig(**{**files.fields, "source": files.source})


class FeaturesStudy(Study):
    """`interp features`: see the module docstring."""

    name = "features"
    title = "What the heads move: SAE features"
    tables = (Table("features", FEATURE_COLUMNS), Table("decoder_norms", NORM_COLUMNS, optional=True),
              Table("attribution", ATTRIBUTION_COLUMNS, optional=True),
              Table("head_features", TOP_COLUMNS, optional=True),
              Table("contexts", (*CONTEXT_COLUMNS, "token_text")), Table("logit_effects", LOGIT_COLUMNS, optional=True))

    def check(self, cfg, s: FeaturesSettings):
        for flag, value in (("--top-k", s.top_k), ("--features", s.features), ("--batch-size", s.batch_size),
                            ("logit_tokens", s.logit_tokens)):
            check_int(flag, value, minimum=1)
        if not str(s.sae).strip():
            raise ValueError("the features study reads an SAE: give its folder or name (--sae PATH, sae=...)")
        sae_cfg = sae_config(s.sae)
        site = site_of(sae_cfg.hook_name, cfg)
        check_width(site, sae_cfg.d_in, cfg)
        why = refusal(sae_cfg) if site.heads else None
        if why is not None:
            raise ValueError(f"--sae {s.sae}: an attention-output SAE is read here split by head, and {why}")
        data, note = fit_default(s.data, cfg.n_ctx)
        if data.length > cfg.n_ctx:
            raise ValueError(f"--seq-len {data.length} is past this model's context (n_ctx={cfg.n_ctx:,})")
        check_int("--n-seqs", data.rows, minimum=1)
        data.check(cfg.d_vocab)
        s.placement.check_fits(cfg, min(s.batch_size, data.rows), data.length)
        notes = [note] if note else []
        if not site.heads:
            notes.append(f"note: the SAE reads {site.hook_name}, which is not split by head: contexts and logit "
                         "effects only (the head tables need blocks.L.attn.hook_z)")
        return dataclasses.replace(s, data=data), notes

    def measure(self, model, s: FeaturesSettings, stage):
        sae = stage("the SAE", lambda: load_sae(s.sae, device=model.device))
        site = site_of(sae.cfg.hook_name, model.cfg)
        tokens = s.data.tokens(model)
        tables = {}
        if site.heads:
            tables["decoder_norms"] = stage("decoder norms by head", lambda: decoder_norms(sae, model.cfg))
        activity = Activity(sae.cfg.d_sae, sae.device)
        top = RunningTopK(s.top_k, sae.cfg.d_sae, sae.device, s.window)
        sums = AttributionSums(linear_encoder(sae), model.cfg.n_heads, model.cfg.d_head) if site.heads else None
        consumers = [c for c in (activity, top, sums) if c is not None]
        rows = progress(batches(tokens, s.batch_size), total=-(-tokens.shape[0] // s.batch_size), desc="features",
                        enabled=s.progress)
        stage("one pass: activity, attribution, contexts", lambda: feature_pass(model, sae, rows, consumers, site))
        residual = None
        if site.heads:
            tables["attribution"] = sums.frame(site.layer)
            tables["head_features"] = pd.concat(
                [head_top_features(tables["attribution"], by="attribution", top=HEAD_TOP),
                 head_top_features(tables["decoder_norms"], by="share", top=HEAD_TOP)], ignore_index=True)
            residual = split_residual(tables["attribution"])
        if model.native:  # a wrapped model has no weight views (W_O, W_U): its features get no logit table
            tables["logit_effects"] = stage("logit effects", lambda: logit_effect(
                model, sae, s.logit_tokens, through_norm=s.through_norm))
        contexts = top.frame()
        logits = tables.get("logit_effects", pd.DataFrame(columns=list(LOGIT_COLUMNS)))
        strings = token_strings(model, sorted(set(contexts["token"]) | set(logits["token"])))
        tables["contexts"] = contexts.assign(token_text=contexts["token"].map(strings).fillna(""))
        summary = feature_summary(activity, tables.get("decoder_norms"))
        shown = choose_shown(summary, tables.get("attribution"), s.features)
        tables["features"] = summary.assign(shown=summary["feature"].isin(shown))
        return FeaturesMeasured(tables=tables, site=site, sae_cfg=sae.cfg, shown=shown, strings=strings,
                                residual=residual)

    def record(self, s: FeaturesSettings, m: FeaturesMeasured) -> dict:
        c = m.sae_cfg
        alive = m["features"]
        return {"sae": {"path": str(s.sae), "hook_name": c.hook_name, "architecture": c.architecture, "d_in": c.d_in,
                        "d_sae": c.d_sae, "normalize_activations": c.normalize_activations},
                "site": m.site.kind, "layer": m.site.layer, "n_sequences": s.data.rows, "seq_len": s.data.length,
                "top_k": s.top_k, "window": list(s.window), "batch_size": s.batch_size,
                "logit_tokens": s.logit_tokens, "through_norm": s.through_norm,
                "alive_features": int((alive["n_active"] > 0).sum()), "shown": m.shown,
                "split_residual": None if m.residual is None else {"largest": m.residual[0], "of": m.residual[1]}}

    def sections(self, s: FeaturesSettings, m: FeaturesMeasured, record: dict):
        return report_sections(s, m, record)


def split_residual(attribution: pd.DataFrame) -> tuple[float, float]:
    """(the largest |pre_activation - sum of the heads' attributions - constant| over features, the largest
    |pre_activation|): the exact split's check on this run (float32 round-off)."""
    per = attribution.groupby("feature").agg(heads=("attribution", "sum"), constant=("constant", "first"),
                                             pre=("pre_activation", "first"))
    if per.empty:
        return 0.0, 0.0
    return float((per["pre"] - per["heads"] - per["constant"]).abs().max()), float(per["pre"].abs().max())


def feature_summary(activity: Activity, norms: pd.DataFrame | None) -> pd.DataFrame:
    """One row per feature: how often and how strongly it fired, and its top head by decoder norm (-1 without
    heads)."""
    n = to_numpy(activity.active).astype("int64")
    total = to_numpy(activity.total)
    frame = pd.DataFrame({"feature": range(len(n)), "n_active": n, "positions": activity.positions,
                          "frequency": n / max(activity.positions, 1),
                          "mean_activation": [t / a if a else 0.0 for t, a in zip(total, n)],
                          "max_activation": to_numpy(activity.largest)})
    if norms is None:
        return frame.assign(top_head=-1, top_head_share=float("nan"))
    best = norms.loc[norms.groupby("feature")["share"].idxmax(), ["feature", "head", "share"]]
    best = best.rename(columns={"head": "top_head", "share": "top_head_share"})
    return frame.merge(best, on="feature", how="left")


def choose_shown(summary: pd.DataFrame, attribution: pd.DataFrame | None, n: int) -> list[int]:
    """The `n` features the report shows: with heads, each head's top features by attribution in turn (rank 0 of
    every head, then rank 1, ...), so every head is shown; without, the largest total activation. Only features
    that fired."""
    alive = summary[summary["n_active"] > 0]
    if attribution is None or attribution.empty:
        order = alive.assign(total=alive["n_active"] * alive["mean_activation"]).sort_values(
            ["total", "feature"], ascending=[False, True])
        return [int(f) for f in order["feature"].head(n)]
    ranked = head_top_features(attribution, by="attribution", top=n).sort_values(["rank", "layer", "head"])
    shown: list[int] = []
    for f in ranked["feature"]:
        if int(f) not in shown:
            shown.append(int(f))
        if len(shown) == n:
            break
    return shown


__all__ = ["FEATURE_COLUMNS", "FeaturesMeasured", "FeaturesSettings", "FeaturesStudy", "choose_shown",
           "feature_summary", "split_residual"]
