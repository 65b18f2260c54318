"""TransformerLens interop: run its utilities on our models, and move its models over.

Our `HookedTransformer` already is a structural match for TransformerLens 4's
`transformer_lens.model_protocol.TransformerLensModel` (and `...WithWeights`): `cfg` answers the
TransformerLens names its utilities read (`n_key_value_heads`, `normalization_type`,
`positional_embedding_type`, `default_prepend_bos`, `device`, `dtype`, ...), `run_with_hooks`
and `run_with_cache` take the same arguments, and hook names and shapes are theirs (k/v hooks carry
kv-heads under GQA, as the bridge's do). So `transformer_lens.head_detector.detect_head`, the
`transformer_lens.patching` sweeps and `transformer_lens.ActivationCache` run on our model
unchanged, while attention stays fused in every layer whose pattern nothing asked for.

This module holds the few pieces that need TransformerLens itself (imported lazily, so it stays
an optional dependency, `interp[tl]`):

    to_tl_cache(cache)             our ActivationCache -> TransformerLens's (for decompose_resid,
                                   logit_attrs, ...); also `run_with_cache(..., cache_type="transformer_lens")`
    from_transformer_lens(bridge)  a TransformerBridge -> our HookedTransformer, same weights
    bridge_from_hf(hf_model)       a TransformerBridge around a transformers model object (no download),
                                   to compare the two on the same weights

See docs/migrating_from_transformer_lens.md for the call-by-call mapping and the defaults that differ.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from interp.models.readouts.activation_cache import tl_package, to_tl_cache
from interp.models.readouts.weights import stored
from interp.loading import CheckpointError, from_hf

if TYPE_CHECKING:
    from interp.models import HookedTransformer

_ORIGINAL = "._original_component"  # the bridge's wrapper segment in the wrapped model's state_dict keys


def from_transformer_lens(
    bridge, *, tokenizer=None, dtype: torch.dtype | None = None, device=None, check: bool = True
) -> "HookedTransformer":
    """Our model, computing what a TransformerLens 4 `TransformerBridge` computes.

    The bridge wraps a `transformers` model (`bridge.original_model`) whose submodules it replaced
    with its own components; the original parameters are still inside, under the same names with
    `._original_component` segments added. We strip those and convert as `interp.from_hf` does
    (GPT-2, GPT-NeoX/Pythia, Llama, Mistral, Qwen2, Gemma 3). Gemma's norms: the bridge keeps
    Hugging Face's w (multiplying by 1 + w, `cfg.rmsnorm_uses_offset`), ours the multiplier 1 + w.

    If the bridge's weights were processed (`enable_compatibility_mode()` folds LayerNorm, centres
    writing weights and the unembedding, folds value biases), not all of those edits reach the wrapped
    model's own parameters (GPT-2's split q/k/v, for one); we then take every weight from the bridge's per-head
    TransformerLens views (`W_Q`, `W_O`, `ln1.w`, `W_U`, `b_U`, ...), untying the unembedding and
    adding the biases the processing created where needed. Either way ours then computes the
    bridge's logits, and `check=True` verifies that on a short probe (raising if not).

    The bridge's tokenizer comes along unless `tokenizer` is given, and so does its
    `cfg.default_prepend_bos`. Conventions are listed in docs/migrating_from_transformer_lens.md.
    """
    hf = _original_model(bridge)
    tok = tokenizer if tokenizer is not None else getattr(bridge, "tokenizer", None)
    view = _StateDictView(hf.config, _hf_tensors(hf), type(hf).__name__)
    try:
        model = from_hf(view, tokenizer=tok, dtype=dtype, device=device)
    except CheckpointError:
        if not getattr(bridge, "compatibility_mode", False):
            raise
        # Processing left the wrapped model inconsistent (e.g. a tied lm_head that no longer equals
        # the embedding); every weight is read from the bridge below, so start from the config alone.
        from interp.models import HookedTransformer
        from interp.models.families import get_family

        first = next(iter(view.state_dict().values()))
        cfg = get_family(hf.config.model_type).config(hf.config.to_dict())
        model = HookedTransformer(cfg, seed=0, tokenizer=tok).to(device=device or first.device, dtype=dtype or first.dtype).eval()
    bos = getattr(getattr(bridge, "cfg", None), "default_prepend_bos", None)
    if isinstance(bos, bool) and bos != model.cfg.default_prepend_bos:
        model.loaded_as(model.runtime.name, default_prepend_bos=bos)
    with torch.no_grad():
        if not all(_close(ours, theirs) for _, ours, theirs in _weight_pairs(model, bridge)):
            model = _from_processed(model, bridge)
        if check:
            _check_same_logits(model, bridge)
    return model


def bridge_from_hf(hf_model, tokenizer=None, *, copy_model: bool = True):
    """A `TransformerBridge` around a `transformers` causal-LM object, booted without any download.

    The bridge edits the model it wraps in place (it swaps in its own components and may switch
    attention to eager), so by default it wraps a deep copy and `hf_model` is left as it was.
    The bridge's defaults stand: it prepends BOS in `to_tokens` (as ours does) and does not fold
    LayerNorm until `enable_compatibility_mode()` (ours: `process_weights_()`)."""
    tl_package()
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    model = copy.deepcopy(hf_model) if copy_model else hf_model
    return build_bridge_from_module(model, type(hf_model).__name__, hf_config=model.config, tokenizer=tokenizer)


def conforms(model, weights: bool = True) -> bool:
    """Whether `model` passes TransformerLens's runtime protocol check (`TransformerLensModel`, and
    `TransformerLensModelWithWeights` unless weights=False)."""
    tl_package()
    from transformer_lens import model_protocol as mp

    proto = mp.TransformerLensModelWithWeights if weights else mp.TransformerLensModel
    return isinstance(model, proto)


# ---- internals -----------------------------------------------------------------------------
class _StateDictView:
    """What `interp.from_hf` reads from a transformers model: `.config` and `.state_dict()`."""

    def __init__(self, config, tensors: dict[str, torch.Tensor], name: str) -> None:
        self.config, self._tensors, self._name = config, tensors, name

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def __repr__(self) -> str:
        return f"{self._name} (inside a TransformerBridge)"


def _hf_tensors(hf) -> dict[str, torch.Tensor]:
    """The wrapped model's own tensors under their transformers names: `._original_component` segments
    stripped, and only the names the model class itself has (the bridge adds aliases, e.g. split
    q/k/v views of GPT-2's c_attn, and a b_U)."""
    with torch.device("meta"):
        own = set(type(hf)(copy.deepcopy(hf.config)).state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, value in hf.state_dict().items():
        clean = name.replace(_ORIGINAL, "")
        if clean in own:
            out.setdefault(clean, value)
    missing = own - set(out)
    if missing:
        raise CheckpointError(f"the bridge's {type(hf).__name__} has no {sorted(missing)[:5]}; interp cannot read its weights")
    return out


def _weight_pairs(model, bridge):
    """(name, our tensor, the bridge's tensor or None) for every weight, in TransformerLens's per-head
    layout. Ours are views into our fused parameters, so copying into them edits the model; a bias
    our architecture lacks is None (not the zeros its attribute reads as: nothing to write into)."""
    yield "W_E", model.embed.W_E, bridge.W_E
    if isinstance(getattr(model.pos_embed, "W_pos", None), torch.nn.Parameter):
        yield "W_pos", model.pos_embed.W_pos, bridge.W_pos
    # Sandwich norms (ln1_post, ln2_post) and QK-norm (attn.q_norm, attn.k_norm) where the model has them.
    norms = [(f"blocks.{l}.{n}", getattr(b, n), _maybe(bridge.blocks[l], n)) for l, b in enumerate(model.blocks)
             for n in ("ln1", "ln1_post", "ln2", "ln2_post")]
    norms += [(f"blocks.{l}.attn.{n}", getattr(b.attn, n, None), _maybe(bridge.blocks[l].attn, n))
              for l, b in enumerate(model.blocks) for n in ("q_norm", "k_norm")]
    for l, block in enumerate(model.blocks):
        theirs = bridge.blocks[l]
        for w in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
            # Without b_qkv our b_Q/b_K/b_V are fresh zeros, not views: there is nothing to write into.
            if w in ("b_Q", "b_K", "b_V"):
                ours = None if block.attn.b_qkv is None else getattr(block.attn, w)
            else:
                ours = stored(block.attn, w) if w == "b_O" else getattr(block.attn, w)
            yield f"blocks.{l}.attn.{w}", ours, _maybe(theirs.attn, w)
        if block.mlp is not None:
            for w in ("W_gate", "W_in", "W_out", "b_gate", "b_in", "b_out"):
                if hasattr(block.mlp, w):
                    ours = stored(block.mlp, w) if w.startswith("b_") else getattr(block.mlp, w)
                    yield f"blocks.{l}.mlp.{w}", ours, _maybe(theirs.mlp, w)
    # The bridge's Gemma norms hold Hugging Face's w and multiply by (1 + w) (`cfg.rmsnorm_uses_offset`);
    # ours hold the multiplier itself (as `models/src/families/gemma3.py` loads them).
    offset = bool(getattr(getattr(bridge, "cfg", None), "rmsnorm_uses_offset", False))
    norms.append(("embed_ln", model.embed_ln, _maybe(bridge, "embed_ln")))  # Bloom's embedding norm, where it is
    for name, ours, theirs in [*norms, ("ln_final", model.ln_final, bridge.ln_final)]:
        if ours is not None and hasattr(ours, "w"):
            w = _maybe(theirs, "w")
            yield f"{name}.w", ours.w, (w.float() + 1.0 if offset and w is not None else w)
            if hasattr(ours, "b"):
                yield f"{name}.b", ours.b, _maybe(theirs, "b")
    yield "W_U", model.W_U, bridge.W_U
    yield "b_U", stored(model.unembed, "b_U"), _maybe(bridge, "b_U")


def _from_processed(model, bridge):
    """A model holding the bridge's processed weights (see `from_transformer_lens`)."""
    from interp.models import HookedTransformer

    def nonzero(t) -> bool:
        return t is not None and bool(t.abs().max() > 0)

    cfg, changes = model.cfg, {}
    pairs = list(_weight_pairs(model, bridge))
    theirs = {name: t for name, _, t in pairs}
    if cfg.tie_embeddings and not _close(theirs["W_U"], theirs["W_E"].T):
        changes["tie_embeddings"] = False  # LayerNorm folding and centring untie W_U from W_E
    for flag, names in (
        ("unembed_bias", ["b_U"]),
        ("attn_out_bias", [n for n in theirs if n.endswith("attn.b_O")]),
        ("qkv_bias", [n for n in theirs if n.endswith(("attn.b_Q", "attn.b_K", "attn.b_V"))]),
        ("mlp_bias", [n for n in theirs if n.endswith(("mlp.b_in", "mlp.b_out", "mlp.b_gate"))]),
    ):
        if not getattr(cfg, flag) and any(nonzero(theirs[n]) for n in names):
            changes[flag] = True  # folding a LayerNorm bias in creates biases the original lacked
    if changes:
        new = HookedTransformer(cfg.replace(**changes), seed=0, tokenizer=model.tokenizer)
        model = new.to(device=model.device, dtype=model.dtype).eval()
    for name, ours, t in _weight_pairs(model, bridge):
        if ours is None:
            if nonzero(t):
                raise NotImplementedError(f"the bridge has a nonzero {name} that this architecture has no place for")
            continue
        if t is None:
            continue  # not exposed by the bridge (e.g. a gate bias): ours keeps the wrapped model's
        if tuple(ours.shape) != tuple(t.shape):
            raise ValueError(f"{name}: the bridge's is {tuple(t.shape)}, ours {tuple(ours.shape)}")
        ours.copy_(t.to(ours.dtype))
    return model


def _check_same_logits(model, bridge) -> None:
    n = min(8, model.cfg.n_ctx)
    probe = (torch.arange(n, device=model.device) * 7919 % model.cfg.d_vocab)[None]
    ours = model(probe).float()
    param = next(bridge.parameters())
    theirs = bridge(probe.to(param.device)).float().to(ours.device)
    err = (ours - theirs).abs().max().item()
    rel = {torch.float64: 1e-6, torch.float32: 1e-3}  # half precision: 5e-2
    tol = max(rel.get(model.dtype, 5e-2), rel.get(param.dtype, 5e-2)) * max(1.0, theirs.abs().max().item())
    if not err <= tol:
        raise RuntimeError(
            f"the converted model's logits differ from the bridge's by {err:.3g} (tolerance {tol:.3g}); "
            "this bridge's architecture or weight processing is not one interp reproduces. "
            "Convert the transformers model itself with interp.from_hf, or pass check=False to keep it anyway"
        )


def _maybe(obj, attr: str):
    """obj.attr, or None where the bridge (or our module) has no such weight."""
    try:
        return getattr(obj, attr)
    except (AttributeError, KeyError, RuntimeError):
        return None


def _close(ours, theirs) -> bool:
    """Equal weights; a weight the bridge does not expose counts as equal, one we lack must be zero."""
    if theirs is None:
        return True
    if ours is None:
        return not bool(theirs.abs().max() > 0)
    a, b = ours, theirs
    return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.float(), b.float().to(a.device), rtol=1e-5, atol=1e-7)


def _original_model(bridge) -> Any:
    """The transformers model a bridge wraps (`bridge.original_model`), with a clear error otherwise."""
    try:
        hf = bridge.original_model
    except AttributeError:
        hf = None
    if hf is None or getattr(hf, "config", None) is None or not hasattr(hf, "state_dict"):
        raise TypeError(
            f"expected a TransformerLens TransformerBridge (wrapping a transformers model as "
            f"`original_model`), got {type(bridge).__name__}; for a transformers model use interp.from_hf"
        )
    if not hasattr(hf.config, "to_dict"):
        raise TypeError(f"the bridge wraps a {type(hf).__name__} without a transformers config; interp cannot convert it")
    return hf


__all__ = ["bridge_from_hf", "conforms", "from_transformer_lens", "to_tl_cache"]
