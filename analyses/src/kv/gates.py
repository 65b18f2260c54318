"""DuoAttention's per-KV-head gates (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM
Inference with Retrieval and Streaming Heads"): one scalar gate alpha in [0, 1] per (layer, KV head),
learned with the model frozen, that says how much of a head's output needs the whole context.

Gated attention. Every query head's output z [batch, pos, head, d_head] becomes

    z = alpha * z_full + (1 - alpha) * z_stream

where z_full is the model's own attention and z_stream the same head attending only to the first S
keys (sinks) and the last W (window): query i sees key j <= i iff j < S or i - j < W, the rule of
`interp.models.kv.policies.Streaming` (keys keep their positions, as in `PolicyKVCache`). A layer with
a window of its own (Mistral, Gemma's local layers, or one narrowed by `narrow_windows`) keeps it in
both branches. The query heads of one KV head share its gate (GQA: query head h reads KV head
h // (heads / kv_heads)). alpha = 1 is the full model, alpha = 0 a streaming head.

    with gated_attention(model, gates, sinks=4, window=128):    # gates: [n_layers, kv_heads]
        logits = model(tokens)

It is built on the model's hook points, nothing else: `hook_rot_q` / `hook_rot_k` (rotary models;
`hook_q` / `hook_k` otherwise) and `hook_v` are read, and `hook_z` returns the mix, the streaming
branch computed there with torch SDPA under a boolean mask and the layer's `attn.scale` (explicitly, with a
learned sink logit per head in each softmax, where the layer has them) and, where the layer gates its heads'
outputs (`attn_output_gate`), multiplied by the gate read at `hook_attn_gate`, as z_full is. Gradients
reach the gates (and everything upstream) through both branches. Limits: whole sequences only (a
forward given a `kv_cache`, or an `attention_mask` with padding, raises: the streaming branch sees
neither; texts of different lengths, padded inside the forward, are not caught), no ALiBi (refused).

Training (`train_gates`), as DuoAttention's: the gates start at 1; each step runs one sample (one
prompt, or one row of a token batch; samples cycle in a seeded order) through the frozen model with
gated attention and compares the output of the final norm (`ln_final`, the hidden states right before
the unembedding: DuoAttention's `model.model(...)[0]` in Hugging Face's Llama) with the full model's:

    loss = MSE(distilled, full) + l1 * mean(|alpha|)

The MSE is the mean over d_model and over the scored positions: for retrieval prompts
(`interp.analyses.kv.tasks.retrieval_prompts`, DuoAttention's synthetic passkey data) the positions after
the needle's key (`key_span[1]` to the end: the rest of the needle, the filler after it and the
question), where a streaming head has lost the key once it is W tokens back; for a plain token batch
every position. Adam over the gates alone; after every step they are clamped to [0, 1] (DuoAttention
clamps the same way), so L1's pull toward 0 (streaming) is held back only by the heads the
distillation needs. The full model's hidden states are computed once per sample and kept.

    result = train_gates(model, retrieval_prompts(model, [1024], [0.2, 0.5, 0.8], 4, seed=0),
                         sinks=4, window=128, steps=200, time_budget_s=180)
    result.gates            # float32 [n_layers, kv_heads] in [0, 1]
    result.curve            # per step: step, total, distill, l1 (the weighted penalty), mean_gate, seconds
    gate_table(result)      # layer, kv_head, gate

While every gate is 1 (step 1) the gated model is the full model bit for bit, so the distillation
term and its gradient are exactly 0 and that step runs no forward: it only moves every gate down by
Adam's first step (lr). `time_budget_s` stops training before a step that the slowest step so far
says would overrun it (at least one step always runs; the first step after the free one may still
overrun). A NaN or infinite loss raises `FloatingPointError`.

Caching: `train_gates(..., cache_dir="gates-cache")` looks for a file keyed by the model (its loaded
name, config and a checksum of its weights), the settings (sinks, window, steps, lr, l1, seed, time
budget) and the samples (their token ids and scored positions) and returns it when present
(`result.from_cache`), else trains and writes it. `save_gates(result, path)` / `load_gates(path)` read
and write the same JSON by hand.

Bad input (gates of the wrong shape, not finite or outside [0, 1]; sinks < 0; window < 1; steps < 1;
lr <= 0; l1 < 0; a time budget <= 0; no samples; prompts no longer than sinks + window, where
streaming is full attention; an ALiBi model) raises `BadValue` before any work.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from interp.kernels.attention import with_sink_column
from interp.kernels.visibility import visible
from interp.models.placement.device import to_numpy
from interp.errors import BadValue, check_int, check_real

from .._common import frozen_params, kv_group, progress, token_batch
from .tasks import RetrievalPrompt

TARGET = "ln_final"  # the hidden states matched: the final norm's output, right before the unembedding
CURVE_COLUMNS = ["step", "total", "distill", "l1", "mean_gate", "seconds"]
FORMAT = 1  # the cache file's layout


@dataclass(frozen=True, eq=False)
class GateResult:
    """What `train_gates` learned. gates: float32 [n_layers, kv_heads] on the CPU, in [0, 1];
    curve: one row per step (CURVE_COLUMNS; `l1` is the weighted penalty, total = distill + l1;
    `seconds` counts from the start); steps: steps done; seconds: the training's wall time;
    settings: what produced it (sinks, window, lr, l1, seed, ..., target, positions, cache key)."""

    gates: Tensor
    curve: pd.DataFrame
    steps: int
    seconds: float
    settings: dict = field(default_factory=dict)
    from_cache: bool = False


# ---- checks ------------------------------------------------------------------------------------
def _check_streaming(sinks, window) -> tuple[int, int]:
    sinks = check_int("sinks", sinks, minimum=0, hint="the count of first tokens a streaming head keeps")
    window = check_int("window", window, minimum=1, hint="a streaming head sees the query and the window - 1 before it")
    return sinks, window


def _check_model(model) -> None:
    if model.cfg.positional == "alibi":
        raise BadValue("gated attention computes the streaming branch without ALiBi's distance biases; "
                       "this model uses ALiBi, so its gates cannot be trained here")
    if model.cfg.attn_scores_soft_cap is not None:
        raise BadValue("gated attention computes the streaming branch with SDPA, which cannot soft-cap scores; "
                       "this model soft-caps them (Gemma 2), so its gates cannot be trained here")


def _check_gates(model, gates) -> Tensor:
    shape = (model.cfg.n_layers, model.cfg.kv_heads)
    if not isinstance(gates, Tensor):
        try:
            gates = torch.as_tensor(gates, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise BadValue(f"gates must be a tensor [n_layers, kv_heads] = {list(shape)}, "
                           f"got {type(gates).__name__}") from None
    if tuple(gates.shape) != shape:
        raise BadValue(f"gates must be [n_layers, kv_heads] = {list(shape)} for this model (one per KV head), "
                       f"got {list(gates.shape)}")
    if not gates.is_floating_point():
        raise BadValue(f"gates must be floating point (values in [0, 1]), got {gates.dtype}")
    with torch.no_grad():
        values = gates.detach()
        if not bool(torch.isfinite(values).all()) or not bool(((values >= 0) & (values <= 1)).all()):
            raise BadValue(f"gates must lie in [0, 1] (1: full attention, 0: streaming), got values from "
                           f"{float(values.min())} to {float(values.max())}")
    return gates.to(model.device)


# ---- gated attention ----------------------------------------------------------------------------
def streaming_mask(n: int, sinks: int, window: int, own_window: int | None = None,
                   device: torch.device | str = "cpu") -> Tensor:
    """bool [n, n]: query i sees key j iff j <= i and (j < sinks or i - j < window), and i - j <
    own_window when the layer has a window of its own."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    delta = i - j
    sees = visible(delta, window=window, sink_key=j < sinks)
    return sees if own_window is None else sees & (delta < own_window)


