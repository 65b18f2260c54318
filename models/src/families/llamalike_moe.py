"""The Llama-like families whose MLP is a mixture of experts (`interp.models.native.moe`): the attention and norms
of `llamalike.py` (RMSNorm, rotary, GQA, separate q/k/v projections), and in every block a linear router
choosing num_experts_per_tok of num_experts SwiGLU experts.

- Mixtral (Jiang et al. 2024; `model_type` "mixtral"): Mistral's block (an optional sliding window on
  every layer), num_local_experts experts of intermediate_size, the chosen weights always renormalised.
- Qwen2-MoE (Qwen Team 2024; "qwen2_moe"): Qwen2's block (q/k/v biases: `qkv_bias`), experts of
  moe_intermediate_size, renormalised when norm_topk_prob, and a shared expert of
  shared_expert_intermediate_size that every token goes through, scaled by sigmoid(x W_shared_gate).
- Qwen3-MoE (Qwen Team 2025; "qwen3_moe"): Qwen3's block (QK-norm over each head, no biases), experts of
  moe_intermediate_size, renormalised when norm_topk_prob.
- OLMoE (Muennighoff et al. 2024; "olmoe"): QK-norm over the whole query and key projections (as OLMo 2:
  `qk_norm_over="projection"`), experts of intermediate_size, renormalised when norm_topk_prob.

The experts are read from either Hugging Face layout: transformers 5's fused 3-D parameters
(`mlp.experts.gate_up_proj` [experts, 2 d_mlp, d_model], the gate rows first, and `mlp.experts.down_proj`
[experts, d_model, d_mlp]), as a model in memory holds them, or one Linear per expert (`mlp.experts.E.gate_proj`
/ `up_proj` / `down_proj`; Mixtral's `block_sparse_moe.experts.E.w1` / `w3` / `w2`), as checkpoints on disk
hold them. Dense layers between the sparse ones (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused,
as is OLMoE's `clip_qkv`. Defaults for absent keys are Hugging Face's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..config import ModelConfig
from interp.errors import CheckpointError
from .llamalike import _config as llamalike_config
from .builders import TensorGetter, linears, llama_layer, llama_weights, reject, require, t
from . import qwen3
from .gguf_layout import GGUFLayout
from .registry import Family, register

if TYPE_CHECKING:
    from ..formats.gguf_layouts import Metadata

# Hugging Face's defaults for keys a config.json may leave out, per family.
_DEFAULTS = {
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False, qkv_bias=True,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=False, use_sliding_window=False,
                      sliding_window=4096),
    "olmoe": dict(rms_norm_eps=1e-5, rope_theta=10000.0, norm_topk_prob=False),
}


def _n_experts(d: dict, mt: str) -> int:
    """num_local_experts or num_experts: transformers maps each family's own name to the other."""
    n = d.get("num_local_experts") if d.get("num_local_experts") is not None else d.get("num_experts")
    if n is None:
        raise ValueError(f"{mt} config has no 'num_experts' / 'num_local_experts'; is this a complete config.json?")
    return n


def _config(d: dict, mt: str, *, d_mlp_key: str, qkv_bias: bool = False, window: bool = False,
            **changes) -> ModelConfig:
    d = {**_DEFAULTS[mt], **d}
    reject(d, mt, decoder_sparse_step=lambda v: v != 1, mlp_only_layers=bool, clip_qkv=lambda v: True)
    cfg = llamalike_config(d, mt, qkv_bias=qkv_bias, out_bias=False, window=window)
    return cfg.replace(d_mlp=require(d, d_mlp_key, mt), num_experts=_n_experts(d, mt),
                       experts_per_token=require(d, "num_experts_per_tok", mt),
                       norm_topk_prob=bool(d.get("norm_topk_prob", True)), **changes)


def mixtral(d: dict) -> ModelConfig:
    return _config({**d, "norm_topk_prob": True}, "mixtral", d_mlp_key="intermediate_size", window=True)


def qwen2_moe(d: dict) -> ModelConfig:
    d = {**_DEFAULTS["qwen2_moe"], **d}
    if not d["use_sliding_window"]:
        d["sliding_window"] = None  # Qwen2MoeConfig drops the window unless use_sliding_window
    elif d.get("layer_types") is None:  # as Qwen2MoeConfig derives them: every other layer below max_window_layers
        n_layers = require(d, "num_hidden_layers", "qwen2_moe")
        d["layer_types"] = ["sliding_attention" if (l + 1) % 2 and l < d["max_window_layers"] else "full_attention"
                            for l in range(n_layers)]
    return _config(d, "qwen2_moe", d_mlp_key="moe_intermediate_size", qkv_bias=bool(d["qkv_bias"]), window=True,
                   d_mlp_shared=require(d, "shared_expert_intermediate_size", "qwen2_moe"),
                   prepend_bos=False)  # as Qwen2 (TransformerLens's Qwen adapters: no BOS)


