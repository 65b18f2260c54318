"""Helpers shared by the analyzers: token batches, padding checks, tidy frames, progress bars.

Axis names follow `interp.models.config`: batch, pos, layer, head, kv_head, d_head, d_model.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

HeadList = Sequence[tuple[int, int]]


def token_batch(model, tokens) -> Tensor:
    """Token ids as an int tensor [batch, pos] on the model's device. Text (a string or a list of
    strings of one length) goes through the model's tokenizer with BOS per `model.cfg.default_prepend_bos`."""
    return model.prepare(tokens, padding=False).tokens


def token_input(model, tokens, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(token ids [batch, pos], attention mask) for analyzers that take a mask: texts of different
    lengths are padded on the right (positions are scored by index) and masked."""
    batch = model.prepare(tokens, attention_mask, padding_side="right")  # ids ignore the padding side
    return batch.tokens, batch.attention_mask


def valid_mask(tokens: Tensor, attention_mask: Tensor | None, *, right_padded_only: bool = False) -> Tensor:
    """bool [batch, pos], True for real tokens. With `right_padded_only`, left or inner padding raises."""
    if attention_mask is None:
        return torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    if tuple(attention_mask.shape) != tuple(tokens.shape):
        raise ValueError(
            f"attention_mask must be [batch, pos] = {tuple(tokens.shape)} like the tokens, got {tuple(attention_mask.shape)}"
        )
    valid = attention_mask.to(device=tokens.device, dtype=torch.bool)
    if right_padded_only and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError(
            "this analysis scores positions by their index (position 0 is the first token, as in "
            "TransformerLens), so it needs right padding: real tokens first, padding after. Re-pad the "
            "batch on the right (tokenizer.padding_side = 'right') or pass sequences of equal length."
        )
    return valid


def pair_mask(valid: Tensor) -> Tensor:
    """bool [batch, pos - 1]: next-token pairs (i, i + 1) where both are real tokens (what lm_loss averages)."""
    return valid[:, :-1] & valid[:, 1:]


def resolve_heads(n_layers: int, n_heads: int, heads) -> list[tuple[int, int]]:
    """(layer, head) pairs from None (all), a list of pairs, or {layer: [heads]}; checked against the model."""
    if heads is None:
        return [(l, h) for l in range(n_layers) for h in range(n_heads)]
    pairs = [(l, h) for l, hs in heads.items() for h in hs] if isinstance(heads, dict) else [tuple(x) for x in heads]
    for pair in pairs:
        if len(pair) != 2 or not (0 <= pair[0] < n_layers and 0 <= pair[1] < n_heads):
            raise ValueError(
                f"head {pair} is not a (layer, head) of this model ({n_layers} layers x {n_heads} heads); "
                "give heads as [(layer, head), ...] or {layer: [head, ...]}"
            )
    return sorted(set((int(l), int(h)) for l, h in pairs))


def head_frame(values: Tensor, value_name: str, **columns) -> pd.DataFrame:
    """A tidy frame from a [layer, head] tensor: columns layer, head, `value_name`, then `columns` (constants)."""
    n_layers, n_heads = values.shape
    frame = pd.DataFrame(
        {
            "layer": np.repeat(np.arange(n_layers), n_heads),
            "head": np.tile(np.arange(n_heads), n_layers),
            value_name: to_numpy(values.float().reshape(-1)),
        }
    )
    for name, value in columns.items():
        frame[name] = [value] * len(frame) if isinstance(value, (tuple, list)) else value
    return frame


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "", enabled: bool | None = None) -> Iterator:
    """tqdm over `iterable`. enabled=None shows the bar only on a terminal (tqdm's disable=None)."""
    if enabled is False:
        return iter(iterable)
    tqdm = auto_tqdm()
    return iter(tqdm(iterable, total=total, desc=desc, disable=None if enabled is None else False, leave=False))


def auto_tqdm():
    """`tqdm.auto.tqdm`, minus the "IProgress not found" warning it prints on import in a Jupyter
    kernel without ipywidgets (where it falls back to the plain bar, which is what we want there)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.auto import tqdm
    return tqdm


@contextlib.contextmanager
def frozen_params(model) -> Iterator[None]:
    """Turn off requires_grad on the model's parameters for the block (gradients w.r.t. activations
    only), restoring each flag afterwards."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def kv_group(model) -> int:
    """Query heads per key/value head (1 for MHA; GQA head h reads kv head h // group)."""
    return model.cfg.n_heads // model.cfg.kv_heads


def pearson(x: Tensor, y: Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = x.norm() * y.norm()
    return float("nan") if denom == 0 else float((x * y).sum() / denom)


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rho: Pearson on average ranks (ties share their mean rank)."""
    rank = lambda t: torch.tensor(pd.Series(to_numpy(t.double())).rank(method="average").to_numpy(dtype=float))
    return pearson(rank(x), rank(y))


def stages(timings: dict, log=print, prefix: str = "kv") -> Callable:
    """`stage(label, fn, key=label)`: says "{prefix}: {label} ...", runs fn, records its seconds in
    timings[key] and returns its result (a study's steps, each timed for its report: `study.run`)."""

    def stage(label: str, fn: Callable[[], object], key: str | None = None):
        log(f"{prefix}: {label} ...")
        start = time.perf_counter()
        result = fn()
        timings[label if key is None else key] = time.perf_counter() - start
        return result

    return stage
