"""Gradient-based head importance: Michel et al. (2019) and attribution patching.

* Michel, Levy & Neubig (2019), "Are Sixteen Heads Really Better than One?", Sec. 4.1: a gate
  xi_h = 1 multiplies each head's output z_h; the importance of head h is
      I_h = E_x | dL(x) / d xi_h |
  (x a sequence, L(x) its mean next-token cross-entropy), normalised per layer by the L2 norm of the
  layer's scores (their Sec. 4.2, after Molchanov et al. 2017). One forward and backward give it for
  every head: the gates carry a batch axis, xi [batch, layer, head], so each sequence's gradient is
  its own.
* Attribution patching (Nanda 2023, "Attribution Patching: Activation Patching At Industrial
  Scale"; Syed et al. 2023): the first-order estimate of ablating head h,
      delta_h ~= sum_{batch, pos} (z_ablated - z_clean)_h . dL/dz_h
  with L the dataset's mean cross-entropy, the same quantity `ablate_heads` measures exactly; its
  Pearson and Spearman correlation with the exact sweep are reported.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from ._common import HeadList, frozen_params, head_frame, pair_mask, pearson, spearman, token_input, valid_mask
from .ablation import Method, ablate_heads, ablation_values


def gated_gradients(
    model, tokens: Tensor, *, valid: Tensor, attention_mask: Tensor | None = None,
    pruned: HeadList = (), values: dict[int, Tensor] | None = None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One forward and backward through head gates.

    Heads in `pruned` have their z replaced by `values[layer]` (zero when None) and get no gradient.
    Returns (dL_seq/dxi [batch, layer, head] for each sequence's own mean loss, z per layer
    [batch, pos, head, d_head] (clean, or pruned-replaced), dL_mean/dz per layer for the dataset mean loss)."""
    cfg = model.cfg
    b = tokens.shape[0]
    by_layer: dict[int, list[int]] = {}
    for l, h in pruned:
        by_layer.setdefault(l, []).append(h)
    xi = torch.ones(b, cfg.n_layers, cfg.n_heads, device=model.device, dtype=model.dtype, requires_grad=True)
    zs: list[Tensor] = [None] * cfg.n_layers  # type: ignore[list-item]

    def gate(z: Tensor, hook) -> Tensor:
        l = int(hook.name.split(".")[1])
        if l in by_layer:
            z = z.clone()
            heads = by_layer[l]
            z[:, :, heads] = 0.0 if values is None else values[l][:, :, heads].to(z.device, z.dtype).expand(z.shape[0], z.shape[1], -1, -1)
        zg = z * xi[:, l, None, :, None].to(z.device)  # the layer's device (a model split by device_map)
        zs[l] = zg
        return zg

    hooks = [(f"blocks.{l}.attn.hook_z", gate) for l in range(cfg.n_layers)]
    with frozen_params(model), torch.enable_grad(), model.hooks(hooks):
        nll = model(tokens, return_type="loss", loss_per_token=True, attention_mask=attention_mask)
        pairs = pair_mask(valid).to(nll.device, nll.dtype)
        per_seq = nll.sum(1) / pairs.sum(1).clamp(min=1)
        # One backward serves both: sequences do not interact, so the gradient of the dataset mean at
        # sequence b's z is that of its own mean scaled by its share of the pairs.
        grad_xi, *grad_z = torch.autograd.grad(per_seq.sum(), [xi, *zs])
        share = (pairs.sum(1).clamp(min=1) / pairs.sum()).to(grad_z[0].dtype)[:, None, None, None]
    return grad_xi, [z.detach() for z in zs], [g * share.to(g.device) for g in grad_z]


def michel_importance(grad_xi: Tensor, normalize: bool = True) -> Tensor:
    """[layer, head]: E_x |dL(x)/dxi_h| from per-sequence gate gradients [batch, layer, head],
    divided per layer by its L2 norm when `normalize`."""
    imp = grad_xi.abs().mean(0)
    if normalize:
        imp = imp / imp.norm(dim=-1, keepdim=True).clamp(min=1e-20)
    return imp


def attribution_estimates(zs: list[Tensor], grads: list[Tensor], values: dict[int, Tensor]) -> Tensor:
    """[layer, head]: sum over batch and positions of (z_ablated - z) . dL/dz per head."""
    return torch.stack([((values[l].to(z.device, z.dtype) - z) * g).sum((0, 1, 3)).to(zs[0].device)
                        for l, (z, g) in enumerate(zip(zs, grads))])


def head_importance(
    model,
    tokens,
    normalize: bool = True,
    *,
    method: Method = "mean",
    compare_exact: bool = True,
    attention_mask: Tensor | None = None,
    seed: int = 0,
    heads_per_batch: int | None = None,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Michel et al.'s importance and attribution patching's ablation estimate for every head.

    tokens [batch, pos]; `method` is the ablation the attribution estimates ("mean", "zero",
    "resample", as in `ablate_heads`). With `compare_exact`, the exact sweep runs too.

    Returns layer, head, importance (normalised per layer when `normalize`), importance_raw,
    attribution, [ablation_delta], method, normalize. With `compare_exact`, `.attrs` holds
    "pearson" and "spearman": the correlation of attribution with the exact ablation_delta."""
    tokens, attention_mask = token_input(model, tokens, attention_mask)
    valid = valid_mask(tokens, attention_mask)
    values = ablation_values(model, tokens, method, valid=valid, seed=seed, attention_mask=attention_mask)
    grad_xi, zs, grads = gated_gradients(model, tokens, valid=valid, attention_mask=attention_mask)
    frame = head_frame(michel_importance(grad_xi, normalize), "importance")
    frame["importance_raw"] = head_frame(michel_importance(grad_xi, False), "x")["x"]
    frame["attribution"] = head_frame(attribution_estimates(zs, grads, values), "x")["x"]
    if compare_exact:
        exact = ablate_heads(model, tokens, method, attention_mask=attention_mask, seed=seed,
                             heads_per_batch=heads_per_batch, progress=progress)
        frame["ablation_delta"] = exact["delta"].to_numpy()
        frame.attrs.update(attribution_correlation(frame))
    return frame.assign(method=method, normalize=normalize)


def attribution_correlation(frame: pd.DataFrame, x: str = "attribution", y: str = "ablation_delta") -> dict[str, float]:
    """Pearson and Spearman correlation between two columns (default: estimate vs exact ablation)."""
    a, b = torch.tensor(frame[x].to_numpy(dtype=float)), torch.tensor(frame[y].to_numpy(dtype=float))
    return {"pearson": pearson(a, b), "spearman": spearman(a, b)}
