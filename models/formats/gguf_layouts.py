"""How llama.cpp wrote each architecture a GGUF file can hold (`gguf.py` reads the file and loads it).

Per architecture (`_LAYOUTS`, a `_Layout` each): its Hugging Face model_type; the metadata keys llama.cpp's
converter writes for it (`known_keys`: any other `{arch}.` key raises, naming it) and how they become a
Hugging Face config (`hf_config`: llama's shared keys, then the architecture's own, read through
`_Metadata`, which checks every size and real number); its tensor names (llama.cpp's -> Hugging Face's);
and what the converter changed that loading undoes (Q / K rows permuted for llama's RoPE layout, the 1
added to Gemma's norm weights, Falcon's and BLOOM's fused QKV regrouped, GPT-2's Conv1D transposed, Qwen 3
MoE's experts split). What the metadata leaves out is llama.cpp's (and transformers') fixed choice for that
architecture, said at each config function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..config import RopeScaling
from ..device import to_numpy
from interp.errors import CheckpointError
from ..positions import llama3_divisors
from .gguf_file import GGUFFile, dequantize

# llama.cpp tensor names -> Hugging Face llama names ({l} is the layer).
_LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# ... and Gemma 3's: QK-norm, and a norm before and after attention and MLP (llama.cpp's ffn_norm is
# Gemma's pre_feedforward_layernorm here, not a llama post_attention_layernorm).
_GEMMA3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# ... Gemma 2's: Gemma 3's without QK-norm.
_GEMMA2_LAYER_NAMES = {k: v for k, v in _GEMMA3_LAYER_NAMES.items()
                       if k not in ("attn_q_norm.weight", "attn_k_norm.weight")}
# ... Qwen 3's: llama's with a QK-norm per head.
_QWEN3_LAYER_NAMES = _LLAMA_LAYER_NAMES | {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                           "attn_k_norm.weight": "self_attn.k_norm.weight"}
# ... Qwen 3 MoE's: the router and the experts' stacked down projections (gate and up are merged below).
_QWEN3MOE_LAYER_NAMES = {k: v for k, v in _QWEN3_LAYER_NAMES.items() if not k.startswith("ffn_")} | {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# ... Phi-3's fused projections, as Hugging Face fuses them: attn_qkv = qkv_proj ([q | k | v] rows) and
# ffn_up = gate_up_proj (gate rows, then up rows).
_PHI3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _weight_and_bias(stems: dict[str, str]) -> dict[str, str]:
    return {f"{g}.{leaf}": f"{h}.{leaf}" for g, h in stems.items() for leaf in ("weight", "bias")}


# ... BLOOM's and GPT-2's (LayerNorms and projections with biases), under `transformer.h.{l}.`.
_BLOOM_LAYER_NAMES = _weight_and_bias({
    "attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h",
})
_GPT2_LAYER_NAMES = _weight_and_bias({
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
})


def _falcon_layer_names(config: dict) -> dict[str, str]:
    """Falcon's: attn_norm is the one shared input_layernorm (7B, 11B); with two norms (40B, 180B) llama.cpp
    runs attention off attn_norm_2 (ln_attn) and the MLP off attn_norm (ln_mlp)."""
    two = config.get("num_ln_in_parallel_attn") == 2
    return _weight_and_bias({
        "attn_norm": "ln_mlp" if two else "input_layernorm", "attn_norm_2": "ln_attn",
        "attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h",
    })


_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_FALCON_GLOBAL_NAMES = {"token_embd.weight": "transformer.word_embeddings.weight", "output.weight": "lm_head.weight",
                        **_weight_and_bias({"output_norm": "transformer.ln_f"})}
_BLOOM_GLOBAL_NAMES = {"token_embd.weight": "transformer.word_embeddings.weight",
                       **_weight_and_bias({"token_embd_norm": "transformer.word_embeddings_layernorm",
                                           "output_norm": "transformer.ln_f"})}
_GPT2_GLOBAL_NAMES = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                      "output.weight": "lm_head.weight", **_weight_and_bias({"output_norm": "transformer.ln_f"})}
# Tensors llama.cpp may add that carry no weights of the model (precomputed RoPE frequencies).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value


class _Metadata:
    """The `{arch}.*` metadata of one file, read with checks: a missing required key, a size that is not
    an integer >= 1, or a real that is not finite and > 0 raises, naming the key."""

    def __init__(self, reader, arch: str, source: str) -> None:
        self.reader, self.arch, self.source = reader, arch, source

    def get(self, key: str, default=None):
        return _field(self.reader, f"{self.arch}.{key}", default)

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.reader.fields

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.source}: the GGUF metadata has no {self.arch}.{key}; is the file complete?")
        return value

    def count(self, key: str, default=None) -> int:
        """A size: an integer >= 1 (a 0 would divide by zero below, a negative build nothing sensible);
        `default` when absent (None: required)."""
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, list):
            raise NotImplementedError(f"{self.source}: per-layer values of {self.arch}.{key} are not supported")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise CheckpointError(f"{self.source}: the GGUF metadata {self.arch}.{key} = {value!r} is not a size "
                                  "(an integer >= 1); the file is corrupt")
        return int(value)

    def real(self, key: str, default=None) -> float:
        """A real number (a norm epsilon, a RoPE base): finite and > 0."""
        value = self.need(key) if default is None else self.get(key, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if not math.isfinite(number) or number <= 0:
            raise CheckpointError(f"{self.source}: the GGUF metadata {self.arch}.{key} = {value!r} is not a finite "
                                  "number > 0; the file is corrupt")
        return number


def hf_config(reader, source: str) -> dict:
    """A Hugging Face config dict from the metadata; raises on what the family cannot represent."""
    arch = _field(reader, "general.architecture")
    if arch not in _LAYOUTS:
        raise NotImplementedError(
            f"{source}: GGUF architecture {arch!r} is not supported; interp reads {sorted(ARCHITECTURES)} GGUF files"
        )
    layout, meta = _LAYOUTS[arch], _Metadata(reader, arch, source)
    if layout.known_keys is not None:
        prefix = f"{arch}."
        unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix):] not in layout.known_keys)
        if unknown:
            raise NotImplementedError(f"{source}: the GGUF metadata key {unknown[0]} = {_field(reader, unknown[0])!r} "
                                      f"is not one interp can represent for {arch}; nothing was loaded")
    names = {t.name for t in reader.tensors}
    config = _common_config(meta, layout, names) if layout.common else {"model_type": layout.model_type}
    return config | layout.config(meta, config, names)


def _vocab_size(meta: _Metadata) -> int:
    if meta.get("vocab_size") is not None:
        return meta.count("vocab_size")
    if "tokenizer.ggml.tokens" in meta.reader.fields:
        return len(meta.reader.fields["tokenizer.ggml.tokens"])
    raise CheckpointError(f"{meta.source}: the GGUF metadata has neither {meta.arch}.vocab_size nor tokenizer.ggml.tokens")


def _common_config(meta: _Metadata, layout: _Layout, names: set[str]) -> dict:
    """The keys every RMSNorm architecture here writes alike (llama's names)."""
    source, arch = meta.source, meta.arch
    n_heads = meta.count("attention.head_count")
    d_model = meta.count("embedding_length")
    if meta.get("attention.key_length") is not None:
        head_dim = meta.count("attention.key_length")
    elif d_model % n_heads:
        raise CheckpointError(f"{source}: embedding_length {d_model} is not a multiple of head_count {n_heads} "
                              "and no attention.key_length is given; the file is corrupt")
    else:
        head_dim = d_model // n_heads
    if meta.count("attention.value_length", head_dim) != head_dim:
        raise NotImplementedError(f"{source}: {arch}.attention.value_length differs from key_length; interp's heads "
                                  "have one width for keys and values")
    rope_dim = meta.count("rope.dimension_count", head_dim)
    partial = {}
    if rope_dim != head_dim:
        if not layout.partial_rotary or rope_dim > head_dim or rope_dim % 2:
            raise NotImplementedError(f"{source}: partial rotary ({arch}.rope.dimension_count = {rope_dim} of "
                                      f"{head_dim} dims) is not supported for GGUF {arch}")
        partial = {"partial_rotary_factor": rope_dim / head_dim}
    return {
        "model_type": layout.model_type,
        "num_hidden_layers": meta.count("block_count"),
        "hidden_size": d_model,
        "intermediate_size": meta.count("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.count("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "vocab_size": _vocab_size(meta),
        "max_position_embeddings": meta.count("context_length", 2048),
        "rms_norm_eps": meta.real("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in names,
        **partial,
    }


def _llama_config(meta: _Metadata, base: dict, names: set[str]) -> dict:
    """Llama, Mistral, Qwen 2: llama's keys. RoPE scaling as llama.cpp's converters write it: linear or YaRN
    in rope.scaling.* (`_stated_rope`), or a `rope_freqs.weight` tensor (Llama 3.1 and later: Llama 3's
    frequency scaling, `_llama3_rope`)."""
    config = {
        "rope_theta": meta.real("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    rope = _stated_rope(meta)
    if "rope_freqs.weight" in names:
        if rope is not None:
            raise NotImplementedError(f"{meta.source}: both {meta.arch}.rope.scaling.type = "
                                      f"{meta.get('rope.scaling.type')!r} and a rope_freqs.weight tensor; interp reads one")
        rope = _llama3_rope(meta, config["rope_theta"], base["head_dim"])
    if rope is not None:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], **rope}
    if base["model_type"] == "qwen2":  # q/k/v biases, no output bias: the family's defaults
        config.pop("attention_bias")
    if meta.get("attention.sliding_window"):
        config["sliding_window"] = meta.count("attention.sliding_window")
    return config


def _stated_rope(meta: _Metadata) -> dict | None:
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


def _llama3_rope(meta: _Metadata, theta: float, rot_dim: int) -> dict | None:
    """transformers' `rope_parameters` for the per-frequency divisors llama.cpp stores as `rope_freqs.weight`
    (None when every divisor is 1). llama.cpp's converter writes Llama 3's scaling only as those divisors:
    f_i = 1 for wavelengths (2 pi / theta_i) under original / high_freq_factor, `factor` over original /
    low_freq_factor, and 1 / ((1 - s) / factor + s) between, s = (original / wavelength - low) / (high - low).
    The divisors fix `factor` (the largest) and s as a line in 1 / wavelength (two numbers), not the three
    parameters: every (original, low, high) on that line gives the same frequencies, and this reads the one
    with low_freq_factor 1 (Llama 3's). Divisors that follow no such line are refused, naming the tensor."""
    source = meta.source
    f = np.asarray(_small_tensor(meta.reader, "rope_freqs.weight", source), np.float64)
    if len(f) != rot_dim // 2:
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' holds {len(f)} values; the rotary pairs are "
                              f"{rot_dim // 2}")
    if not np.isfinite(f).all() or (f < 1 - 1e-6).any():
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' holds divisors below 1 or not finite; the file "
                              "is corrupt or not Llama 3's")
    factor = float(f.max())
    if factor <= 1 + 1e-6:
        return None
    x = (theta ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)) / (2 * math.pi)  # 1 / wavelength
    band = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    refused = CheckpointError(f"{source}: tensor 'rope_freqs.weight' does not follow Llama 3's frequency scaling "
                              "(plateaus at 1 and at the factor, a smooth band between); interp reads only that")
    if band.sum() < 2:
        raise refused
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[band], s, 1)
    if slope <= 0 or intercept >= 0:
        raise refused
    original, high = int(round(-slope / intercept)), float(1 - 1 / intercept)  # low_freq_factor 1
    scaling = RopeScaling("llama3", factor, original, low_freq_factor=1.0, high_freq_factor=high)
    if not np.allclose(to_numpy(llama3_divisors(theta, rot_dim, scaling), np.float64), f, rtol=1e-4, atol=0):
        raise refused
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def _qwen3_config(meta: _Metadata, base: dict, names: set[str]) -> dict:
    """Qwen 3: llama's keys, the head width as attention.key_length (128 where d_model / n_heads is not),
    QK-norm from the tensors, YaRN or linear scaling as stated (`_stated_rope`: the long-context releases'
    YaRN x4 from 32k); llama.cpp runs no sliding window for it, nor does Qwen3Config by default."""
    theta = meta.real("rope.freq_base", 10000.0)
    config = {"rope_theta": theta, "hidden_act": "silu", "use_sliding_window": False}
    rope = _stated_rope(meta)
    return config if rope is None else config | {"rope_parameters": {"rope_theta": theta, **rope}}


