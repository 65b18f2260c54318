"""`ActivationCache`: what `run_with_cache` returns, with TransformerLens's lookups and residual-stream
arithmetic, and its conversion to TransformerLens's own class (`to_tl_cache`, for
`run_with_cache(cache_type="transformer_lens")` and `interp.interop`). The KV cache is
`interp.models.kv.cache` (re-exported here as before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from .attention_view import View, pattern_view
from interp.errors import BadValue
from ..hooks.aliases import act_name, canonical, hook_aliases

from ..kv.cache import KVCache  # noqa: F401 - `interp.models.readouts.activation_cache.KVCache`, as before the split

if TYPE_CHECKING:
    from torch import nn


class ActivationCache:
    """Activations by hook name, indexable the TransformerLens way.

    cache["blocks.0.attn.hook_pattern"], cache["pattern", 0], cache["resid_pre", -1],
    cache["normalized", 2, "ln1"], cache["embed"], cache["k6"], and TransformerLens 4's bridge names
    for the same activations (cache["blocks.0.hook_in"], cache["in", 0]: resid_pre; see
    `models/src/hooks/aliases.py`), which it answers without listing them. `.keys()`, `.items()`, `.to(device)`,
    `.remove_batch_dim()`, and TransformerLens's arithmetic with its numbers: `decompose_resid`,
    `accumulated_resid`, `stack_head_results`, `stack_neuron_results`, `get_full_resid_decomposition`,
    `apply_ln_to_stack`, `logit_attrs`, `stack_activation`.
    """

    def __init__(self, cache_dict: dict[str, Tensor], model: "nn.Module | None" = None, has_batch_dim: bool = True) -> None:
        self.cache_dict = cache_dict
        self.model = model
        self.has_batch_dim = has_batch_dim

    # ---- mapping ------------------------------------------------------------------------------
    def _name(self, key) -> str:
        if isinstance(key, str):
            if key in self.cache_dict:
                return key
            name = act_name(key)
        elif isinstance(key, tuple):
            name, layer, *sub = key
            if layer is not None and layer < 0:
                layer += self.model.cfg.n_layers if self.model is not None else 0
            name = act_name(name, layer, sub[0] if sub else None)
        else:
            raise KeyError(f"cache keys are hook names or (name, layer[, sub]) tuples, got {key!r}")
        return name if name in self.cache_dict else canonical(name, self._aliases())

    def _aliases(self) -> dict[str, str]:
        """{the bridge's name: ours}: the model's, or for a cache without one, those of its keys."""
        aliases = getattr(self.model, "hook_aliases", None) if self.model is not None else None
        return aliases if isinstance(aliases, dict) else hook_aliases(self.cache_dict)

    def __getitem__(self, key) -> Tensor:
        name = self._name(key)
        try:
            return self.cache_dict[name]
        except KeyError:
            raise KeyError(
                f"{name!r} is not in this cache ({len(self.cache_dict)} activations). Cache it with "
                f"run_with_cache(..., names_filter=...) naming it, or check the name against model.hook_dict"
            ) from None

    def __contains__(self, key) -> bool:
        try:
            return self._name(key) in self.cache_dict
        except KeyError:
            return False

    def __len__(self) -> int:
        return len(self.cache_dict)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def keys(self):
        return self.cache_dict.keys()

    def values(self):
        return self.cache_dict.values()

    def items(self):
        return self.cache_dict.items()

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {list(self.cache_dict)[:4]}{' ...' if len(self) > 4 else ''})"

    # ---- looking -------------------------------------------------------------------------------
    def view(self, layer: int, tokens=None, *, batch: int = 0, **options) -> View:
        """Layer `layer`'s attention as an interactive view (shown inline in a notebook; `.save(path)`):
        a thumbnail per head, the chosen head's pattern, tokens to hover. `tokens`: the strings to show
        (`model.to_str_tokens(...)`), or the text / token ids given to `run_with_cache` (converted with the
        cache's model); None shows positions. `options`: `interp.view.attention_heads`'s (max_value, ...).
        The checks are `attention_view.py` beside this module; the HTML is `interp.drawing`'s."""
        if not (isinstance(layer, int) and not isinstance(layer, bool)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if self.model is not None and layer < 0:
            layer += self.model.cfg.n_layers
        if ("pattern", layer) not in self:
            raise KeyError(f"no attention pattern of layer {layer} in this cache: run_with_cache(..., names_filter="
                           f"'blocks.{layer}.attn.hook_pattern') (or a filter that keeps it)")
        pattern = self["pattern", layer]
        if self.has_batch_dim:
            if not 0 <= batch < pattern.shape[0]:
                raise BadValue(f"batch {batch} is not in this cache (batch size {pattern.shape[0]})")
            pattern = pattern[batch]
        n = pattern.shape[-1]
        if tokens is None:
            tokens = [str(i) for i in range(n)]
        elif not (isinstance(tokens, (list, tuple)) and all(isinstance(t, str) for t in tokens)):
            if self.model is None:
                raise BadValue("this cache has no model to turn text or ids into token strings: pass tokens as "
                                 "a list of strings")
            ids = torch.as_tensor(self.model.to_tokens(tokens)) if isinstance(tokens, str) else torch.as_tensor(tokens)
            tokens = self.model.to_str_tokens(ids[batch] if ids.dim() == 2 else ids)
        names = [f"L{layer}H{h}" for h in range(pattern.shape[0])]
        return pattern_view(tokens, pattern, head_names=options.pop("attention_head_names", None) or names,
                            title=options.pop("title", None) or f"layer {layer}'s attention", **options)

    # ---- moving -------------------------------------------------------------------------------
    def to(self, device, move_model: bool = False) -> "ActivationCache":
        if move_model and self.model is not None:
            self.model.to(device)
        return ActivationCache({k: v.to(device) for k, v in self.items()}, self.model, self.has_batch_dim)

    def cpu(self) -> "ActivationCache":
        return self.to("cpu")

    def remove_batch_dim(self) -> "ActivationCache":
        if not self.has_batch_dim:
            return self
        for k, v in self.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has batch {v.shape[0]}")
        return ActivationCache({k: v[0] for k, v in self.items()}, self.model, has_batch_dim=False)

    # ---- TransformerLens's residual-stream arithmetic ------------------------------------------
    # Same signatures, labels and numbers as TransformerLens 4's ActivationCache (tested against it
    # on the same weights), computed on our cache directly. `layer` counts blocks: the components
    # entering block `layer` (None or -1: all of them, i.e. what the unembedding reads); `mlp_input`
    # moves the cut to block `layer`'s MLP input. `pos_slice`: None, an int, a (start, stop[, step])
    # tuple, a slice, or a list / tensor of positions (or TransformerLens's `Slice`).
    @property
    def has_embed(self) -> bool:
        return "hook_embed" in self.cache_dict

    @property
    def has_pos_embed(self) -> bool:
        return "hook_pos_embed" in self.cache_dict

    def _n(self, layer: int | None) -> int:
        return self.model.cfg.n_layers if layer is None or layer == -1 else layer

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None) -> Tensor:
        """[layers (up to `layer`), ...]: one hook's activation stacked over layers."""
        return torch.stack([self[act_name(activation_name, i, sublayer_type)] for i in range(self._n(layer))])

    def compute_head_results(self) -> None:
        """Fill in `attn.hook_result` [batch, pos, head, d_model] = z_h W_O[h] from hook_z where missing."""
        for l in range(self.model.cfg.n_layers):
            self._head_result(l)

    def _head_result(self, l: int) -> Tensor:
        name = act_name("result", l)
        cached = self.cache_dict.get(name)
        if cached is not None:
            return cached
        z = self[act_name("z", l)]
        W_O = self.model.blocks[l].attn.W_O
        dtype = torch.promote_types(z.dtype, W_O.dtype)
        res = torch.einsum("...hd,hdm->...hm", z.to(dtype), W_O.to(dtype))
        self.cache_dict[name] = res
        return res

    def _stacked(self, parts: list[Tensor], pos_slice) -> Tensor:
        """Per-layer parts [..., units, d_model] as one stack [units of every layer, ...] (empty: no layer)."""
        if parts:
            return torch.cat(parts, dim=-2).movedim(-2, 0)
        src = _slice(self["hook_embed"], pos_slice, -2)
        return src.new_zeros((0, *src.shape))

    def _with_remainder(self, stack: Tensor, target: str, pos_slice, labels: list[str]) -> Tensor:
        """The stack and, last, the activation `target` less the stack's sum, labelled "remainder"."""
        total = _slice(self[target], pos_slice, -2)
        labels.append("remainder")
        return torch.cat([stack, (total - stack.sum(0))[None]])

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """[layers * heads (+1), batch, pos, d_model]: each head's write to the residual stream (z_h W_O[h],
        without b_O) for the blocks before `layer`, labelled "L{l}H{h}"; `incl_remainder` adds
        resid_post - their sum. With sandwich norms (Gemma 2/3) these are, as in TransformerLens, the
        inputs of ln1_post, not residual writes: the norm in between is not linear, so the heads do
        not add up to the residual stream and the remainder holds the difference."""
        n = self._n(layer)
        parts, labels = [], []
        for l in range(n):
            parts.append(_slice(self._head_result(l), pos_slice, -3))
            labels += [f"L{l}H{h}" for h in range(self.model.cfg.n_heads)]
        stack = self._stacked(parts, pos_slice)
        if incl_remainder:
            stack = self._with_remainder(stack, act_name("resid_post", n - 1), pos_slice, labels)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def get_neuron_results(self, layer: int, neuron_slice=None, pos_slice=None,
                           project_output_onto: Tensor | None = None) -> Tensor:
        """[batch, pos, neuron, d_model]: each MLP neuron's write (post-activation x its W_out row);
        [batch, pos, neuron(, k)] projected onto `project_output_onto` [d_model(, k)]."""
        acts = _slice(self[act_name("post", layer)], pos_slice, -2)
        W_out = self.model.blocks[layer].mlp.W_out
        acts, W_out = _slice(acts, _as_list(neuron_slice), -1), _slice(W_out, _as_list(neuron_slice), 0)
        if project_output_onto is None:
            return acts[..., None] * W_out
        projected = W_out @ project_output_onto
        return acts * projected if project_output_onto.dim() == 1 else acts[..., None] * projected

    def stack_neuron_results(self, layer: int, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: Tensor | None = None, mlp_input: bool = False):
        """[layers * neurons (+1), batch, pos, d_model]: every neuron's write before block `layer`,
        labelled "L{l}N{n}" (memory: layers x d_mlp x batch x pos x d_model)."""
        n = self._n(layer)
        d_mlp = self.model.cfg.d_mlp
        ids = _slice(torch.arange(d_mlp), _as_list(neuron_slice), 0)
        labels = [f"L{l}N{i}" for l in range(n) for i in ids.reshape(-1).tolist()]
        proj = None if project_output_onto is None else (
            project_output_onto[:, None] if project_output_onto.dim() == 1 else project_output_onto)
        parts = [self.get_neuron_results(l, neuron_slice, pos_slice) for l in range(n)]
        stack = self._stacked(parts, pos_slice)
        if incl_remainder:
            target = act_name("resid_mid", n) if mlp_input else act_name("resid_post", n - 1)
            stack = self._with_remainder(stack, target, pos_slice, labels)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice, mlp_input=mlp_input)
        if proj is not None:
            stack = stack @ proj.to(stack.dtype)
            if project_output_onto.dim() == 1:
                stack = stack[..., 0]
        return (stack, labels) if return_labels else stack

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """[components, batch, pos, d_model]: the residual stream entering each block up to `layer`
        ("{l}_pre", with `incl_mid` also "{l}_mid"), and "final_post" when `layer` is the last.
        apply_ln: as TransformerLens, each component goes through the norm the stream meets next: at
        the end, ln_final itself (the logit lens); before block `layer`, the cached scale of its ln1
        (ln2 with `mlp_input`)."""
        n_layers = self.model.cfg.n_layers
        n = self._n(layer)
        parts, labels = [], []
        for l in range(n + 1):
            if l == n_layers:
                parts.append(self[act_name("resid_post", n_layers - 1)])
                labels.append("final_post")
                continue
            parts.append(self[act_name("resid_pre", l)])
            labels.append(f"{l}_pre")
            if (incl_mid and l < n) or (mlp_input and l == n):
                parts.append(self[act_name("resid_mid", l)])
                labels.append(f"{l}_mid")
        stack = torch.stack([_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice, mlp_input=mlp_input,
                                           recompute_ln=n == n_layers)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice=None, incl_embeds: bool = True, return_labels: bool = False):
        """[components, batch, pos, d_model]: the residual stream entering block `layer` split into
        "embed", "pos_embed", and each block's "{l}_attn_out" / "{l}_mlp_out" (mode "attn" / "mlp":
        only those; `mlp_input` adds block `layer`'s attention)."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        n = self._n(layer)
        attn, mlp = mode != "mlp", mode != "attn" and not self.model.cfg.attn_only
        parts, labels = [], []
        if incl_embeds:
            for key, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")):
                if key in self.cache_dict:
                    parts.append(self[key])
                    labels.append(label)
        for l in range(n):
            if attn:
                parts.append(self[act_name("attn_out", l)])
                labels.append(f"{l}_attn_out")
            if mlp:
                parts.append(self[act_name("mlp_out", l)])
                labels.append(f"{l}_mlp_out")
        if mlp_input and attn:
            parts.append(self[act_name("attn_out", n)])
            labels.append(f"{n}_attn_out")
        stack = torch.stack([_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice, mlp_input=mlp_input)
        return (stack, labels) if return_labels else stack

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice=None,
                                     return_labels: bool = False, project_output_onto: Tensor | None = None):
        """Every head, every MLP (or neuron, with expand_neurons), the embeddings and the summed biases:
        components that add up to the residual stream entering block `layer` (labels "L{l}H{h}",
        "{l}_mlp_out" or "L{l}N{n}", "embed", "pos_embed", "bias")."""
        n = self._n(layer)
        heads, labels = self.stack_head_results(n + (1 if mlp_input else 0), pos_slice=pos_slice, return_labels=True)
        parts = [heads]
        if not self.model.cfg.attn_only and n > 0:
            if expand_neurons:
                neurons, more = self.stack_neuron_results(n, pos_slice=pos_slice, return_labels=True)
            else:
                neurons, more = self.decompose_resid(n, mlp_input=mlp_input, pos_slice=pos_slice, incl_embeds=False,
                                                     mode="mlp", return_labels=True)
            parts.append(neurons)
            labels = labels + more
        for key, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")):
            if key in self.cache_dict:
                parts.append(_slice(self[key], pos_slice, -2)[None])
                labels.append(label)
        bias = self.model.accumulated_bias(n, mlp_input, include_mlp_biases=expand_neurons)
        parts.append(bias.to(heads.dtype).expand((1, *heads.shape[1:])))
        labels.append("bias")
        stack = torch.cat(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, n, pos_slice=pos_slice, mlp_input=mlp_input)
        if project_output_onto is not None:
            stack = stack @ project_output_onto.to(stack.dtype)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> Tensor:
        """Each component as the norm the stream meets at `layer` sees it: centred (LayerNorm) and
        divided by that norm's cached scale, which treats the norm as linear given this input
        (ln_final's for layer None/-1/n_layers; block `layer`'s ln1, or ln2 with `mlp_input`).
        recompute_ln at the end: run ln_final itself on each component (TransformerLens's logit lens).
        The norm's weight is not applied: fold it first (`process_weights_`), as TransformerLens assumes."""
        cfg = self.model.cfg
        n = self._n(layer)
        if has_batch_dim and batch_slice is not None:
            residual_stack = _slice(residual_stack, batch_slice, 1)
        if cfg.normalization is None:
            return residual_stack
        if recompute_ln and n == cfg.n_layers:
            return torch.stack([self.model.ln_final(c) for c in residual_stack])
        if cfg.normalization == "layernorm":
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        key = "ln_final.hook_scale" if n == cfg.n_layers else f"blocks.{n}.ln{2 if mlp_input else 1}.hook_scale"
        if key not in self.cache_dict:
            raise KeyError(f"apply_ln needs {key!r}, which this cache does not hold: cache it (run_with_cache with "
                           "names_filter=None, or a filter that keeps hook_scale)")
        scale = _slice(self.cache_dict[key], pos_slice, -2)
        if has_batch_dim and batch_slice is not None and self.has_batch_dim:
            scale = _slice(scale, batch_slice, 0)
        return residual_stack / scale

    def logit_attrs(self, residual_stack: Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True) -> Tensor:
        """[components, batch, pos]: each component's direct contribution to the logit of `tokens`
        (a token string, an id, or ids [batch] / [batch, pos]), minus that of `incorrect_tokens`:
        the component through ln_final's cached scale, dotted with W_U[:, token] (logit difference)."""
        model = self.model

        def shape_of(t):
            if isinstance(t, str):
                return torch.Size([])
            return torch.as_tensor(t).shape

        directions = model.tokens_to_residual_directions(tokens)
        if incorrect_tokens is not None:
            if shape_of(tokens) != shape_of(incorrect_tokens):
                raise ValueError(f"tokens and incorrect_tokens must have the same shape, got {tuple(shape_of(tokens))} "
                                 f"and {tuple(shape_of(incorrect_tokens))}")
            directions = directions - model.tokens_to_residual_directions(incorrect_tokens)
        scaled = self.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        batch_is_int = isinstance(batch_slice, int) or (hasattr(batch_slice, "mode") and batch_slice.mode == "int")
        if (has_batch_dim and not batch_is_int and scaled.dim() == 4 and directions.dim() == 2
                and directions.shape[0] == scaled.shape[1]):
            directions = directions[:, None]  # one token per sequence: broadcast over positions
        return (scaled * directions.to(scaled.dtype)).sum(-1)


def _slice(t: Tensor, s, dim: int) -> Tensor:
    """`t` indexed along `dim` by a TransformerLens-style slice: None (all), an int (drops the dim), a
    (start, stop[, step]) tuple, a slice, a list / array / tensor of indices, or a TL `Slice`."""
    if s is None:
        return t
    if hasattr(s, "slice") and hasattr(s, "mode"):  # transformer_lens Slice
        s = s.slice
    if isinstance(s, tuple):
        s = slice(*s)
    if not isinstance(s, (int, slice)):
        s = torch.as_tensor(s, device=t.device, dtype=torch.long)
    index = [slice(None)] * t.dim()
    index[dim] = s
    return t[tuple(index)]


def _as_list(s):
    """A neuron slice: an int selects one neuron but keeps the dimension (TransformerLens)."""
    if hasattr(s, "slice") and hasattr(s, "mode"):
        s = s.slice
    return [s] if isinstance(s, int) else s


# ---- TransformerLens interop (its package is imported only when called) ----------------------
def tl_package():
    """The transformer_lens package, or one ImportError line saying how to install it."""
    try:
        import transformer_lens
    except ImportError as e:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "this needs TransformerLens: pip install 'interp[tl]' (or transformer-lens>=3)"
        ) from e
    return transformer_lens


def to_tl_cache(cache, model: "nn.Module | None" = None):
    """Our `ActivationCache` (or a plain {hook name: tensor} dict) as TransformerLens's `ActivationCache`.

    The tensors are shared, not copied; the dict is (TransformerLens's `remove_batch_dim` edits its
    dict in place, which must not reach ours). `model` defaults to the cache's model. TransformerLens's
    cache looks names up literally, so each activation is also listed under the bridge's names for it
    (`blocks.0.hook_in` beside `blocks.0.hook_resid_pre`), as the bridge's own caches list both."""
    TLCache = tl_package().ActivationCache
    if isinstance(cache, TLCache):
        return cache
    if isinstance(cache, ActivationCache):
        model = model if model is not None else cache.model
        return TLCache(_with_aliases(ActivationCache(cache.cache_dict, model)), model, has_batch_dim=cache.has_batch_dim)
    if isinstance(cache, dict):
        if model is None:
            raise ValueError("a plain dict of activations needs the model it came from: to_tl_cache(cache, model)")
        return TLCache(_with_aliases(ActivationCache(cache, model)), model)
    raise TypeError(f"expected an interp.ActivationCache or a dict of activations, got {type(cache).__name__}")


def _with_aliases(cache: ActivationCache) -> dict[str, Tensor]:
    """A new dict of the cache's activations under our names and the bridge's (gradients too)."""
    out = dict(cache.cache_dict)
    for alias, own in cache._aliases().items():
        for suffix in ("", "_grad"):
            if own + suffix in out:
                out.setdefault(alias + suffix, out[own + suffix])
    return out
