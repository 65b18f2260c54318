"""How a family says llama.cpp wrote it: a `GGUFLayout` per GGUF architecture, given with the family's
registration (`Family(..., gguf={"llama": GGUFLayout(...)})`), and what several layouts share.

A layout is data and small functions: the Hugging Face model_type; the metadata keys llama.cpp's converter
writes (`known_keys`: any other `{arch}.` key raises, naming it) and how they become a Hugging Face config
(`config(meta, common keys, tensor names)`, reading the metadata through the `meta` it is handed, which
checks every size and real number: `interp.models.formats.gguf_layouts.Metadata`); its tensor names
(llama.cpp's -> Hugging Face's); and what the converter changed that loading undoes. Reading the file,
dequantizing and the keys every RMSNorm architecture writes alike are `formats/gguf_layouts.py`'s and
`formats/gguf.py`'s: the formats sit above the families, so this module imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

# The names of the tensors outside the blocks, llama.cpp's -> Hugging Face's (llama's).
LLAMA_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Tensors llama.cpp may add that carry no weights of the model (precomputed RoPE frequencies).
ROPE_TABLES = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# What llama.cpp's converters write for the newer RMSNorm architectures (its base TextModel's keys where
# the architecture uses them), and for the LayerNorm ones.
RMS_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
})
LAYERNORM_KEYS = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
                            "attention.head_count", "attention.head_count_kv", "attention.layer_norm_epsilon"})


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp wrote one architecture: its Hugging Face model_type, the config keys only it has
    (`config(metadata, common keys, tensor names)`; `common`: whether llama's shared keys are read
    first), its per-layer tensor names (or a function of the config giving them) under the Hugging
    Face `prefix`, its other tensors' names, whether its converter permuted Q / K rows (llama's RoPE
    layout), what it added to every norm weight (Gemma's converter stores 1 + w), what else it changed
    per tensor (`transforms`, by llama.cpp's per-layer or global name), Hugging Face tensors it split in
    two (`merged`: HF per-layer name -> (llama.cpp names, how they join)), the tensors it adds that hold
    no weights of the model (`ignored`), the metadata keys it knows (None: not checked), and whether
    partial rotary is read (else refused)."""

    model_type: str
    config: Callable[[Any, dict, set], dict]
    layer_names: Mapping[str, str] | Callable[[dict], Mapping[str, str]]
    permuted_qk: bool
    norm_shift: float = 0.0
    known_keys: frozenset[str] | None = None
    prefix: str = "model.layers."
    global_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GLOBALS)
    transforms: Mapping[str, Callable[[Tensor, dict], Tensor]] = field(default_factory=dict)
    merged: Mapping[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = field(default_factory=dict)
    ignored: tuple[str, ...] = ROPE_TABLES
    common: bool = True
    partial_rotary: bool = False


def weight_and_bias(stems: Mapping[str, str]) -> dict[str, str]:
    """llama.cpp's stem -> Hugging Face's, for both the weight and the bias."""
    return {f"{g}.{leaf}": f"{h}.{leaf}" for g, h in stems.items() for leaf in ("weight", "bias")}


def stated_rope(meta) -> dict | None:
    """transformers' `rope_parameters` for the scaling a llama-layout file states (None: none): linear
    (rope.scaling.factor), or YaRN (the factor and rope.scaling.original_context_length, with transformers'
    and llama.cpp's shared defaults: beta_fast 32, beta_slow 1, attention factor 0.1 ln(factor) + 1). A YaRN
    attn_factor other than 1 (llama.cpp multiplies it into that attention factor; transformers' replaces it)
    or any other type is refused, naming the key."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.real("rope.scaling.factor")}
    if kind == "yarn":
        if meta.has("rope.scaling.attn_factor") and meta.real("rope.scaling.attn_factor") != 1.0:
            raise NotImplementedError(f"{meta.source}: {meta.arch}.rope.scaling.attn_factor = "
                                      f"{meta.get('rope.scaling.attn_factor')!r} is not supported (1 is)")
        return {"rope_type": "yarn", "factor": meta.real("rope.scaling.factor"),
                "original_max_position_embeddings": meta.count("rope.scaling.original_context_length")}
    raise NotImplementedError(f"{meta.source}: RoPE scaling {kind!r} in GGUF metadata is not supported (linear and "
                              "yarn are)")


def same_heads_and_width(meta, d_model: int, n_heads: int, d_mlp: int | None) -> None:
    """BLOOM and GPT-2 files restate what their models fix: one KV head per head, an MLP of 4 d_model."""
    if meta.count("attention.head_count_kv", n_heads) != n_heads:
        raise NotImplementedError(f"{meta.source}: {meta.arch}.attention.head_count_kv = "
                                  f"{meta.get('attention.head_count_kv')} differs from head_count {n_heads}; "
                                  f"{meta.arch} has one key / value head per head")
    if d_mlp is not None and meta.count("feed_forward_length", d_mlp) != d_mlp:
        raise NotImplementedError(f"{meta.source}: {meta.arch}.feed_forward_length = "
                                  f"{meta.get('feed_forward_length')} is not 4 * embedding_length ({d_mlp}), "
                                  f"which {meta.arch} fixes")


__all__ = ["GGUFLayout", "LAYERNORM_KEYS", "LLAMA_GLOBALS", "RMS_KEYS", "ROPE_TABLES", "same_heads_and_width",
           "stated_rope", "weight_and_bias"]
