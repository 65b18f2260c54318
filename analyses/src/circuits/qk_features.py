"""QK attribution in SAE features: the stream a head reads, written as a residual-stream SAE writes it.

A residual SAE at the stream entering layer L (`blocks.L.hook_resid_pre`, the same tensor as
`blocks.{L-1}.hook_resid_post`) writes that stream, at each position p, as

    x(p) = sum over features f of c_f(p) W_dec[f]  +  b_dec(p)  +  error(p)

where c_f(p) is feature f's activation (its `hook_sae_acts_post`; a top-k SAE that rescales by the decoder
norm divides it by |W_dec[f]|, as its decoder does; an SAE that normalises its input multiplies it by the
output normalisation's scale at p: |x| / sqrt(d_in) for constant_norm_rescale, x's standard deviation for
layer_norm), b_dec(p) is what the decoder gives for no feature at all (`b_dec`, under those normalisations
times the same scale, plus layer_norm's mean), and error(p) = x - the SAE's reconstruction. With an SAE
(`qk.qk_attribution(..., sae=)`) these are the head's senders on each side, in place of the graph's: each
feature `F{index}` (c_f W_dec[f]), `b_dec` and `error`, and `qk`'s `bias` (the norms' and projections'
constants, plus the float round-off of the split). A head's score is bilinear in the stream, so the terms
add up to the score exactly, whichever features are shown.

An SAE has thousands of features; a few at each position are active. The features shown on each side are
the `top` with the largest summed |term| over every pair and key decomposed (the clean run's); the others
are summed into one sender, `other_features` (the reconstruction less b_dec less the features shown: the
sum is factorised, never a pair matrix over every feature), so a table of the shown pairs still adds up.
`b_dec` and `error` are always shown.

This module holds what the SAE writes (`split_stream`, `sender_values`) and the checks; how the head reads
the stream (ln1 with its scale frozen, W_Q / W_K, QK-norm, RoPE) stays in `qk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from interp.models.hooks import canonical
from interp.models.saes import SAE, as_sae

FEATURE, OTHER, B_DEC, ERROR = "F", "other_features", "b_dec", "error"
TOP_FEATURES = 8


@dataclass(frozen=True)
class Features:
    """A residual-stream SAE as QK attribution's senders, and how many of its features to show on each side
    (`top`, the largest by summed |term|; the rest are `other_features`). `qk_attribution(..., sae=)` takes
    an SAE (then `top` is TOP_FEATURES) or one of these."""

    sae: SAE
    top: int = TOP_FEATURES


def feature_name(index: int) -> str:
    """A feature's sender name: `F{index}`, its row of W_dec."""
    return f"{FEATURE}{int(index)}"


def sender_names(chosen: list[int]) -> list[str]:
    """One side's senders (`qk` appends its `bias`): the features shown, other_features, b_dec, error."""
    return [feature_name(f) for f in chosen] + [OTHER, B_DEC, ERROR]


def reads(layer: int) -> str:
    """The hooks an SAE for layer `layer`'s heads may be at, said in words."""
    return f"blocks.{layer}.hook_resid_pre" + (f" (or blocks.{layer - 1}.hook_resid_post)" if layer > 0 else "")


def check_sae(model, layer: int, sae) -> Features:
    """`sae` (an SAE, a SAELens SAE, or `Features`) checked against the stream layer `layer`'s heads read, each
    refusal one line: a residual SAE at that stream, of the model's width."""
    spec = sae if isinstance(sae, Features) else Features(sae)
    if isinstance(spec.top, bool) or not isinstance(spec.top, int) or spec.top < 0:
        raise ValueError(f"Features(top=...): how many features to show on each side, 0 or more; got {spec.top!r}")
    sae = as_sae(spec.sae)
    hook = sae.cfg.hook_name
    if sae.cfg.hook_z:
        raise ValueError(f"this SAE reads attention's z ({hook or 'hook_z'}); layer {layer}'s heads read the residual "
                         f"stream at {reads(layer)}: QK attribution in features needs a residual SAE there")
    own = canonical(hook, getattr(model, "hook_aliases", {})) if hook else None
    wanted = {f"blocks.{layer}.hook_resid_pre"} | ({f"blocks.{layer - 1}.hook_resid_post"} if layer > 0 else set())
    if own not in wanted:
        said = f"is at {hook}" if hook else "names no hook (cfg.hook_name)"
        raise ValueError(f"this SAE {said}; layer {layer}'s heads read the residual stream at {reads(layer)}: "
                         "QK attribution in features needs an SAE there")
    if sae.cfg.d_in != model.cfg.d_model:
        raise ValueError(f"this SAE reads d_in={sae.cfg.d_in}, but the residual stream at {hook} has width "
                         f"d_model={model.cfg.d_model}: it was trained on another model")
    return Features(sae, spec.top)