def _streaming_z(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, sinks: Tensor | None = None) -> Tensor:
    """q [batch, pos, head, d_head], k / v [batch, pos, kv_head, d_head] -> z [batch, pos, head, d_head]
    attending under `mask` [pos, pos]; query head h reads KV head h // (head / kv_head). `sinks` [head]:
    learned sink logits (gpt-oss), each in its head's softmax denominator with no value."""
    group = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))  # [batch, head, pos, pos]
    pattern = with_sink_column(scores, sinks).softmax(-1)[..., :-1]
    return (pattern @ v).transpose(1, 2)


@contextlib.contextmanager
def gated_attention(model, gates, *, sinks: int = 4, window: int = 128) -> Iterator[None]:
    """Inside the block, every forward of `model` mixes each head's full and streaming (`sinks` +
    `window`) outputs by its KV head's gate: `gates` [n_layers, kv_heads] in [0, 1], a tensor that
    may require grad. Whole unpadded sequences, no KV cache (module docstring). A layer whose gates
    are all 1 and need no gradient is left as it is (nothing to mix)."""
    sinks, window = _check_streaming(sinks, window)
    _check_model(model)
    gates = _check_gates(model, gates)
    group = kv_group(model)
    rotary = model.cfg.positional == "rotary"
    q_hook, k_hook = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
    with torch.no_grad():
        untouched = [not gates.requires_grad and bool((gates[layer] == 1).all()) for layer in range(len(gates))]
    seen: dict[int, dict[str, Tensor]] = {}
    masks: dict[tuple, Tensor] = {}

    def keep(layer: int, what: str):
        def fn(t: Tensor, hook) -> None:
            seen.setdefault(layer, {})[what] = t
        return fn

    def mix(layer: int):
        attn = model.blocks[layer].attn

        def fn(z: Tensor, hook) -> Tensor:
            got = seen.pop(layer)
            q, k, v = got["q"], got["k"], got["v"]
            n = q.shape[1]
            key = (n, attn.window, q.device)
            if key not in masks:
                masks[key] = streaming_mask(n, sinks, window, attn.window, q.device)
            z_stream = _streaming_z(q, k, v, masks[key], attn.scale, attn.sinks)
            if "gate" in got:  # gated attention (`attn_output_gate`): hook_z's z is gated, so the stream is too
                z_stream = z_stream * got["gate"]
            g = gates[layer].to(z.dtype).repeat_interleave(group)[:, None]  # [head, 1]
            return g * z + (1 - g) * z_stream
        return fn

    hooks = []
    for layer in range(model.cfg.n_layers):
        if untouched[layer]:
            continue
        at = f"blocks.{layer}.attn."
        hooks += [(at + q_hook, keep(layer, "q")), (at + k_hook, keep(layer, "k")), (at + "hook_v", keep(layer, "v")),
                  (at + "hook_z", mix(layer))]
        if hasattr(model.blocks[layer].attn, "hook_attn_gate"):  # before hook_z, so kept before the mix
            hooks.append((at + "hook_attn_gate", keep(layer, "gate")))
    def whole_sequences(module, args, kwargs) -> None:  # torch's pre-hook on the model's forward
        if kwargs.get("kv_cache") is not None:
            raise BadValue("gated attention runs whole sequences: run the model without kv_cache inside the block")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise BadValue("gated attention's streaming branch does not see padding: run unpadded sequences "
                           "(no zeros in attention_mask) inside the block")

    guard = model.register_forward_pre_hook(whole_sequences, with_kwargs=True)
    try:
        with model.hooks(fwd_hooks=hooks):
            yield
    finally:
        guard.remove()
        seen.clear()


