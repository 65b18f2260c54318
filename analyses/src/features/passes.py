"""One streamed pass over a corpus for every per-feature measure: each batch of tokens runs the model to the SAE's
site (fused attention, stopped after that block), the SAE encodes the activation there, and each consumer takes
(first document, tokens, activation, feature activations) and keeps only its running sums. Nothing of a batch is
kept past it, so memory is one batch plus what the consumers hold (`Activity`: three numbers a feature; the
attribution's sums: d_in a feature; `contexts.RunningTopK`: k contexts a feature).
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import Tensor

from .site import Site, site_of, stream


class Consumer(Protocol):
    def update(self, first: int, tokens: Tensor, x: Tensor, acts: Tensor) -> None:
        """first: the batch's first document index; tokens [b, pos]; x: the activation at the site; acts
        [b, pos, d_sae] float32 (the SAE's own `encode`)."""


def encode(sae, x: Tensor) -> Tensor:
    """The SAE's feature activations of `x` (the site's activation: hook_z's [..., n_heads, d_head] is flattened by
    the SAE itself), float32 [..., d_sae]."""
    dtype = sae.W_enc.dtype
    return sae.encode(x.to(dtype)).float()


@torch.no_grad()
def feature_pass(model, sae, token_batches: Iterable[Tensor], consumers: Iterable[Consumer],
                 site: Site | None = None) -> None:
    """Stream `token_batches` (each [b, pos] ids, or texts of one length) through the model and the SAE once,
    handing each batch to every consumer."""
    site = site or site_of(sae.cfg.hook_name, model.cfg)
    consumers = list(consumers)
    for first, tokens, x in stream(model, token_batches, site):
        acts = encode(sae, x)
        for consumer in consumers:
            consumer.update(first, tokens, x, acts)


class Activity:
    """How often and how strongly each feature fires: positions seen, and per feature the positions where it is
    active (activation > 0), the sum and the largest of its activations."""

    def __init__(self, d_sae: int, device) -> None:
        self.positions = 0
        self.active = torch.zeros(d_sae, device=device)
        self.total = torch.zeros(d_sae, device=device)
        self.largest = torch.zeros(d_sae, device=device)

    def update(self, first: int, tokens: Tensor, x: Tensor, acts: Tensor) -> None:
        flat = acts.reshape(-1, acts.shape[-1])
        self.positions += flat.shape[0]
        self.active += (flat > 0).sum(0)
        self.total += flat.clamp(min=0).sum(0)
        self.largest = torch.maximum(self.largest, flat.max(0).values)


__all__ = ["Activity", "Consumer", "encode", "feature_pass"]
