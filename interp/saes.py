"""SAELens's names on interp: code written for SAELens runs on interp's models with the import changed.

    from sae_lens import HookedSAETransformer, SAE          # SAELens
    from interp.saes import HookedSAETransformer, SAE       # interp: the rest of the code stays

    model = HookedSAETransformer.from_pretrained("smollm2-135m")
    sae = SAE.load_from_disk("path/to/sae")                 # or SAELens's own SAE object: accepted as it is
    logits, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    cache[f"{sae.cfg.hook_name}.hook_sae_acts_post"]

Every interp model, native or wrapped, has SAELens's `HookedSAETransformer` methods (`add_sae`, `reset_saes`,
`saes`, `run_with_saes`, `run_with_cache_with_saes`, `run_with_hooks_with_saes`, `acts_to_saes`:
`interp.models.saes.splice`), so a model from `interp.load` needs no wrapper; `HookedSAETransformer` here is only
SAELens's way in: `from_pretrained` is `interp.load` with TransformerLens's default weight processing, as
SAELens's (TransformerLens's) `from_pretrained` does, and `from_pretrained_no_processing` is `interp.load` as it is.
`isinstance(model, HookedSAETransformer)` holds for every interp model.
"""

from __future__ import annotations

from interp.loading import load
from interp.models.base import HookedModel
from interp.models.saes import SAE, SAEConfig, as_sae, load_sae

# TransformerLens's `from_pretrained` defaults: SAEs trained on its processed models read processed activations
TL_PROCESSING = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


class _AnyInterpModel(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, HookedModel)


class HookedSAETransformer(metaclass=_AnyInterpModel):
    """SAELens's entry point to a model; the model is an ordinary interp model (see the module docstring)."""

    def __new__(cls, *args, **kwargs):
        raise TypeError("HookedSAETransformer(...) builds nothing in interp: use HookedSAETransformer.from_pretrained"
                        "(name) or interp.load(name); every interp model has the SAE methods")

    @classmethod
    def from_pretrained(cls, model_name: str, **kwargs) -> HookedModel:
        """`interp.load(model_name, ...)` with TransformerLens's processing on (fold_ln, center_writing_weights,
        center_unembed, fold_value_biases), each of which a keyword may turn off; other keywords go to
        `interp.load` (device, dtype, revision, ...)."""
        return load(model_name, **{**TL_PROCESSING, **kwargs})

    @classmethod
    def from_pretrained_no_processing(cls, model_name: str, **kwargs) -> HookedModel:
        """`interp.load(model_name, ...)`: the checkpoint's own weights (what SAELens asks for Gemma Scope)."""
        return load(model_name, **kwargs)


__all__ = ["HookedSAETransformer", "SAE", "SAEConfig", "as_sae", "load_sae", "TL_PROCESSING"]