def _qwen3moe_config(meta: _Metadata, base: dict, names: set[str]) -> dict:
    """Qwen 3 MoE: Qwen 3's keys and expert_count experts of expert_feed_forward_length, expert_used_count
    chosen per token, their weights always renormalised (llama.cpp's fixed choice for qwen3moe; the
    released models set norm_topk_prob)."""
    return _qwen3_config(meta, base, names) | {
        "num_experts": meta.count("expert_count"),
        "num_experts_per_tok": meta.count("expert_used_count"),
        "moe_intermediate_size": meta.count("expert_feed_forward_length"),
        "norm_topk_prob": True,
    }


def _phi3_config(meta: _Metadata, base: dict, names: set[str]) -> dict:
    """Phi-3: llama's keys, partial rotary (rope.dimension_count < d_head: Phi-4-mini), and LongRoPE when
    the file holds rope_factors_long / rope_factors_short (one factor per rotated pair; the
    original context in rope.scaling.original_context_length, the attention factor in
    rope.scaling.attn_factor). attention.sliding_window is read and not applied: llama.cpp runs Phi-3
    without a window (its loader turns Phi's window off), and transformers' GGUF loading does too."""
    source = meta.source
    rope = {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 10000.0)}
    longrope = {"rope_factors_long.weight", "rope_factors_short.weight"} & names
    scaling = meta.get("rope.scaling.type")
    if scaling not in (None, "none", "longrope") or (scaling == "longrope" and not longrope):
        raise NotImplementedError(f"{source}: phi3.rope.scaling.type = {scaling!r} is not supported (LongRoPE is, "
                                  "with its rope_factors_long / rope_factors_short tensors)")
    config = {"hidden_act": "silu", "rope_scaling": None}
    if longrope:
        if len(longrope) == 1:
            raise CheckpointError(f"{source}: the file holds {sorted(longrope)[0]} but not its pair; it is corrupt")
        factors = {name: _small_tensor(meta.reader, name, source) for name in longrope}
        pairs = int(round(base["head_dim"] * base.get("partial_rotary_factor", 1.0))) // 2
        for name, values in factors.items():
            if len(values) != pairs:
                raise CheckpointError(f"{source}: {name} holds {len(values)} factors, not one per rotated pair "
                                      f"({pairs}); the file is corrupt")
        rope |= {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                 "short_factor": factors["rope_factors_short.weight"]}
        if meta.has("rope.scaling.attn_factor"):
            rope["attention_factor"] = meta.real("rope.scaling.attn_factor")
        config["original_max_position_embeddings"] = meta.count("rope.scaling.original_context_length")
    return config | {"rope_parameters": rope}


