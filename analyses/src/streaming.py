"""StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
the loss when every layer attends through a sliding window of the last `window` keys, without and
with the first `n_sink` tokens (the attention sinks) kept visible.

Positions, two ways (`positions=`):

* "cache" (as published): the rolling cache holds the n_sink sink tokens and the `window` most
  recent ones, keys cached *before* RoPE and rotated by their slot in the cache, so the sinks sit at
  the start of the positional range however long the stream is. With RoPE only the distance q - k
  matters, and for a window key that distance is the same as with the original positions; for a sink
  key s it is (n_sink + window - 1) - s once the cache is full (query position p >= n_sink + window - 1),
  instead of p - s. So the sink scores are recomputed with the query rotated to slot
  min(p, n_sink + window - 1); everything else is the ordinary forward. Exact, one forward per
  setting on the instrumented path (the [pos, pos] scores of one layer at a time). Rotary models only.
* "original": the query and keys keep their positions in the stream (our KV cache keeps keys after
  RoPE); past the trained context a sink is then further than the model ever saw, which is why
  window + sinks can be worse than the window alone there.

`window_eval` returns the mean loss and perplexity per setting (full attention, window, window + sinks,
per window), or with `per_position=True` the loss at every position (mean over the batch).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp.models import lm_loss
from interp.models.native.attention_layer import narrow_windows
from interp.kernels.attention import soft_cap

from ._common import token_batch, valid_mask

POSITIONS = ("cache", "original")


# Inside the block every layer attends through the smaller of its own window and `window` (None: the
# model as configured). An analysis narrows a model's windows, never widens them: "full attention" on
# a model with sliding windows (Mistral, Gemma's local layers) is that model, and its sink keys stay
# inside each layer's own window (`AttentionMask.visible`'s sink_limit).
sliding_window = narrow_windows


@torch.no_grad()
def streaming_loss(
    model, tokens: Tensor, window: int | None, n_sink: int = 0, *, chunk_size: int | None = None,
    attention_mask: Tensor | None = None, positions: Literal["cache", "original"] = "original",
) -> Tensor:
    """Per-token next-token loss [batch, pos - 1] when every layer attends through a window of
    `window` keys plus the first `n_sink` keys.

    positions="original": fed through a KV cache `chunk_size` tokens at a time (None: all at once;
    any chunking gives the same numbers, the mask being exact). positions="cache": StreamingLLM's
    re-numbering inside the rolling cache (module docstring); one forward, `chunk_size` unused."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    batch, n = tokens.shape
    valid = valid_mask(tokens, attention_mask)
    if positions == "cache" and window is not None and n_sink > 0:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("positions='cache' streams unpadded sequences; drop the padding or use positions='original'")
        hooks = (_cache_position_hooks if _needs_scores(model) else _cache_position_z_hooks)(model, window, n_sink)
        with sliding_window(model, window):
            logits = model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=attention_mask)
        return lm_loss(logits, tokens, valid, per_token=True)
    step = n if chunk_size is None else chunk_size
    cache = model.new_kv_cache(batch, n, n_sink=n_sink)
    with sliding_window(model, window):
        logits = [
            model(tokens[:, s : s + step], kv_cache=cache,
                  attention_mask=None if attention_mask is None else attention_mask[:, s : s + step])
            for s in range(0, n, step)
        ]
    return lm_loss(torch.cat(logits, dim=1), tokens, valid, per_token=True)


BLOCK = 256  # queries per block of the cache-position attention (`_cache_position_z_hooks`)


def _keeper(model, seen: dict):
    """For the cache-position hooks: refuse a model without rotary positions (nothing to re-number), and
    return `keep(name)`, a hook that files its activation in `seen` under (layer, name)."""
    if model.rotary is None:
        raise NotImplementedError(
            f"positions='cache' re-numbers rotary positions inside the cache; this model's positions are "
            f"{model.cfg.positional!r}. Use positions='original'.")

    def keep(name):
        def hook(x: Tensor, hook) -> None:
            seen[(hook.name.split(".")[1], name)] = x
        return hook

    return keep


def _needs_scores(model) -> bool:
    """Whether the cache positions need the whole [pos, pos] scores (`_cache_position_hooks`): a model with
    learned sink logits (gpt-oss) has a softmax term the z hooks do not write out."""
    return any(getattr(b.attn, "sinks", None) is not None for b in model.blocks)


