"""A Hugging Face checkpoint folder, read without `transformers`: config.json's `model_type` picks the
family (`families/`), which writes our config and converts the weights (safetensors, sharded or not,
or a weights-only `pytorch_model.bin`). A `model_type` no native family claims is loaded by
transformers and wrapped (`interp.models.wrapped`), when its attention goes through transformers'
attention interface; otherwise it is refused in one line before any weight is read."""

from __future__ import annotations

import math
from pathlib import Path

from .build import build_model, check_finite, config_errors, convert_weights
from ..config import ModelConfig
from interp.errors import CheckpointError
from ..families import FAMILIES, get_family
from .folder import local_tokenizer
from ..placement.tensor_files import read_state_dict, release_pages
from ..native.transformer import HookedTransformer
from .. import wrapped


# The sizes a wrapped config.json names, under the names transformers' configs use; a config past
# MAX_LAYERS is a damaged or hostile file (the deepest published causal LMs have about 200 layers), and
# building its model on the meta device would take minutes before the refusal.
_SIZE_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_attention_heads", "n_head",
              "num_key_value_heads", "hidden_size", "n_embd", "d_model", "intermediate_size", "vocab_size", "head_dim")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
MAX_LAYERS = 1024


def _check_numbers(raw: dict) -> None:
    """Refuse, before transformers builds anything, sizes that are not positive whole numbers, a layer
    count no model has, and a rotary base or rope parameter that is not a finite positive number."""
    for key in _SIZE_KEYS:
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{key} must be a whole number >= 1, got {v!r}")
        if key in _LAYER_KEYS and v is not None and v > MAX_LAYERS:
            raise ValueError(f"{key}={v} is more layers than any model has (at most {MAX_LAYERS} are read)")
    rope = [raw] + [raw[k] for k in ("rope_parameters", "rope_scaling") if isinstance(raw.get(k), dict)]
    for where in rope:
        for key in ("rope_theta", "factor", "attention_factor", "low_freq_factor", "high_freq_factor",
                    "beta_fast", "beta_slow"):
            v = where.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ValueError(f"{key} must be a finite number > 0, got {v!r}")


def _structure(raw: dict):
    """The transformers config of a non-native config.json, after checking that interp can wrap its model:
    a causal LM whose attention goes through transformers' attention interface (`wrapped.check_wrappable`),
    built on the meta device (no memory, no weights) to check its layers (`wrapped.check_structure`)."""
    wrapped.check_wrappable(raw.get("model_type"))
    _check_numbers(raw)
    import torch
    from transformers import AutoConfig

    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        wrapped.check_structure(wrapped.causal_lm_class(raw["model_type"])(config))
    return config


def wrapped_n_params(raw: dict) -> int:
    """The parameter count of a non-native config.json's model, built on the meta device (no memory): what the
    load's memory check weighs before transformers reads a weight."""
    import torch

    config = _structure(raw)
    with torch.device("meta"):
        model = wrapped.causal_lm_class(raw["model_type"])(config)
    return sum(p.numel() for p in model.parameters())


def config_from_raw(raw: dict) -> ModelConfig:
    """`wrapped_config` from a config.json's contents, without weights (transformers' config class fills
    its defaults, so the windows per layer are the model's)."""
    return wrapped.config_from_hf(_structure(raw))


def load_wrapped(path, raw: dict, *, dtype, device, tokenizer) -> wrapped.WrappedModel:
    """A Hugging Face folder of a non-native architecture, loaded by transformers (never its own code)
    and wrapped. Everything that can be refused is refused before a weight is read; weights that do not
    match the config are refused after, naming the tensor."""
    with config_errors(Path(path) / "config.json"):
        _structure(raw)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    wrapped.register_interface()
    hf_logging.disable_progress_bar()  # one line per load is ours to print, not a bar per weight file
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its loading report: the problems are said below, in one line
    sdpa = getattr(wrapped.causal_lm_class(raw["model_type"]), "_supports_sdpa", False)
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True,
            attn_implementation="sdpa" if sdpa else "eager")
    except OSError as e:  # no weight file, an unreadable one
        raise CheckpointError(f"{path}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = [f"{what} {names[0] if isinstance(names[0], str) else names[0][0]!r}"
                + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
                for what, names in (("missing tensor", sorted(info.get("missing_keys") or [])),
                                    ("unexpected tensor", sorted(info.get("unexpected_keys") or [])),
                                    ("tensor of the wrong shape", list(info.get("mismatched_keys") or [])))
                if names]
    if problems:
        raise CheckpointError(f"{path}: the weights do not match config.json: {'; '.join(problems)}")
    check_finite(dict(hf.state_dict()), str(path))
    if device is not None:
        hf = hf.to(device)
    return wrapped.WrappedModel(hf, tokenizer=tokenizer, name=str(path))


def native(raw: dict) -> bool:
    """Whether a native family converts this config.json's model_type (else it is wrapped)."""
    return raw.get("model_type") in FAMILIES


def config(path: Path, raw: dict) -> ModelConfig:
    """The config of a folder's config.json; one that cannot be a model (zero heads, a layer count that is a
    string, a NaN rope parameter) is refused in one line naming the file, before any weight is read."""
    with config_errors(Path(path) / "config.json"):
        if not native(raw):
            return config_from_raw(raw)
        return get_family(raw.get("model_type")).config(raw)


def load(path: Path, raw: dict, *, dtype, device, tokenizer, offload=None, device_map=None) -> HookedTransformer:
    if not native(raw):  # an offload or a device map was refused by `load_checkpoint` (`Placement.refuse_wrapped`)
        return load_wrapped(path, raw, dtype=dtype, device=device,
                                    tokenizer=tokenizer if tokenizer is not None else local_tokenizer(path))
    family = get_family(raw.get("model_type"))
    cfg = config(path, raw)
    raw_tensors = read_state_dict(path)
    sd = convert_weights(family, cfg, raw_tensors, str(path))
    release_pages(raw_tensors.values())  # what the conversion copied from is read; the views fault back in
    del raw_tensors
    model = build_model(cfg, sd, str(path), dtype, device, fresh=True, offload=offload,
                        device_map=device_map)
    model.tokenizer = tokenizer if tokenizer is not None else local_tokenizer(path)
    return model
