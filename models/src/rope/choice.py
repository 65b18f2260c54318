"""RoPE scaling chosen at inference: a model trained without it (or with another) run with linear, dynamic
NTK, static NTK, YaRN, Llama 3's or LongRoPE scaling, as `interp.load(..., rope_scaling=...)` and the
commands' `--rope-scaling TYPE:FACTOR[:ORIGINAL_LEN]` ask. A checkpoint's own scaling is read by its
family (`families.registry.rotary_from_hf`); this is the one a user puts in its place.

Three spellings, one meaning (`rope_spec` makes each of them transformers' dict):

    "yarn:2", "yarn:2:4096"                 the command line's: type, factor, original length
    RopeScaling("yarn", 2.0)                interp's own (`interp.models.config`)
    {"rope_type": "yarn", "factor": 2.0}    transformers' `rope_parameters`: its names and its defaults

The types are transformers' names (`ROPE_INIT_FUNCTIONS` in `transformers.modeling_rope_utils`, and
"default": plain RoPE, no scaling) that interp computes, and interp's static "ntk" (the base rescaled
once, beside transformers' dynamic NTK, which rescales it by the sequence's length). The original length
(what dynamic NTK, YaRN, Llama 3 and LongRoPE scale from) is the model's trained context (n_ctx) unless
given. What the spelling alone gets wrong (a type, a factor, a key the type does not read) is refused by
`rope_spec`; what needs the model (rotary positions, LongRoPE's factor per frequency, a base that is
not the model's) by `choose`, from the config, before any weight is read. Each refusal is one line
(`BadValue`). On a model whose sliding layers rotate with a base of their own (Gemma 3), the scaling is
the full layers', as Gemma 3's own configs scale only those.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..config import FACTOR_RANGE, ModelConfig, RopeScaling
from interp.errors import BadValue, check_int, check_real
from ..families.registry import rotary_from_hf

ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "llama3", "longrope")
# Types defined as a context stretched by `factor`, so a factor below 1 means nothing to them: dynamic NTK
# raises the base only past the original length, YaRN and Llama 3 interpolate the long wavelengths by the
# factor and keep the short ones, LongRoPE's factor is the extension its attention factor is computed from.
# Linear and static NTK are plain rescalings (of the positions, of the base), any factor > 0: below 1 they
# compress the context, a way to see what the heads read.
FACTOR_AT_LEAST_ONE = ("dynamic", "yarn", "llama3", "longrope")
# The rope_parameters each type reads, in transformers' names; "original_max_position_embeddings" for
# dynamic is interp's (transformers' dynamic NTK scales from max_position_embeddings, the default here too).
TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
}
# Keys of a full rope_parameters dict that describe the model itself: taken when they agree with it.
MODEL_KEYS = ("rope_theta", "partial_rotary_factor")
_NAMES = {"linear": "linear (position interpolation)", "dynamic": "dynamic NTK", "ntk": "static NTK-aware",
          "yarn": "YaRN", "llama3": "Llama 3's", "longrope": "LongRoPE"}


def _check_type(kind) -> str:
    if kind not in ROPE_TYPES:
        raise BadValue(f"rope_scaling type {kind!r} is not one of {', '.join(ROPE_TYPES)} (transformers' rope types "
                       "that interp computes, and interp's static 'ntk')")
    return kind


def parse_rope_scaling(text: str) -> dict[str, Any]:
    """The command line's spelling TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_LEN ("yarn:2", "llama3:8:8192"; "default":
    no scaling) as transformers' dict, checked (`rope_spec`)."""
    parts = [p.strip() for p in str(text).split(":")]
    kind = _check_type(parts[0])
    if kind == "default" and len(parts) == 1:
        return {"rope_type": "default"}
    if len(parts) not in (2, 3):
        raise BadValue(f"rope_scaling is TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_LEN (e.g. yarn:2 or yarn:2:4096), "
                       f"got {text!r}")
    try:
        spec: dict[str, Any] = {"rope_type": kind, "factor": float(parts[1])}
        if len(parts) == 3:
            spec["original_max_position_embeddings"] = int(parts[2])
    except ValueError:
        raise BadValue(f"rope_scaling {text!r}: the factor is a number and the original length a whole number of "
                       "tokens (e.g. yarn:2:4096)") from None
    return rope_spec(spec)


