"""Where an SAE reads: its hook point, the layer, what the activation there is, and the model's activations there,
batch by batch, with the attention fused (no pattern is asked for).

Two kinds of site:

- "z": `blocks.L.attn.hook_z`, the heads' mixed values [batch, pos, n_heads, d_head] (after an output gate, before
  W_O), which an attention-output SAE reads with the heads flattened, head-major (`"... h d -> ... (h d)"`, as
  SAELens trains them): d_in = n_heads * d_head, and the rows h * d_head .. (h + 1) * d_head of W_enc (and columns
  of W_dec) belong to head h. Every table of the features study is made for it.
- "resid": a d_model-wide activation, `blocks.L.hook_resid_pre`, `hook_resid_mid`, `hook_resid_post`,
  `hook_attn_out`, `hook_mlp_out`. Its features have contexts and a direct effect on the logits (a decoder row is a
  direction in the residual stream), but no heads: the head tables are made for "z" only.

Any other hook (queries, keys, an MLP's hidden layer, ...) is refused in one line: its decoder rows are neither
split by head nor read by the unembedding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

import torch
from torch import Tensor

RESID_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
_NAME = re.compile(r"blocks\.(\d+)\.(attn\.hook_z|" + "|".join(RESID_HOOKS) + r")")


@dataclass(frozen=True)
class Site:
    """An SAE's hook point: `hook_name`, its `layer`, and `kind` ("z": an attention output, split by head;
    "resid": d_model wide)."""

    hook_name: str
    layer: int
    kind: Literal["z", "resid"]

    @property
    def heads(self) -> bool:
        """Whether the activation splits by head (an attention-output SAE)."""
        return self.kind == "z"


def site_of(hook_name: str, cfg) -> Site:
    """The site of `hook_name` on a model of config `cfg` (read without weights), or one line (ValueError): a hook
    the study does not read, a layer past the model, a hook this model lacks (an attention-only model has no
    hook_mlp_out nor hook_resid_mid; a parallel block no hook_resid_mid)."""
    m = _NAME.fullmatch(str(hook_name))
    if m is None:
        raise ValueError(f"the SAE reads {hook_name!r}: the features study reads an attention output "
                         "(blocks.L.attn.hook_z, split by head) or a d_model-wide activation (blocks.L." +
                         ", blocks.L.".join(RESID_HOOKS) + ")")
    layer, name = int(m.group(1)), m.group(2)
    if layer >= cfg.n_layers:
        raise ValueError(f"the SAE reads {hook_name}, layer {layer}, and this model has {cfg.n_layers} layers "
                         f"(0 .. {cfg.n_layers - 1}): an SAE of another model?")
    no_mlp = bool(getattr(cfg, "attn_only", False))
    if name == "hook_mlp_out" and no_mlp or name == "hook_resid_mid" and (no_mlp or cfg.parallel_attn_mlp):
        why = "is attention-only" if no_mlp else "computes attention and MLP in parallel"
        raise ValueError(f"the SAE reads {hook_name}, and this model {why}: it has no {name}")
    return Site(str(hook_name), layer, "z" if name == "attn.hook_z" else "resid")


def check_width(site: Site, d_in: int, cfg) -> None:
    """The SAE's d_in against the model's activation at the site (one line, ValueError): n_heads * d_head for
    hook_z (the heads flattened), d_model otherwise."""
    if site.heads:
        width, what = cfg.n_heads * cfg.d_head, f"n_heads * d_head = {cfg.n_heads} * {cfg.d_head}"
    else:
        width, what = cfg.d_model, "d_model"
    if int(d_in) != width:
        raise ValueError(f"the SAE's d_in is {d_in} and {site.hook_name} of this model is {width} wide ({what}): "
                         "an SAE of another model?")


def batches(tokens: Tensor, batch_size: int) -> Iterator[Tensor]:
    """[batch_size, pos] row blocks of `tokens` [n, pos] (the last one shorter)."""
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start:start + batch_size]


@torch.no_grad()
def activations(model, tokens: Tensor, site: Site) -> Tensor:
    """The model's activation at `site` on `tokens` [batch, pos]: [batch, pos, n_heads, d_head] for hook_z,
    [batch, pos, d_model] otherwise. The forward stops after the site's block and runs fused (no pattern)."""
    _, cache = model.run_with_cache(tokens, names_filter=[site.hook_name], stop_at_layer=site.layer + 1)
    return cache[site.hook_name]


def stream(model, token_batches: Iterable[Tensor], site: Site) -> Iterator[tuple[int, Tensor, Tensor]]:
    """(the first row's document index, tokens [batch, pos], activation) for each batch of `token_batches`, one
    batch in memory at a time; documents are numbered by row across the batches."""
    first = 0
    for tokens in token_batches:
        tokens = model.prepare(tokens, padding=False).tokens
        yield first, tokens, activations(model, tokens, site)
        first += tokens.shape[0]


__all__ = ["RESID_HOOKS", "Site", "activations", "batches", "check_width", "site_of", "stream"]