# ---- training -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sample:
    tokens: Tensor  # [1, n]
    start: int  # first scored position


def _samples(model, data) -> list[_Sample]:
    if isinstance(data, RetrievalPrompt):
        data = [data]
    if isinstance(data, (list, tuple)):
        if not data:
            raise BadValue("no samples: give retrieval prompts (`retrieval_prompts(model, ...)`) or token ids "
                           "[batch, pos]")
        if not all(isinstance(p, RetrievalPrompt) for p in data):
            raise BadValue("a list of samples must hold retrieval prompts (`interp.analyses.kv.tasks.retrieval_prompts`); "
                           "give plain token ids as one tensor [batch, pos]")
        return [_Sample(p.tokens.to(model.device).reshape(1, -1), p.key_span[1]) for p in data]
    tokens = token_batch(model, data)
    if tokens.shape[0] == 0 or tokens.shape[1] < 2:
        raise BadValue(f"token ids [batch, pos] need at least one row of two tokens, got {list(tokens.shape)}")
    return [_Sample(row[None], 0) for row in tokens]


def _final_hidden(model, tokens: Tensor) -> Tensor:
    """The final norm's output [batch, pos, d_model] (no unembedding)."""
    return model.ln_final(model(tokens, stop_at_layer=model.cfg.n_layers))


