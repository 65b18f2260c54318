"""What a head moves: an attention-output SAE's features, split by head (Kissane et al. 2024, "Interpreting
Attention Layer Outputs with Sparse Autoencoders", arXiv 2406.17759).

The SAE reads `blocks.L.attn.hook_z` with the heads flattened head-major, so feature f's decoder row W_dec[f]
[n_heads * d_head] is one d_head slice per head, and its encoder column W_enc[:, f] likewise:

- weight-based head attribution (`decoder_norms`): |W_dec[f, h]|, the norm of the slice of head h, and its share
  of the row's squared norm |W_dec[f, h]|^2 / |W_dec[f]|^2 (the shares of a feature sum to 1); the feature's top
  head is the one of the largest share. Weights only: no data.
- direct feature attribution (`direct_feature_attribution`): the pre-activation is linear in z before the
  activation function (`encoder.Encoder`), so on given tokens it splits exactly into one term per head,
  z_h @ W_enc[h rows, f], plus a constant, b_enc[f] - (b_dec * apply) @ W_enc[:, f]. Summed over the
  positions where the feature is active, the head terms and the constant add up to the summed pre-activation (the
  frame carries both, so the split can be checked on every run); a gated SAE's gate pre-activation is the one split.
- `head_top_features`: each head's top features by either.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .encoder import Encoder, linear_encoder
from .passes import feature_pass
from .site import Site, batches, check_width, site_of

ATTRIBUTION_COLUMNS = ("feature", "layer", "head", "attribution", "share", "mean", "n_active", "constant",
                       "pre_activation", "kind")
NORM_COLUMNS = ("feature", "layer", "head", "norm", "share", "feature_norm", "top_head")
TOP_COLUMNS = ("layer", "head", "rank", "feature", "value", "share", "by")


def head_site(sae, cfg) -> Site:
    """The SAE's site on a model of config `cfg`, refused in one line (ValueError) unless it is an attention
    output whose width is the model's n_heads * d_head."""
    site = site_of(sae.cfg.hook_name, cfg)
    if not site.heads:
        raise ValueError(f"the SAE reads {site.hook_name}, which is not split by head: the head tables need an "
                         "attention-output SAE (blocks.L.attn.hook_z)")
    check_width(site, sae.cfg.d_in, cfg)
    return site


