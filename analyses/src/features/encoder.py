"""An SAE's encoder before its activation function, as a linear map of its input: what splits a feature's
pre-activation exactly by head.

SAELens's encoders (`sae_lens/saes/*.py`), with `sae_in = norm_in(x) - b_dec * apply_b_dec_to_input`:

    standard   acts = relu(sae_in @ W_enc + b_enc)                pre-activation: sae_in @ W_enc + b_enc
    topk       acts = topk(sae_in @ W_enc + b_enc) (relu'd)       the same (hook_sae_acts_pre; a decoder-norm
                                                                  rescale comes after the hook)
    jumprelu   acts = jumprelu(sae_in @ W_enc + b_enc, threshold)  the same
    gated      acts = 1[sae_in @ W_enc + b_gate > 0] * relu(sae_in @ (W_enc * exp(r_mag)) + b_mag)
               the gate's pre-activation sae_in @ W_enc + b_gate is what decides whether the feature fires: it is
               the one attributed (the magnitude's is the same head terms times exp(r_mag), plus b_mag)

`norm_in` is the identity for normalize_activations "none"; "expected_average_only_in" is a constant scale that
SAELens folds into W_enc and b_dec when it loads the SAE (`fold_activation_norm_scaling_factor`), so at inference it
is the identity too (in SAELens's SAE and in `interp.models.saes.SAE`): the split reads W_enc as encode uses it, the
scale already in it; so is "covariance_whitening" (folded before saving). "constant_norm_rescale" (x * sqrt(d_in) /
|x|) and "layer_norm" ((x - mean) / std) divide by a statistic of the whole input at each position, so the
pre-activation is not linear in x and does not split by head: refused in one line. With the input linear, for an
attention-output SAE (x = z flattened, head-major):

    pre[f] = sum_h z_h @ W_enc[h * d_head:(h + 1) * d_head, f]  +  (bias[f] - (b_dec * apply) @ W_enc[:, f])
             \\_______________ head h's term _______________/     \\____________ the constant ____________/
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
NONLINEAR_NORMS = {
    "constant_norm_rescale": "scales each input to norm sqrt(d_in), dividing by its own norm",
    "layer_norm": "centres each input and divides it by its own standard deviation",
}


@dataclass(frozen=True)
class Encoder:
    """The linear part of an SAE's encoder, in float32: pre = (x - centre) @ W + bias.

    W [d_in, d_sae] (W_enc), centre [d_in] (b_dec * apply_b_dec_to_input), bias [d_sae] (b_enc, or a gated SAE's
    b_gate); `kind`: "pre" (what hook_sae_acts_pre sees) or "gate" (a gated SAE's gate pre-activation)."""

    W: Tensor
    centre: Tensor
    bias: Tensor
    kind: str

    @property
    def constant(self) -> Tensor:
        """[d_sae]: the part of every pre-activation that no input moves, bias - centre @ W."""
        return self.bias - self.centre @ self.W

    def pre(self, x: Tensor) -> Tensor:
        """[..., d_sae]: the pre-activation of inputs [..., d_in], computed whole (not by head)."""
        return (x.float() - self.centre) @ self.W + self.bias

    def head_terms(self, z: Tensor, features: Tensor | None = None) -> Tensor:
        """[..., n_heads, F]: each head's term z_h @ W[h rows] of the pre-activation, from z [..., n_heads,
        d_head] (`features`: the columns F to keep; all by default)."""
        n_heads, d_head = z.shape[-2:]
        W = self.W.view(n_heads, d_head, -1)
        if features is not None:
            W = W[..., features]
        return torch.einsum("...hd,hdf->...hf", z.float(), W)


def refusal(cfg) -> str | None:
    """Why an SAE's pre-activation does not split by head (None: it does): an architecture other than SAELens's
    four, or an input normalisation that is not linear."""
    arch = str(getattr(cfg, "architecture", "standard"))
    if arch not in ARCHITECTURES:
        return (f"its architecture is {arch!r}; the head split is written for {', '.join(ARCHITECTURES)} (an encoder "
                "linear in its input before the activation)")
    norm = str(getattr(cfg, "normalize_activations", "none") or "none")
    if norm in NONLINEAR_NORMS:
        return (f"its normalize_activations is {norm!r}, which {NONLINEAR_NORMS[norm]} at each position: the "
                "pre-activation is then not linear in the heads' outputs and does not split by head")
    return None


def linear_encoder(sae) -> Encoder:
    """The SAE's `Encoder` (float32, on its device), or one line (ValueError, `refusal`) for one whose
    pre-activation is not linear in its input."""
    why = refusal(sae.cfg)
    if why is not None:
        raise ValueError(f"the SAE at {sae.cfg.hook_name} cannot be split by head: {why}")
    W = sae.W_enc.detach().float()
    centre = sae.b_dec.detach().float() * float(bool(sae.cfg.apply_b_dec_to_input))
    gated = str(sae.cfg.architecture) == "gated"
    bias = (sae.b_gate if gated else sae.b_enc).detach().float()
    return Encoder(W=W, centre=centre, bias=bias, kind="gate" if gated else "pre")


__all__ = ["ARCHITECTURES", "Encoder", "NONLINEAR_NORMS", "linear_encoder", "refusal"]