def qwen3_moe(d: dict) -> ModelConfig:
    d = {**_DEFAULTS["qwen3_moe"], **d}
    if not d["use_sliding_window"]:
        d["sliding_window"] = None  # Qwen3MoeConfig drops the window unless use_sliding_window
    return _config(d, "qwen3_moe", d_mlp_key="moe_intermediate_size", window=True, qk_norm=True, prepend_bos=False)


def olmoe(d: dict) -> ModelConfig:
    return _config(d, "olmoe", d_mlp_key="intermediate_size", qk_norm=True, qk_norm_over="projection")


def _experts(cfg: ModelConfig, get: TensorGetter, prefixes: tuple[str, ...], names: tuple[str, str, str],
             o: str) -> dict:
    """The router and every expert of one block, from whichever layout the checkpoint has; `prefixes`: where
    the block's MLP may sit (Mixtral's `mlp.` or `block_sparse_moe.`), `names`: the per-expert Linears
    (gate, up, down)."""

    def first(leaf: str):
        return get(*(pre + leaf for pre in prefixes))

    sd = {o + "W_gate": t(first("gate.weight"))}
    try:
        gate_up, down = first("experts.gate_up_proj"), first("experts.down_proj")
    except CheckpointError:  # one Linear per expert, as checkpoints on disk hold them
        g, u, dn = names
        per_expert = [(first(f"experts.{e}.{g}.weight"), first(f"experts.{e}.{u}.weight"),
                       first(f"experts.{e}.{dn}.weight")) for e in range(cfg.num_experts)]
    else:
        gate, up = gate_up.chunk(2, dim=1)
        per_expert = [(gate[e], up[e], down[e]) for e in range(cfg.num_experts)]
    for e, (g, u, dn) in enumerate(per_expert):
        sd |= {f"{o}experts.{e}.W_gate": t(g), f"{o}experts.{e}.W_in": t(u), f"{o}experts.{e}.W_out": t(dn)}
    return sd


def _mlp(cfg: ModelConfig, get: TensorGetter, p: str, o: str, *, prefixes: tuple[str, ...],
         names: tuple[str, str, str]) -> dict:
    """A block's experts (`_experts`) and, where the config has one, its shared expert and that expert's gate."""
    sd = _experts(cfg, get, tuple(p + pre for pre in prefixes), names, o + "mlp.")
    if cfg.d_mlp_shared is not None:
        sd |= linears(get, o + "mlp.", p + "mlp.shared_expert.",
                      {"shared_expert.gate": "gate_proj", "shared_expert.in": "up_proj", "shared_expert.out": "down_proj"})
        sd |= linears(get, o, p, {"mlp.shared_gate": "mlp.shared_expert_gate"})
    return sd


def _weights(prefixes: tuple[str, ...], names: tuple[str, str, str]):
    """The weights of a checkpoint whose experts sit under `prefixes` as Linears called `names` (gate, up, down)."""
    mlp = functools.partial(_mlp, prefixes=prefixes, names=names)
    return functools.partial(llama_weights, layer=functools.partial(llama_layer, mlp=mlp))


_linear_names = _weights(("mlp.",), ("gate_proj", "up_proj", "down_proj"))
_mixtral_weights = _weights(("mlp.", "block_sparse_moe."), ("w1", "w3", "w2"))


# ---- GGUF: how llama.cpp writes Qwen 3 MoE ----
# Qwen 3's tensor names, the router and the experts' stacked down projections (gate and up are merged).
_GGUF_NAMES = {k: v for k, v in qwen3.GGUF_NAMES.items() if not k.startswith("ffn_")} | {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_GGUF_KEYS = qwen3.GGUF_KEYS | {"expert_count", "expert_used_count", "expert_feed_forward_length"}


def _gguf_config(meta: Metadata, base: dict, names: set[str]) -> dict:
    """Qwen 3 MoE: Qwen 3's keys and expert_count experts of expert_feed_forward_length, expert_used_count
    chosen per token, their weights always renormalised (llama.cpp's fixed choice for qwen3moe; the
    released models set norm_topk_prob)."""
    return qwen3.gguf_config(meta, base, names) | {
        "num_experts": meta.count("expert_count"),
        "num_experts_per_tok": meta.count("expert_used_count"),
        "moe_intermediate_size": meta.count("expert_feed_forward_length"),
        "norm_topk_prob": True,
    }


_GGUF = GGUFLayout("qwen3_moe", _gguf_config, _GGUF_NAMES, known_keys=_GGUF_KEYS, permuted_qk=False, ignored=(),
                   merged={"mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                                                        lambda gate, up: torch.cat([gate, up], dim=1))})


register(Family("mixtral", ("mixtral",), mixtral, _mixtral_weights))
register(Family("qwen2_moe", ("qwen2_moe",), qwen2_moe, _linear_names))
register(Family("qwen3_moe", ("qwen3_moe",), qwen3_moe, _linear_names, gguf={"qwen3moe": _GGUF}))
register(Family("olmoe", ("olmoe",), olmoe, _linear_names))