def decoder_norms(sae, cfg) -> pd.DataFrame:
    """Per feature and head: `norm` = |W_dec[f, h]| (the row restricted to head h's d_head slice), `share` =
    norm^2 / |W_dec[f]|^2, `feature_norm` = |W_dec[f]|, `top_head` = the head of the feature's largest share.
    `cfg`: the model's config (n_heads, d_head). One row per (feature, head)."""
    site = head_site(sae, cfg)
    n_heads, d_head = cfg.n_heads, cfg.d_head
    W = sae.W_dec.detach().float().reshape(-1, n_heads, d_head)
    norms = W.norm(dim=-1)  # [d_sae, n_heads]
    squared = norms.square()
    total = squared.sum(-1, keepdim=True)
    share = torch.where(total > 0, squared / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    d_sae = W.shape[0]
    return pd.DataFrame({
        "feature": np.repeat(np.arange(d_sae), n_heads), "layer": site.layer,
        "head": np.tile(np.arange(n_heads), d_sae), "norm": to_numpy(norms.reshape(-1)),
        "share": to_numpy(share.reshape(-1)), "feature_norm": np.repeat(to_numpy(total.sqrt().reshape(-1)), n_heads),
        "top_head": np.repeat(to_numpy(norms.argmax(-1)), n_heads)})


def feature_head_terms(sae, z: Tensor, features=None) -> tuple[Tensor, Tensor]:
    """(terms [..., n_heads, F], constant [F]) at every position of z [..., n_heads, d_head] (hook_z): head h's
    term of each feature's pre-activation, and the constant; terms.sum(-2) + constant is the pre-activation
    (a gated SAE's gate pre-activation). `features`: the features F (all by default)."""
    enc = linear_encoder(sae)
    cols = None if features is None else torch.as_tensor(features, device=enc.W.device)
    constant = enc.constant if cols is None else enc.constant[cols]
    return enc.head_terms(z.to(enc.W.device), cols), constant


class AttributionSums:
    """The running sums of the direct feature attribution: per feature, over the positions where it is active,
    the sum of each head's z (so memory is d_in a feature, whatever the corpus), the count and the summed
    pre-activation (computed whole, by `Encoder.pre`: the check of the split)."""

    def __init__(self, enc: Encoder, n_heads: int, d_head: int) -> None:
        self.enc, self.n_heads, self.d_head = enc, n_heads, d_head
        d_sae, device = enc.W.shape[1], enc.W.device
        self.z_sums = torch.zeros(n_heads, d_sae, d_head, device=device)
        self.active = torch.zeros(d_sae, device=device)
        self.pre = torch.zeros(d_sae, device=device)

    def update(self, first: int, tokens: Tensor, x: Tensor, acts: Tensor) -> None:
        z = x.reshape(-1, self.n_heads, self.d_head).float()
        on = (acts.reshape(z.shape[0], -1) > 0).float()
        self.z_sums += torch.einsum("nf,nhd->hfd", on, z)
        self.active += on.sum(0)
        self.pre += (on * self.enc.pre(z.flatten(1))).sum(0)

    def frame(self, layer: int) -> pd.DataFrame:
        """One row per (active feature, head): `ATTRIBUTION_COLUMNS`."""
        W = self.enc.W.view(self.n_heads, self.d_head, -1)
        by_head = torch.einsum("hfd,hdf->fh", self.z_sums, W)  # [d_sae, n_heads]
        alive = torch.nonzero(self.active > 0).flatten()
        by_head, n = by_head[alive], self.active[alive]
        share = by_head.abs() / by_head.abs().sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        H = self.n_heads
        per_feature = lambda t: np.repeat(to_numpy(t), H)  # noqa: E731
        return pd.DataFrame({
            "feature": per_feature(alive), "layer": layer, "head": np.tile(np.arange(H), len(alive)),
            "attribution": to_numpy(by_head.reshape(-1)), "share": to_numpy(share.reshape(-1)),
            "mean": to_numpy((by_head / n[:, None]).reshape(-1)), "n_active": per_feature(n).astype(np.int64),
            "constant": per_feature(n * self.enc.constant[alive]), "pre_activation": per_feature(self.pre[alive]),
            "kind": self.enc.kind})


def direct_feature_attribution(model, sae, tokens, *, batch_size: int = 8) -> pd.DataFrame:
    """Each head's direct attribution to each feature's pre-activation on `tokens` ([n, pos] ids, or texts of one
    length), summed over the positions where the feature is active (its SAE activation > 0).

    One row per (feature active somewhere, head): `attribution` (the head's terms summed), `share` (|attribution|
    over the feature's sum of |attribution| across heads), `mean` (per active position), `n_active`, `constant`
    (the constant term times n_active) and `pre_activation` (the summed pre-activation, computed whole): per feature,
    the heads' attributions plus the constant equal the pre-activation to float32 round-off. `kind`: "pre", or
    "gate" for a gated SAE (its gate's pre-activation). Refused in one line: an SAE not on hook_z, of another width,
    or with a non-linear input normalisation (`encoder.refusal`)."""
    site = head_site(sae, model.cfg)
    sums = AttributionSums(linear_encoder(sae), model.cfg.n_heads, model.cfg.d_head)
    tokens = model.prepare(tokens, padding=False).tokens
    feature_pass(model, sae, batches(tokens, batch_size), [sums], site=site)
    return sums.frame(site.layer)


def head_top_features(frame: pd.DataFrame, *, by: str = "attribution", top: int = 10) -> pd.DataFrame:
    """Each head's `top` features: by "attribution" (a `direct_feature_attribution` frame: the largest summed
    attribution), "share" or "norm" (a `decoder_norms` frame: the largest share of the decoder row's squared norm
    on the head, or the largest norm there; Kissane et al.'s weight-based head attribution, the two alike for
    unit-norm rows). One row per (head, rank): `TOP_COLUMNS`; `value` is the ranked column."""
    if by not in ("attribution", "share", "norm"):
        raise ValueError(f"by must be 'attribution', 'share' or 'norm', got {by!r}")
    made_by, mark = ("direct_feature_attribution", "attribution") if by == "attribution" else ("decoder_norms", "norm")
    if mark not in frame.columns:
        raise ValueError(f"ranking by {by} reads a frame of {made_by} (with its {mark!r} column); this one has "
                         f"{', '.join(map(str, frame.columns))}")
    column = by
    ranked = frame.sort_values(["layer", "head", column, "feature"], ascending=[True, True, False, True])
    out = ranked.groupby(["layer", "head"], sort=True).head(top).copy()
    out["rank"] = out.groupby(["layer", "head"]).cumcount()
    out = out.assign(value=out[column], by=by)
    return out[list(TOP_COLUMNS)].reset_index(drop=True)


__all__ = ["ATTRIBUTION_COLUMNS", "AttributionSums", "NORM_COLUMNS", "TOP_COLUMNS", "decoder_norms",
           "direct_feature_attribution", "feature_head_terms", "head_site", "head_top_features"]