def _small_tensor(reader, name: str, source: str) -> list[float]:
    """A small tensor's values (LongRoPE's factors), read while making the config."""
    tensor = next(t for t in reader.tensors if t.name == name)
    try:
        return [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)]
    except (NotImplementedError, ValueError, IndexError) as e:
        raise CheckpointError(f"{source}: tensor {name!r} could not be read ({e})") from e


def _gemma2_config(meta: _Metadata, base: dict, names: set) -> dict:
    """Gemma 2's keys. llama.cpp fixes what the file leaves out: even layers local (sliding), odd ones
    global; one RoPE base (1e4 unless rope.freq_base says); query scale d_head ** -0.5 (d_model / n_heads
    for the 46-layer 27B); GELU (tanh); soft caps 50 on scores and 30 on logits unless the file says."""
    n_layers, d_model, n_heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(n_layers)],
        "sliding_window": meta.count("attention.sliding_window", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 10_000.0)},
        "attn_logit_softcapping": meta.real("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.real("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": d_model // n_heads if n_layers == 46 else base["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma3_config(meta: _Metadata, base: dict, names: set) -> dict:
    """Gemma 3's keys. llama.cpp fixes what the file leaves out, and so does transformers' Gemma3TextConfig:
    a global layer every 6th, local RoPE base 1e4 unscaled, query scale d_head ** -0.5 (d_model / n_heads
    for the 62-layer 27B, as llama.cpp has it), GELU (tanh), no soft-capping."""
    source, n_layers = meta.source, base["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer, True for a sliding-window layer (llama.cpp's newer files)
        if len(pattern) != n_layers or not all(isinstance(p, (bool, np.bool_)) for p in pattern):
            raise CheckpointError(f"{source}: gemma3.attention.sliding_window_pattern = {pattern!r} is not one flag "
                                  f"per layer ({n_layers}); the file is corrupt")
        sliding = [bool(p) for p in pattern]
    else:
        period = meta.count("attention.sliding_window_pattern", 6)
        sliding = [(l + 1) % period != 0 for l in range(n_layers)]
    full = {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 1_000_000.0)}
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":  # Gemma 3 4B-27B scale their global layers' RoPE by 8
        full |= {"rope_type": "linear", "factor": meta.real("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise NotImplementedError(f"{source}: gemma3.rope.scaling.type = {scaling!r} is not supported (linear is)")
    window = meta.count("attention.sliding_window")
    d_model, n_heads = base["hidden_size"], base["num_attention_heads"]
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": meta.real("rope.freq_base_swa", 10_000.0)},
        },
        "query_pre_attn_scalar": d_model // n_heads if n_layers == 62 else base["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _same_heads_and_width(meta: _Metadata, d_model: int, n_heads: int, d_mlp: int | None) -> None:
    """BLOOM and GPT-2 files restate what their models fix: one KV head per head, an MLP of 4 d_model."""
    if meta.count("attention.head_count_kv", n_heads) != n_heads:
        raise NotImplementedError(f"{meta.source}: {meta.arch}.attention.head_count_kv = "
                                  f"{meta.get('attention.head_count_kv')} differs from head_count {n_heads}; "
                                  f"{meta.arch} has one key / value head per head")
    if d_mlp is not None and meta.count("feed_forward_length", d_mlp) != d_mlp:
        raise NotImplementedError(f"{meta.source}: {meta.arch}.feed_forward_length = "
                                  f"{meta.get('feed_forward_length')} is not 4 * embedding_length ({d_mlp}), "
                                  f"which {meta.arch} fixes")


def _falcon_config(meta: _Metadata, base: dict, names: set) -> dict:
    """Falcon as llama.cpp's converter writes it (tensor_data_layout "jploski": the fused QKV's rows as
    [q | k | v], which the tensor transform puts back in Falcon's groups). Always the parallel block;
    head_count_kv 1 with one norm is Falcon-7B (multi_query); otherwise grouped KV heads
    (new_decoder_architecture) with one shared norm (Falcon-11B) or two (attn_norm_2: 40B, 180B)."""
    data_layout = meta.get("tensor_data_layout")
    if data_layout not in (None, "jploski"):
        raise NotImplementedError(f"{meta.source}: falcon.tensor_data_layout = {data_layout!r} is not supported "
                                  "(llama.cpp's 'jploski' is)")
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    n_kv = meta.count("attention.head_count_kv", 1)
    two_norms = "blk.0.attn_norm_2.weight" in names
    config = {
        "hidden_size": d_model,
        "num_attention_heads": n_heads,
        "num_hidden_layers": meta.count("block_count"),
        "vocab_size": _vocab_size(meta),
        "max_position_embeddings": meta.count("context_length", 2048),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "ffn_hidden_size": meta.count("feed_forward_length", 4 * d_model),
        "rope_theta": meta.real("rope.freq_base", 10000.0),
        "alibi": False,
        "bias": "blk.0.attn_qkv.bias" in names,
        "parallel_attn": True,
        "tie_word_embeddings": "output.weight" not in names,
    }
    if n_kv == 1 and not two_norms:
        return config | {"multi_query": True, "new_decoder_architecture": False}
    return config | {"multi_query": False, "new_decoder_architecture": True, "num_kv_heads": n_kv,
                     "num_ln_in_parallel_attn": 2 if two_norms else 1}


def _bloom_config(meta: _Metadata, base: dict, names: set) -> dict:
    """BLOOM: ALiBi, so no RoPE keys; the MLP is 4 d_model and every head has its own key and value."""
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    _same_heads_and_width(meta, d_model, n_heads, 4 * d_model)
    return {
        "n_layer": meta.count("block_count"),
        "hidden_size": d_model,
        "n_head": n_heads,
        "vocab_size": _vocab_size(meta),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "seq_length": meta.count("context_length", 2048),
        "tie_word_embeddings": True,
    }


def _gpt2_config(meta: _Metadata, base: dict, names: set) -> dict:
    """GPT-2: learned positions (one row per context_length position), the MLP width as written."""
    d_model, n_heads = meta.count("embedding_length"), meta.count("attention.head_count")
    _same_heads_and_width(meta, d_model, n_heads, None)
    return {
        "n_layer": meta.count("block_count"),
        "n_embd": d_model,
        "n_head": n_heads,
        "n_inner": meta.count("feed_forward_length", 4 * d_model),
        "n_positions": meta.count("context_length"),
        "vocab_size": _vocab_size(meta),
        "layer_norm_epsilon": meta.real("attention.layer_norm_epsilon"),
        "tie_word_embeddings": "output.weight" not in names,
    }


# ---- tensor transforms: what llama.cpp's converter changed, undone ((tensor, HF config) -> tensor) ----
def _falcon_qkv(x: Tensor, config: dict) -> Tensor:
    """[q | k | v] rows (llama.cpp's "jploski" layout) back to Falcon's groups: per KV head, its
    n_heads / n_kv query heads, then its key, then its value."""
    h = config["num_attention_heads"]
    kv = 1 if config["multi_query"] else config["num_kv_heads"]
    dh = config["hidden_size"] // h
    rest = x.shape[1:]
    q, k, v = x.split([h * dh, kv * dh, kv * dh])
    parts = (q.reshape(kv, h // kv * dh, *rest), k.reshape(kv, dh, *rest), v.reshape(kv, dh, *rest))
    return torch.cat(parts, dim=1).reshape(x.shape)


def _bloom_qkv(x: Tensor, config: dict) -> Tensor:
    """[q | k | v] rows (llama.cpp's converter) back to BLOOM's per-head [q, k, v] rows."""
    h = config["n_head"]
    return x.reshape(3, h, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def _conv1d(x: Tensor, config: dict) -> Tensor:
    """llama.cpp stores GPT-2's Conv1D weights [in, out] transposed, as Linear weights [out, in]."""
    return x.T


@dataclass(frozen=True)
class _Layout:
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
    config: Callable[[_Metadata, dict, set], dict]
    layer_names: dict[str, str] | Callable[[dict], dict[str, str]]
    permuted_qk: bool
    norm_shift: float = 0.0
    known_keys: frozenset[str] | None = None
    prefix: str = "model.layers."
    global_names: Mapping[str, str] = field(default_factory=lambda: _GLOBAL_NAMES)
    transforms: Mapping[str, Callable[[Tensor, dict], Tensor]] = field(default_factory=dict)
    merged: Mapping[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = field(default_factory=dict)
    ignored: tuple[str, ...] = _IGNORED
    common: bool = True
    partial_rotary: bool = False


_GEMMA3_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
})
# What llama.cpp's converters write for each newer architecture (its base TextModel's keys where the
# architecture uses them); any other `{arch}.` key raises, naming it.
_RMS_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
})
_QWEN3_KEYS = _RMS_KEYS | {"rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor"}
_QWEN3MOE_KEYS = _QWEN3_KEYS | {"expert_count", "expert_used_count", "expert_feed_forward_length"}
_GEMMA2_KEYS = _RMS_KEYS - {"rope.scaling.type"} | {"attention.sliding_window", "attn_logit_softcapping",
                                                     "final_logit_softcapping"}
_PHI3_KEYS = _RMS_KEYS | {"attention.sliding_window", "rope.scaling.original_context_length",
                          "rope.scaling.attn_factor"}
_LAYERNORM_KEYS = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
                             "attention.head_count", "attention.head_count_kv", "attention.layer_norm_epsilon"})
