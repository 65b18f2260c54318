"""What a model holds besides its shape and weights, in one visible place: `model.runtime`.

    name          what it was loaded as (`interp.load`'s name or path, a HF model's name_or_path)
    tokenizer     the tokenizer text goes through (any Hugging Face tokenizer, or the zoo's bytes)
    prepend_bos   an override of whether text gets BOS first (`load(default_prepend_bos=)`); None:
                  the config's `prepend_bos`, else TransformerLens's rule (BOS when the tokenizer has one)
    hook_flags    TransformerLens's optional hook points switched on (`set_use_*`) and whether GQA's k / v
                  are given per query head (`set_ungroup_grouped_query_attention`)
    processing    TransformerLens's weight-processing steps applied (`process_weights_`)
    rope_chosen   whether `cfg.rope_scaling` was chosen at inference (`load(rope_scaling=)`, `rescale_rope_`)
                  in place of the checkpoint's own; studies record it in settings.json and their report

The config stays immutable and describes the model's shape only. TransformerLens code reads some of
the above off `model.cfg` (`cfg.default_prepend_bos`, `cfg.device`, `cfg.use_attn_in`, ...): the model
gives its config a `TLView` of this state (`ModelConfig.view`), rebuilt whenever the state changes.
Each decision is made here once: `default_prepend_bos`, `padding_side`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from .config import ModelConfig, TLView

HOOK_FLAGS = ("use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "ungroup_grouped_query_attention")


@dataclass
class Runtime:
    name: str | None = None
    tokenizer: Any = None
    prepend_bos: bool | None = None
    hook_flags: dict = field(default_factory=lambda: dict.fromkeys(HOOK_FLAGS, False))
    processing: dict = field(default_factory=dict)
    rope_chosen: bool = False

    def default_prepend_bos(self, cfg: ModelConfig) -> bool:
        """Whether text gets BOS first by default: this model's override, else its config's
        `prepend_bos`, else TransformerLens's rule (BOS when the tokenizer has one)."""
        if self.prepend_bos is not None:
            return self.prepend_bos
        if cfg.prepend_bos is not None:
            return cfg.prepend_bos
        return getattr(self.tokenizer, "bos_token_id", None) is not None

    def padding_side(self) -> str:
        """Where texts of different lengths are padded by default: the tokenizer's side, else right."""
        return getattr(self.tokenizer, "padding_side", None) or "right"

    def view(self, cfg: ModelConfig, device, dtype, owner=None) -> TLView:
        """What TransformerLens reads off `model.cfg`, for a model on `device` in `dtype`; `owner`, that
        model (held weakly: its switches are read from it and set through it)."""
        return TLView(device=str(device), dtype=dtype, model_name=self.name,
                      tokenizer_name=getattr(self.tokenizer, "name_or_path", None) or None,
                      default_prepend_bos=self.default_prepend_bos(cfg), default_padding_side=self.padding_side(),
                      processed_fold_ln=bool(self.processing.get("fold_ln")), **self.hook_flags,
                      owner=None if owner is None else weakref.ref(owner))