def _cache_position_z_hooks(model, window: int, n_sink: int) -> list:
    """StreamingLLM's cache positions without the [pos, pos] scores: the model runs its fused path through
    the window alone (cheap, banded), and each layer's z is replaced by the attention the rolling cache
    gives, written out in blocks of BLOCK queries: the sink keys scored with the query rotated to slot
    min(p, n_sink + window - 1) (against the rotated sink keys, as `_cache_position_hooks` does), the keys
    n_sink <= j in the layer's window scored as usual, one softmax over both, in float32 (times the output
    gate read at `hook_attn_gate`, where the layer has one). O(pos x (BLOCK +
    window)) per head, where the score hooks cost O(pos^2) on the instrumented path (the two agree to
    float32 round-off: tests/analyses/test_sinks.py, tests/models/families/test_gemma3.py)."""
    seen: dict = {}
    keep = _keeper(model, seen)

    def z_hook(z: Tensor, hook) -> Tensor:  # [batch, pos, head, d_head]
        layer = hook.name.split(".")[1]
        l = int(layer)
        q0, q, k, v = (seen.pop((layer, name)) for name in ("q0", "q", "k", "v"))
        attn = model.blocks[l].attn
        b, n, h, _ = q.shape
        group = h // k.shape[2]
        w, own = attn.window, model.cfg.window(l)  # the narrowed window; the layer's own (its sinks' limit)
        p = torch.arange(n, device=q.device)
        cos, sin = model.rotary.cos_sin(p.clamp(max=n_sink + window - 1)[None].expand(b, n), q.dtype, layer=l)
        heads = lambda x: x.transpose(1, 2).repeat_interleave(group, dim=1).float()  # noqa: E731 - [b, h, pos, dh]
        q_slot = attn.rotate(q0, cos, sin).transpose(1, 2).float()
        q, k, v = q.transpose(1, 2).float(), heads(k), heads(v)
        ns = min(n_sink, n)

        def scored(x: Tensor) -> Tensor:
            x = x * attn.scale
            return x if attn.softcap is None else soft_cap(x, attn.softcap)

        sink = scored(q_slot @ k[:, :, :ns].transpose(-1, -2))  # [b, h, pos, ns]
        delta = p[:, None] - torch.arange(ns, device=q.device)[None]
        sink = sink.masked_fill(~((delta >= 0) if own is None else (delta >= 0) & (delta < own)), float("-inf"))
        out = torch.empty_like(q)
        for c in range(0, n, BLOCK):
            e = min(c + BLOCK, n)
            lo = max(ns, c - w + 1)
            band = scored(q[:, :, c:e] @ k[:, :, lo:e].transpose(-1, -2))
            d = p[c:e, None] - torch.arange(lo, e, device=q.device)[None]
            band = band.masked_fill(~((d >= 0) & (d < w)), float("-inf"))
            a = torch.cat([sink[:, :, c:e], band], -1).softmax(-1)
            out[:, :, c:e] = a[..., :ns] @ v[:, :, :ns] + a[..., ns:] @ v[:, :, lo:e]
        out = out.transpose(1, 2)
        gate = seen.pop((layer, "gate"), None)  # gated attention: hook_z holds z * gate, and so must this
        return (out if gate is None else out * gate).to(z.dtype)

    query = "attn.hook_q_normed" if model.cfg.qk_norm else "attn.hook_q"  # what RoPE rotates
    hooks = []
    for l in range(model.cfg.n_layers):
        hooks += [(f"blocks.{l}.{query}", keep("q0")), (f"blocks.{l}.attn.hook_rot_q", keep("q")),
                  (f"blocks.{l}.attn.hook_rot_k", keep("k")), (f"blocks.{l}.attn.hook_v", keep("v")),
                  (f"blocks.{l}.attn.hook_z", z_hook)]
        if hasattr(model.blocks[l].attn, "hook_attn_gate"):  # the output gate (`attn_output_gate`), before hook_z
            hooks.append((f"blocks.{l}.attn.hook_attn_gate", keep("gate")))
    return hooks