_FALCON_KEYS = _LAYERNORM_KEYS | {"tensor_data_layout", "rope.freq_base"}
_qwen3 = dict(permuted_qk=False, ignored=())  # NEOX-style RoPE in llama.cpp: Hugging Face's row order
_LAYOUTS = {
    "llama": _Layout("llama", _llama_config, _LLAMA_LAYER_NAMES, permuted_qk=True),
    "mistral": _Layout("mistral", _llama_config, _LLAMA_LAYER_NAMES, permuted_qk=True),
    "qwen2": _Layout("qwen2", _llama_config, _LLAMA_LAYER_NAMES, permuted_qk=False),
    "qwen3": _Layout("qwen3", _qwen3_config, _QWEN3_LAYER_NAMES, known_keys=_QWEN3_KEYS, **_qwen3),
    "qwen3moe": _Layout("qwen3_moe", _qwen3moe_config, _QWEN3MOE_LAYER_NAMES, known_keys=_QWEN3MOE_KEYS, **_qwen3,
                        merged={"mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                                                             lambda gate, up: torch.cat([gate, up], dim=1))}),
    "phi3": _Layout("phi3", _phi3_config, _PHI3_LAYER_NAMES, permuted_qk=False, known_keys=_PHI3_KEYS,
                    ignored=("rope_factors_long.weight", "rope_factors_short.weight"), partial_rotary=True),
    "gemma2": _Layout("gemma2", _gemma2_config, _GEMMA2_LAYER_NAMES, permuted_qk=False, norm_shift=1.0,
                      known_keys=_GEMMA2_KEYS, ignored=()),
    "gemma3": _Layout("gemma3_text", _gemma3_config, _GEMMA3_LAYER_NAMES, permuted_qk=False, norm_shift=1.0,
                      known_keys=_GEMMA3_KEYS),
    "falcon": _Layout("falcon", _falcon_config, _falcon_layer_names, permuted_qk=False, known_keys=_FALCON_KEYS,
                      prefix="transformer.h.", global_names=_FALCON_GLOBAL_NAMES, ignored=(), common=False,
                      transforms={"attn_qkv.weight": _falcon_qkv, "attn_qkv.bias": _falcon_qkv}),
    # BLOOM ties its unembedding; llama.cpp's converter writes a copy of the embedding as output.weight,
    # which is not read (as transformers' GGUF loading does not): the tied embedding is the unembedding.
    "bloom": _Layout("bloom", _bloom_config, _BLOOM_LAYER_NAMES, permuted_qk=False, known_keys=_LAYERNORM_KEYS,
                     prefix="transformer.h.", global_names=_BLOOM_GLOBAL_NAMES, ignored=("output.weight",),
                     common=False, transforms={"attn_qkv.weight": _bloom_qkv, "attn_qkv.bias": _bloom_qkv}),
    "gpt2": _Layout("gpt2", _gpt2_config, _GPT2_LAYER_NAMES, permuted_qk=False, known_keys=_LAYERNORM_KEYS,
                    prefix="transformer.h.", global_names=_GPT2_GLOBAL_NAMES, ignored=(), common=False,
                    transforms={f"{n}.weight": _conv1d for n in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}),
}
ARCHITECTURES = {arch: layout.model_type for arch, layout in _LAYOUTS.items()}  # GGUF architecture -> HF model_type


__all__ = ["ARCHITECTURES", "hf_config"]