def _fingerprint(model, samples: Sequence[_Sample], settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"name": model.runtime.name, "cfg": repr(model.cfg), **settings}, sort_keys=True).encode())
    with torch.no_grad():
        h.update(repr([round(float(p.double().sum()), 6) for p in model.parameters()]).encode())
    for s in samples:
        h.update(to_numpy(s.tokens).tobytes())
        h.update(str(s.start).encode())
    return h.hexdigest()


def train_gates(
    model, prompts_or_tokens, *, sinks: int = 4, window: int = 128, steps: int = 200, lr: float = 0.05,
    l1: float = 0.05, seed: int = 0, time_budget_s: float | None = None, progress_bar: bool | None = None,
    cache_dir: str | Path | None = None,
) -> GateResult:
    """Learn DuoAttention's gates [n_layers, kv_heads] on `prompts_or_tokens` (retrieval prompts, or
    token ids [batch, pos]: one sample per row) for `steps` steps or until `time_budget_s` runs out.
    lr: Adam's (DuoAttention trains 2000 steps at 0.02; 0.05 here, for the few steps a CPU allows:
    SmolLM2-135M on one 1024-token prompt a step took about 60 s a step on 2 busy cores); l1: the
    penalty's weight (DuoAttention's 0.05). `cache_dir`: reuse or write the result there (module
    docstring)."""
    sinks, window = _check_streaming(sinks, window)
    check_int("steps", steps, minimum=1)
    lr = check_real("lr", lr, minimum=0.0, strict=True)
    l1 = check_real("l1", l1, minimum=0.0)
    check_int("seed", seed, minimum=0)
    if time_budget_s is not None:
        time_budget_s = check_real("time_budget_s", time_budget_s, minimum=0.0, strict=True)
    _check_model(model)
    samples = _samples(model, prompts_or_tokens)
    longest = max(s.tokens.shape[1] for s in samples)
    if longest <= sinks + window:
        raise BadValue(f"the samples are at most {longest} tokens, within sinks + window = {sinks + window}: "
                       "streaming attention is full attention there and the gates learn nothing; use longer "
                       "prompts or a smaller window")
    for i, s in enumerate(samples):
        if not 0 <= s.start < s.tokens.shape[1]:
            raise BadValue(f"sample {i} has no position after its needle to score")

    settings = dict(sinks=sinks, window=window, steps=steps, lr=lr, l1=l1, seed=seed, time_budget_s=time_budget_s,
                    target=TARGET, positions="after the needle's key" if samples[0].start else "all")
    path = None
    if cache_dir is not None:
        key = _fingerprint(model, samples, settings)
        settings["key"] = key
        path = Path(cache_dir) / f"gates-{key[:20]}.json"
        if path.exists():
            cached = load_gates(path)
            if cached.settings.get("key") == key:
                return cached
    return _train(model, samples, settings, progress_bar, path)


