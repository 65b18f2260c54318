"""Each feature's direct effect on the logits: its decoder row written into the residual stream and read by the
unembedding, with no layer between (the logit lens of a feature; Kissane et al. 2024 read attention features'
"direct logit effect" so, as Bricken et al. 2023 did for MLP features).

For an attention-output SAE (hook_z), the decoder row is a z: one d_head slice per head, each written into the
stream by its head's W_O,

    direction[f] = sum_h W_dec[f, h] @ W_O[layer, h]          [d_model]

(`model.W_O`: [n_layers, n_heads, d_head, d_model]); for a d_model-wide SAE (resid, attn_out, mlp_out) the row is
the direction itself. Then

    effect[f] = norm(direction[f]) @ W_U                      [d_vocab]

With `through_norm` (the default) `norm` is the final norm's linear part with its scale frozen: a LayerNorm's
centring (x - mean(x)) and its weight w, an RMSNorm's w (a sandwich-norm model's ln1_post weight too, for hook_z);
the division by the stream's norm is left out, a positive number at each position that scales every token's
effect alike and so changes no ranking, and the norm's bias and b_U are left out, the same for every feature.
Without it, `norm` is the identity (W_O then W_U alone, as TransformerLens's weight-processed models with
fold_ln read it). The top tokens are those the feature raises most, the bottom ones those it lowers most.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .site import check_width, site_of

LOGIT_COLUMNS = ("feature", "direction", "rank", "token", "token_text", "effect")
CHUNK = 512  # features per product with W_U: memory CHUNK x d_vocab floats


def _frozen_norm(model, directions: Tensor, norm_module) -> Tensor:
    """`directions` [F, d_model] through a norm's linear part (its scale frozen): LayerNorm centres, then w."""
    if norm_module is None or not hasattr(norm_module, "w"):
        return directions
    if hasattr(norm_module, "b"):  # a LayerNorm (interp's native norms: LayerNorm has w and b, RMSNorm w alone)
        directions = directions - directions.mean(-1, keepdim=True)
    return directions * norm_module.w.detach().float()


def feature_directions(model, sae, features: Tensor | None = None, *, through_norm: bool = True) -> Tensor:
    """[F, d_model]: each feature's decoder row as written into the residual stream (through W_O of each head for
    hook_z), then through the final norm's linear part when `through_norm` (see the module docstring)."""
    cfg = model.cfg
    site = site_of(sae.cfg.hook_name, cfg)
    check_width(site, sae.cfg.d_in, cfg)
    W_dec = sae.W_dec.detach().float()
    rows = W_dec if features is None else W_dec[features]
    if site.heads:
        W_O = model.W_O[site.layer].detach().float().to(rows.device)  # [n_heads, d_head, d_model]
        rows = torch.einsum("fhd,hdm->fm", rows.reshape(rows.shape[0], cfg.n_heads, cfg.d_head), W_O)
        post = getattr(model.blocks[site.layer], "ln1_post", None) if through_norm else None
        rows = _frozen_norm(model, rows, post)
    if through_norm:
        rows = _frozen_norm(model, rows, getattr(model, "ln_final", None))
    return rows


def logit_effect(model, sae, top: int = 10, *, features=None, through_norm: bool = True) -> pd.DataFrame:
    """Each feature's `top` most raised and most lowered tokens by its direct effect on the logits (the module
    docstring: the decoder row through W_O of each head for hook_z, the final norm's frozen linear part when
    `through_norm`, and W_U). One row per (feature, direction "top" | "bottom", rank): `LOGIT_COLUMNS`.
    `features`: the feature ids (all by default); computed CHUNK features at a time."""
    if int(top) < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    ids = torch.arange(sae.cfg.d_sae) if features is None else torch.as_tensor(features, dtype=torch.long)
    W_U = model.W_U.detach().float()
    k = min(int(top), W_U.shape[-1])
    parts = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK].to(sae.W_dec.device)
        effect = feature_directions(model, sae, chunk, through_norm=through_norm).to(W_U.device) @ W_U
        for direction, largest in (("top", True), ("bottom", False)):
            values, tokens = effect.topk(k, dim=-1, largest=largest)
            parts.append((direction, chunk, values, tokens))
    return _frame(model, parts, k)


def _frame(model, parts, k: int) -> pd.DataFrame:
    frames = []
    for direction, chunk, values, tokens in parts:
        frames.append(pd.DataFrame({
            "feature": to_numpy(chunk.repeat_interleave(k)), "direction": direction,
            "rank": to_numpy(torch.arange(k).repeat(len(chunk))), "token": to_numpy(tokens.reshape(-1)),
            "effect": to_numpy(values.reshape(-1))}))
    frame = pd.concat(frames, ignore_index=True)
    frame = frame.sort_values(["feature", "direction", "rank"], ascending=[True, False, True])
    strings = token_strings(model, frame["token"].unique())
    frame["token_text"] = frame["token"].map(strings)
    return frame[list(LOGIT_COLUMNS)].reset_index(drop=True)


def token_strings(model, ids) -> dict[int, str]:
    """{token id: its text} by the model's tokenizer (the id as text without one). A token that decodes to the
    replacement character alone (a byte of a longer UTF-8 sequence, which byte-level tokenizers hold) gets its id
    after it ("\ufffd#200"), so that two such tokens read apart."""
    ids = [int(i) for i in ids if int(i) >= 0]
    if getattr(model, "tokenizer", None) is None or not ids:
        return {i: str(i) for i in ids}
    texts = model.to_str_tokens(torch.tensor(ids)[:, None], prepend_bos=False)
    texts = [t[0] if isinstance(t, list) else str(t) for t in texts]
    return {i: f"{t}#{i}" if t == "\ufffd" else t for i, t in zip(ids, texts)}


__all__ = ["CHUNK", "LOGIT_COLUMNS", "feature_directions", "logit_effect", "token_strings"]
