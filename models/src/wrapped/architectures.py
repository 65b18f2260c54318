"""How interp runs an architecture it has no family for: transformers' causal-LM class for a model type,
whether its attention goes through transformers' attention interface, the parts of a built model (decoder
layers, their attention and MLP modules), our config's view of it, and the table of every causal LM
(`interp info --architectures`)."""

from __future__ import annotations

import sys

from torch import nn

from interp.errors import UserError

from ..base import native_families
from ..config import ModelConfig
from ..families import FAMILIES

class Bypasses(UserError, NotImplementedError):
    """An architecture whose attention does not go through transformers' attention interface."""



# ---- finding the parts of a Hugging Face model --------------------------------------------------

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


def _text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _decoder_layers(hf) -> tuple[nn.Module, nn.ModuleList]:
    """(the module holding the decoder layers, the layers)."""
    n = _first(_text_config(hf.config), "num_hidden_layers", "n_layer", "num_layers")
    for name, mod in hf.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks", "layer"):
            parent = hf.get_submodule(name.rsplit(".", 1)[0]) if "." in name else hf
            return parent, mod
    raise refusal(_text_config(hf.config).model_type, f"interp finds no ModuleList of its {n} decoder layers "
                  "(called layers / h / blocks) in {type(hf).__name__}")


def _child(module: nn.Module, names) -> tuple[str, nn.Module] | tuple[None, None]:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None, None


def _first(cfg, *keys, default=None):
    for key in keys:
        value = getattr(cfg, key, None) if not isinstance(cfg, dict) else cfg.get(key)
        if value is not None:
            return value
    return default


def uses_interface(attn_cls: type) -> bool:
    """Whether an attention class's module calls transformers' attention registry."""
    return "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[attn_cls.__module__])


def causal_lm_class(model_type: str):
    """transformers' causal-LM class for `model_type`, or None when it has none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def refusal(model_type, why: str) -> Bypasses:
    """The one line for an architecture interp cannot run: what, why, and what does run."""
    return Bypasses(f"unsupported architecture model_type={model_type!r}: {why}; interp converts "
                    f"{native_families()} natively and wraps any transformers causal LM whose attention goes through "
                    "its attention interface (interp info --architectures)")


def check_wrappable(model_type: str | None) -> None:
    """Raise `Bypasses` (one line) unless transformers has a causal LM for `model_type` whose attention
    goes through its attention interface. Needs transformers; reads no weights (`check_structure` then
    checks the model itself, built on the meta device where no weights exist yet)."""
    try:
        import transformers  # noqa: F401 - optional: only wrapped models need it
    except ImportError:
        raise UserError(f"model_type {model_type!r} is not a native family of interp ({', '.join(native_families())}); "
                        "running it wrapped needs transformers: pip install 'interp[hf]'") from None
    cls = causal_lm_class(model_type) if model_type else None
    if cls is None:
        raise refusal(model_type, "transformers has no causal language model for it")
    if "ALL_ATTENTION_FUNCTIONS" not in vars(sys.modules[cls.__module__]):
        raise refusal(model_type, f"{cls.__name__} computes attention in its own code, not through transformers' "
                                  "attention interface, so interp cannot hook it")


def check_structure(hf) -> tuple[nn.Module, nn.ModuleList, list[nn.Module], list[nn.Module | None]]:
    """(the module holding the decoder layers, the layers, each layer's attention and MLP modules) of a
    transformers model, or `Bypasses`: no decoder layers, an attention module that bypasses the
    interface, or attention that is not causal (an encoder such as BERT, whose causal-LM head is a
    decoder only when its config says so)."""
    model_type = str(_text_config(hf.config).model_type)
    base, layers = _decoder_layers(hf)
    attns, mlps = [], []
    for l, layer in enumerate(layers):
        attn = _child(layer, _ATTN_NAMES)[1]
        if attn is None:
            raise refusal(model_type, f"{type(layer).__name__} (layer {l}) has no attention module called "
                                      f"{' / '.join(_ATTN_NAMES)}")
        if not uses_interface(type(attn)):
            raise refusal(model_type, f"{type(attn).__name__} computes attention in its own code, not through "
                                      "transformers' attention interface")
        both_ways = [m for m in attn.modules() if getattr(m, "is_causal", True) is False]
        if both_ways:
            raise refusal(model_type, f"{type(both_ways[0]).__name__} attends both ways (is_causal=False): interp "
                                      "studies causal language models")
        attns.append(attn)
        mlps.append(_child(layer, _MLP_NAMES)[1])
    return base, layers, attns, mlps


def wrapped_config(hf_config, windows: list[int | None]) -> ModelConfig:
    """Our config's view of a wrapped model: its shape (layers, widths, heads, vocabulary, context,
    windows), for analyses that read sizes. The computation is transformers'; `model_type` says which."""
    c = _text_config(hf_config)
    d_model = _first(c, "hidden_size", "n_embd", "d_model")
    n_heads = _first(c, "num_attention_heads", "n_head", "num_heads")
    d_head = _first(c, "head_dim", default=d_model // n_heads)
    window = next((w for w in windows if w is not None), None)
    return ModelConfig(
        n_layers=len(windows), d_model=d_model, n_heads=n_heads, d_head=d_head,
        n_kv_heads=_first(c, "num_key_value_heads", "num_kv_heads", default=n_heads) if _first(c, "multi_query") is not True else 1,
        d_vocab=_first(c, "vocab_size"),
        n_ctx=_first(c, "max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", default=2048),
        d_mlp=_first(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * d_model),
        positional="rotary" if _first(c, "rope_parameters", "rope_theta", "rope_scaling") is not None else None,
        sliding_window=window,
        layer_types=tuple("sliding" if w is not None else "full" for w in windows) if window is not None else None,
        tie_embeddings=bool(_first(c, "tie_word_embeddings", default=False)),
        model_type=str(c.model_type),
    )


def config_windows(c, n: int) -> list[int | None]:
    """Each layer's sliding window as a transformers config states it (`sliding_window`, with
    `layer_types` or `use_sliding_window` / `max_window_layers` where the config has them)."""
    window = _first(c, "sliding_window")
    types = _first(c, "layer_types")
    if window is None or _first(c, "use_sliding_window") is False:
        return [None] * n
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def config_from_hf(hf_config) -> ModelConfig:
    """`wrapped_config` of a transformers config object, its windows per layer as the config states them."""
    c = _text_config(hf_config)
    return wrapped_config(c, config_windows(c, _first(c, "num_hidden_layers", "n_layer", "num_layers")))


# The causal LMs the issue tracker listed, in its order: `interp info --architectures` and the README's table.
LISTED = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma3_text", "gemma", "gemma2", "qwen3", "olmo", "olmo2",
          "phi", "phi3", "gptj", "gpt_neo", "opt", "bloom", "falcon", "mpt", "stablelm", "starcoder2", "cohere",
          "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "codegen", "gpt_bigcode", "exaone", "glm",
          "glm4", "smollm3", "apertus", "arcee", "ministral", "seed_oss", "nemotron", "xglm", "openai-gpt")