def _cache_position_hooks(model, window: int, n_sink: int) -> list:
    """Hooks that give the sink keys StreamingLLM's in-cache distance: per layer, keep the query
    before RoPE and the rotated keys, and overwrite the sink columns of the (masked) scores with
    the query rotated to slot min(p, n_sink + window - 1) against the sink keys.

    The query kept is the one RoPE rotates: after QK-norm where the model has it (`hook_q_normed`,
    Gemma 3), else `hook_q`; it is rotated with its layer's own table (`cos_sin(..., layer=)`: Gemma 3's
    local and global layers have different RoPE bases)."""
    group = model.cfg.n_heads // model.cfg.kv_heads
    seen: dict = {}
    keep = _keeper(model, seen)

    def scores(s: Tensor, hook) -> Tensor:  # [batch, head, q, k], -inf where not visible
        layer = hook.name.split(".")[1]
        q, k = seen.pop((layer, "q")), seen.pop((layer, "k"))  # [b, pos, h, dh], [b, pos, kv, dh] (rotated)
        b, n = q.shape[:2]
        p = torch.arange(n, device=q.device)
        slot = p.clamp(max=n_sink + window - 1)
        cos, sin = model.rotary.cos_sin(slot[None].expand(b, n), q.dtype, layer=int(layer))
        attn = model.blocks[int(layer)].attn
        q_slot = attn.rotate(q, cos, sin).transpose(1, 2)  # [b, h, pos, dh]; the layer's rotary layout
        k_sink = k[:, :n_sink].transpose(1, 2).repeat_interleave(group, dim=1)  # [b, h, n_sink, dh]
        sink = torch.matmul(q_slot, k_sink.transpose(-1, -2)).float() * attn.scale
        if attn.softcap is not None:  # the scores hooked are soft-capped (Gemma 2): so are these
            sink = soft_cap(sink, attn.softcap)
        delta = p[:, None] - torch.arange(min(n_sink, n), device=q.device)[None]  # [pos, n_sink]
        own = model.cfg.window(int(layer))  # a sink outside the layer's own window stays invisible
        visible = (delta >= 0) if own is None else (delta >= 0) & (delta < own)
        s = s.clone()
        s[..., :n_sink] = torch.where(visible, sink, float("-inf"))
        return s

    query = "attn.hook_q_normed" if model.cfg.qk_norm else "attn.hook_q"  # what RoPE rotates
    hooks = []
    for l in range(model.cfg.n_layers):
        hooks += [(f"blocks.{l}.{query}", keep("q")), (f"blocks.{l}.attn.hook_rot_k", keep("k")),
                  (f"blocks.{l}.attn.hook_attn_scores", scores)]
    return hooks


def window_eval(
    model, tokens, window: int | Sequence[int], n_sink: int = 4, *, chunk_size: int | None = None,
    attention_mask: Tensor | None = None, positions: Literal["cache", "original"] = "cache",
    per_position: bool = False,
) -> pd.DataFrame:
    """StreamingLLM's comparison (Xiao et al. 2023, Fig. 3): next-token loss with full attention,
    with a sliding window of `window` keys ("window"), and with the window plus the first `n_sink`
    tokens ("window+sink"), for each window given.

    Returns one row per setting: setting, window, n_sink, positions, loss, perplexity, n_tokens,
    chunk_size; with per_position=True one row per (setting, window, position) with the loss of
    predicting token position+1 (mean over the batch's real tokens)."""
    tokens = token_batch(model, tokens)
    windows = [window] if isinstance(window, int) else list(window)
    if any(w < 1 for w in windows) or n_sink < 0:
        raise ValueError(f"windows must be >= 1 and n_sink >= 0, got window={window}, n_sink={n_sink}")
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
    n = tokens.shape[1]
    if any(w >= n for w in windows):
        raise ValueError(f"window {max(windows)} is not smaller than the {n}-token sequences: every key would be "
                         f"inside it; use windows < {n} or longer sequences")
    valid = valid_mask(tokens, attention_mask)
    pairs = valid[:, :-1] & valid[:, 1:]
    settings = [("full", None, 0)] + [(name, w, s) for w in windows for name, s in (("window", 0), ("window+sink", n_sink))]
    rows = []
    for name, w, s in settings:
        nll = streaming_loss(model, tokens, w, s, chunk_size=chunk_size, attention_mask=attention_mask,
                             positions=positions)
        if per_position:
            per = (nll * pairs).sum(0) / pairs.sum(0).clamp(min=1)
            rows += [dict(setting=name, window=w, n_sink=s, positions=positions, position=i, loss=float(v))
                     for i, v in enumerate(per.tolist())]
            continue
        loss = float(nll[pairs].sum() / pairs.sum())
        rows.append(dict(setting=name, window=w, n_sink=s, positions=positions, loss=loss, perplexity=math.exp(loss),
                         n_tokens=int(pairs.sum()), chunk_size=chunk_size))
    return pd.DataFrame(rows)