@dataclass
class Stream:
    """The stream x [b, P, d] as the SAE writes it: coef [b, P, d_sae] (c_f, zero where f is off), const
    [b, P, d] (b_dec as decoded), error [b, P, d] (x - the reconstruction), W_dec [d_sae, d]; all in x's dtype
    and on its device."""

    coef: Tensor
    const: Tensor
    error: Tensor
    W_dec: Tensor


def _scale_out(sae: SAE, x: Tensor) -> tuple[Tensor | float, Tensor | float]:
    """The SAE's output normalisation at each position as (scale, offset): recons = (acts @ W_dec + b_dec) *
    scale + offset (SAELens's constant_norm_rescale and layer_norm; 1 and 0 for every other)."""
    how = sae.cfg.normalize_activations
    if how == "constant_norm_rescale":
        return 1 / ((sae.cfg.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)), 0.0
    if how == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        return (x - mu).std(dim=-1, keepdim=True), mu
    return 1.0, 0.0


@torch.no_grad()
def split_stream(sae: SAE, x: Tensor) -> Stream:
    """x [b, P, d] (the stream entering the head's layer) as the SAE writes it (see the module)."""
    xs = x.to(device=sae.device, dtype=sae.dtype)
    acts = sae.encode(xs)
    recons = sae.decode(acts)
    coef = acts
    if sae.cfg.architecture == "topk" and sae.cfg.rescale_acts_by_decoder_norm:
        coef = acts * (1 / sae.W_dec.norm(dim=-1))
    scale, offset = _scale_out(sae, xs)
    const = (sae.b_dec * scale + offset).expand_as(xs)
    to = dict(device=x.device, dtype=x.dtype)
    return Stream((coef * scale).to(**to), const.to(**to), (xs - recons).to(**to), sae.W_dec.detach().to(**to))


def sender_values(stream: Stream, chosen: list[int]) -> Tensor:
    """[len(chosen) + 3, b, P, d]: each chosen feature's c_f W_dec[f], the other features' sum, b_dec, error;
    they add up to the stream (to float round-off, which `qk`'s bias takes)."""
    idx = torch.as_tensor(chosen, dtype=torch.long, device=stream.coef.device)
    shown = stream.coef[..., idx, None] * stream.W_dec[idx]  # [b, P, T, d]
    rest = stream.coef.clone()
    rest[..., idx] = 0
    return torch.cat([shown.movedim(-2, 0), (rest @ stream.W_dec)[None], stream.const[None], stream.error[None]])


def active_rows(stream: Stream, D: Tensor, W: Tensor, r: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """At the positions (prompt r [M], position p [M]): the active features, as (owner [nnz]: the position each
    belongs to, in order; index [nnz]: the feature; rows [nnz, d_head]: its projection c_f D[f], D = W_dec @ W),
    and [3, M, d_head]: b_dec's and the error's projections by W, and zeros."""
    coef = stream.coef[r, p]  # [M, d_sae]
    owner, index = coef.nonzero(as_tuple=True)
    fixed = torch.stack([stream.const[r, p] @ W, stream.error[r, p] @ W])
    return owner, index, coef[owner, index, None] * D[index], torch.cat([fixed, torch.zeros_like(fixed[:1])])


def choose(mass: Tensor, top: int) -> list[int]:
    """The `top` features of largest `mass` [d_sae] (summed |term|), largest first; never one of mass 0."""
    order = mass.argsort(descending=True, stable=True)[:top]
    return [int(f) for f in order if float(mass[f]) > 0]