def _train(model, samples: list[_Sample], settings: dict, progress_bar, path: Path | None) -> GateResult:
    sinks, window, steps, lr, l1 = (settings[k] for k in ("sinks", "window", "steps", "lr", "l1"))
    budget = settings["time_budget_s"]
    cfg = model.cfg
    gates = torch.ones(cfg.n_layers, cfg.kv_heads, device=model.device, dtype=torch.float32, requires_grad=True)
    optimizer = torch.optim.Adam([gates], lr=lr)
    rng = torch.Generator().manual_seed(settings["seed"])
    order: list[int] = []
    targets: dict[int, Tensor] = {}
    rows: list[dict] = []
    began = time.perf_counter()
    slowest = 0.0
    with frozen_params(model), torch.enable_grad():
        for step in progress(range(1, steps + 1), total=steps, desc="gates", enabled=progress_bar):
            elapsed = time.perf_counter() - began
            if budget is not None and rows and elapsed + slowest > budget:
                break
            if not order:
                order = torch.randperm(len(samples), generator=rng).tolist()
            i = order.pop(0)
            sample = samples[i]
            if bool((gates == 1).all()):
                # Every gate 1 is the full model bit for bit (`gated_attention`): the distillation loss and
                # its gradient are exactly 0, so the forward and backward are skipped (step 1 costs nothing).
                distill = gates.new_zeros(())
            else:
                if i not in targets:
                    with torch.no_grad():
                        targets[i] = _final_hidden(model, sample.tokens)[:, sample.start:].float()
                with gated_attention(model, gates, sinks=sinks, window=window):
                    hidden = _final_hidden(model, sample.tokens)[:, sample.start:].float()
                distill = (hidden - targets[i]).pow(2).mean()
            penalty = l1 * gates.abs().mean()
            total = distill + penalty
            if not math.isfinite(total.item()):
                raise FloatingPointError(f"step {step}: the loss is {total.item()} (distillation {distill.item()}, "
                                         f"L1 {penalty.item()}); the gates were finite in [0, 1], so the model's "
                                         "hidden states are not finite on this sample")
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
                mean_gate = float(gates.mean())
            now = time.perf_counter() - began
            slowest = max(slowest, now - elapsed)
            rows.append(dict(step=step, total=total.item(), distill=distill.item(), l1=penalty.item(),
                             mean_gate=mean_gate, seconds=now))
    seconds = time.perf_counter() - began
    result = GateResult(gates=gates.detach().float().cpu(), curve=pd.DataFrame(rows, columns=CURVE_COLUMNS),
                        steps=len(rows), seconds=seconds, settings=settings)
    if path is not None:
        save_gates(result, path)
    return result


# ---- tables and files ---------------------------------------------------------------------------
def gate_table(result: GateResult | Tensor) -> pd.DataFrame:
    """One row per KV head: layer, kv_head, gate (from a GateResult or a gates tensor)."""
    gates = result.gates if isinstance(result, GateResult) else result
    n_layers, kv = gates.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(n_layers), kv), "kv_head": np.tile(np.arange(kv), n_layers),
                         "gate": to_numpy(gates.float().reshape(-1))})


def save_gates(result: GateResult, path: str | Path) -> Path:
    """Write `result` as JSON (written whole to a temporary name, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(format=FORMAT, gates=result.gates.tolist(), steps=result.steps, seconds=result.seconds,
                settings=result.settings, curve=result.curve.to_dict(orient="list"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return path


def load_gates(path: str | Path) -> GateResult:
    """A GateResult written by `save_gates` (`from_cache` set)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        gates = torch.tensor(data["gates"], dtype=torch.float32)
        curve = pd.DataFrame(data["curve"], columns=CURVE_COLUMNS)
        return GateResult(gates=gates, curve=curve, steps=int(data["steps"]), seconds=float(data["seconds"]),
                          settings=dict(data["settings"]), from_cache=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadValue(f"{path} is not a gates file written by save_gates ({e}); delete it to retrain") from None