def rope_spec(given) -> dict[str, Any]:
    """Any spelling of a scaling (the command line's string, a `RopeScaling`, transformers' dict, whose older
    key "type" is read as "rope_type") as transformers' dict, checked without the model: a type interp
    computes, the keys that type reads, a factor > 0 (>= 1 for `FACTOR_AT_LEAST_ONE`), a whole original
    length, LongRoPE's two factor lists."""
    if isinstance(given, str):
        return parse_rope_scaling(given)
    if isinstance(given, RopeScaling):
        given = as_hf(given)
    if not isinstance(given, Mapping):
        raise BadValue("rope_scaling is transformers' rope_parameters (a dict), a RopeScaling or 'TYPE:FACTOR', got a "
                       f"{type(given).__name__}")
    spec = dict(given)
    if "type" in spec and "rope_type" not in spec:
        spec["rope_type"] = spec.pop("type")
    kind = _check_type(spec.get("rope_type"))
    unread = sorted(set(spec) - {"rope_type", *TYPE_KEYS[kind], *MODEL_KEYS})
    if unread:
        reads = ", ".join(TYPE_KEYS[kind]) or "nothing else"
        raise BadValue(f"rope_scaling {kind!r} does not read {', '.join(unread)} (it reads {reads})")
    factor = spec.get("factor")
    if factor is None and "factor" in TYPE_KEYS[kind] and kind != "longrope":  # longrope's: its lengths' ratio
        raise BadValue(f"rope_scaling {kind!r} needs a factor (e.g. {kind}:2)")
    if factor is not None:
        check_real("rope_scaling's factor", factor, minimum=0, strict=True)
        if kind in FACTOR_AT_LEAST_ONE and factor < 1:
            raise BadValue(f"rope_scaling {kind!r} stretches the context by its factor, which must be >= 1, got "
                           f"{factor} (linear and ntk take a factor below 1)")
        if not FACTOR_RANGE[0] <= factor <= FACTOR_RANGE[1]:
            raise BadValue(f"rope_scaling's factor {factor:g} is outside {FACTOR_RANGE[0]:g} to {FACTOR_RANGE[1]:g}: no "
                           "model is scaled so; check the number (e.g. yarn:2)")
    for key in ("attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "mscale",
                "mscale_all_dim"):
        if spec.get(key) is not None:  # a NaN here is every logit NaN, blamed on the weights downstream
            check_real(f"rope_scaling's {key}", spec[key], minimum=0, strict=not key.startswith("mscale"))
    if spec.get("original_max_position_embeddings") is not None:
        check_int("rope_scaling's original_max_position_embeddings", spec["original_max_position_embeddings"],
                  minimum=1)
    if kind == "longrope" and (spec.get("short_factor") is None or spec.get("long_factor") is None):
        raise BadValue("rope_scaling 'longrope' needs short_factor and long_factor (one divisor per frequency): give "
                       "them in transformers' dict, rope_scaling={'rope_type': 'longrope', 'short_factor': [...], ...}")
    return spec


def choose(cfg: ModelConfig, given) -> RopeScaling | None:
    """The `RopeScaling` that `given` (any spelling, `rope_spec`) means for the model of `cfg` (None: plain
    RoPE), its original length the model's n_ctx unless given; refused in one line when the model has no
    rotary positions or the scaling does not fit it. Reads the config only."""
    spec = rope_spec(given)
    if cfg.positional != "rotary":
        raise BadValue(f"rope_scaling rescales rotary positions, and this model's positions are "
                       f"{cfg.positional or 'none'}: leave rope_scaling out")
    own = {"rope_theta": cfg.rotary_base, "partial_rotary_factor": cfg.rot_dim / cfg.head_dim}
    for key, value in own.items():
        if key in spec and not (isinstance(spec[key], (int, float)) and math.isclose(spec[key], value)):
            raise BadValue(f"rope_scaling's {key}={spec[key]!r} is not the model's ({value:g}): a scaling rescales the "
                           f"model's own rotary positions; leave {key} out")
    kind = spec["rope_type"]
    if kind == "default":
        return None
    if kind == "ntk":  # interp's own: no transformers type to read
        scaling = RopeScaling("ntk", float(spec["factor"]))
    else:  # transformers' rope_parameters, read as a checkpoint's are, with its defaults
        d = {"rope_parameters": {**spec, "rope_theta": cfg.rotary_base}, "max_position_embeddings": cfg.n_ctx}
        scaling = rotary_from_hf(d, cfg.head_dim, cfg.n_ctx)["rope_scaling"]
        if kind != "linear":
            scaling = dataclasses.replace(scaling, original_max_position=spec.get("original_max_position_embeddings")
                                          or cfg.n_ctx)
    try:
        cfg.replace(rope_scaling=scaling)  # the config's own checks (LongRoPE's factors: one per frequency)
    except ValueError as e:
        problem = str(e).removeprefix("invalid ModelConfig: ")
        raise BadValue(f"rope_scaling does not fit this model: {problem}") from None
    return scaling


def as_hf(scaling: RopeScaling | None) -> dict[str, Any]:
    """`scaling` in transformers' names (None: {"rope_type": "default"}), the fields its type reads; what
    settings.json records, and what `rope_spec` reads back to the same scaling."""
    if scaling is None:
        return {"rope_type": "default"}
    fields = {"factor": scaling.factor, "original_max_position_embeddings": scaling.original_max_position,
              "attention_factor": scaling.attention_factor, "beta_fast": scaling.beta_fast,
              "beta_slow": scaling.beta_slow, "truncate": scaling.truncate, "low_freq_factor": scaling.low_freq_factor,
              "high_freq_factor": scaling.high_freq_factor,
              "short_factor": None if scaling.short_factor is None else list(scaling.short_factor),
              "long_factor": None if scaling.long_factor is None else list(scaling.long_factor)}
    return {"rope_type": scaling.kind, **{k: fields[k] for k in TYPE_KEYS[scaling.kind] if fields.get(k) is not None}}


def describe(spec: Mapping | None) -> str | None:
    """The report's sentence for a scaling chosen at inference (`as_hf`'s dict; None: none chosen, no sentence)."""
    if spec is None:
        return None
    kind = spec["rope_type"]
    if kind == "default":
        return ("RoPE scaling chosen at inference: none (plain RoPE, in place of the checkpoint's own scaling); every "
                "number here is of the model run so.")
    orig = spec.get("original_max_position_embeddings")
    return (f"RoPE scaling chosen at inference: {_NAMES[kind]}, factor {spec.get('factor'):g}"
            + (f", from an original length of {orig:,} tokens" if orig else "")
            + " (not the checkpoint's own positions); every number here is of the model run so.")


__all__ = ["FACTOR_AT_LEAST_ONE", "ROPE_TYPES", "TYPE_KEYS", "as_hf", "choose", "describe", "parse_rope_scaling",
           "rope_spec"]