def architecture(model_type: str) -> tuple[str, str]:
    """(how interp runs `model_type`: "native", "wrapped" or "refused", and why, in a few words)."""
    if model_type in FAMILIES:
        return "native", f"converted by models/src/families ({FAMILIES[model_type].name})"
    try:
        check_wrappable(model_type)
    except UserError as e:
        reason = "no transformers causal LM" if causal_lm_class(model_type) is None else \
            "attention computed outside transformers' attention interface"
        return "refused", reason if "transformers" not in str(e) or "pip install" not in str(e) else "needs transformers"
    return "wrapped", f"transformers' {causal_lm_class(model_type).__name__}, interp's attention function"


def architecture_table(model_types=LISTED) -> str:
    """A Markdown table: model_type, transformers' class, how interp runs it and why."""
    rows = ["| model_type | transformers class | interp | how |", "|---|---|---|---|"]
    for t in model_types:
        status, why = architecture(t)
        cls = causal_lm_class(t)
        rows.append(f"| {t} | {cls.__name__ if cls else '-'} | {status} | {why} |")
    counts = {s: sum(architecture(t)[0] == s for t in model_types) for s in ("native", "wrapped", "refused")}
    rows.append("")
    rows.append(f"{counts['native']} native, {counts['wrapped']} wrapped, {counts['refused']} refused.")
    return "\n".join(rows)


def every_causal_lm() -> dict[str, list[str]]:
    """Every causal-LM model type of the installed transformers, by how interp runs it: "native";
    "wrapped" (its model, built on the meta device from its default config, passes `check_structure`);
    "refused" (attention outside the interface, or a structure interp cannot hook: recurrent or
    linear-attention hybrids, cross-attention layers, encoders); "unchecked" (its default config does not
    build, or its model file does not import here)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, list[str]] = {"native": [], "wrapped": [], "refused": [], "unchecked": []}
    for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            status = architecture(t)[0]
            if status == "wrapped":
                with torch.device("meta"):
                    check_structure(causal_lm_class(t)(AutoConfig.for_model(t)))
        except UserError:
            status = "refused"
        except Exception:  # noqa: BLE001 - a default config that does not build, a missing optional dependency
            status = "unchecked"
        out[status].append(t)
    return out
