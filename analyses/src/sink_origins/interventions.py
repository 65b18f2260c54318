"""The interventions of the sinks study: which component makes the first token a sink? Each is a list of forward
hooks on the model (TransformerLens's hook names), built from what the unmodified model's pass measured
(`Reference`), and changes exactly what it names:

  massive_dims   the first token's massive dimensions set to 0 in the residual stream (`hook_resid_post`), each
                 at the layer where it appears (Sun et al. 2024's intervention): the first layer whose first-token
                 activation in that dimension meets their criterion (`measure.is_massive`); where none does, the
                 first token's largest |activation| relative to its layer's median, said so
  massive_held   the same dimensions kept at 0 from the layer where each appears through the last layer (a model
                 whose massive activation grows over several layers rebuilds what one zeroing removes)
  query_bias     the query bias b_Q subtracted from every query (`attn.hook_q`, before QK-norm and RoPE) of every
                 layer: a model without one is refused in one line (checked from its config)
  early_mlp      each early MLP in turn (--mlp-layers, default 0, 1, 2): its output at the first position
                 (`hook_mlp_out`) replaced by its mean over the other positions and sequences (mean ablation)
  key_direction  in every layer, the first token's mean key direction u (per KV head, unit, mean over sequences of
                 the key as attention scores it: `attn.hook_rot_k` with RoPE, else `attn.hook_k`) projected out of
                 the key at position 0: k_0 <- k_0 - (k_0 . u) u
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .measure import MASSIVE_MIN, MASSIVE_RATIO, key_hook_name

INTERVENTIONS = ("massive_dims", "massive_held", "query_bias", "early_mlp", "key_direction")
MLP_LAYERS = (0, 1, 2)


def check_interventions(names, cfg, mlp_layers) -> tuple[tuple[str, ...], tuple[int, ...], list[str]]:
    """The interventions to run (None: every one that applies to the model) and the early MLP layers, checked
    against the config `cfg` (no weights); -> (names, mlp layers, notes). One line for an unknown name, a query
    bias or MLP the model lacks when asked for, a layer outside the model."""
    asked = names is not None
    names = tuple(INTERVENTIONS if names is None else names)
    unknown = [n for n in names if n not in INTERVENTIONS]
    if unknown or not names:
        raise ValueError(f"--interventions: unknown {', '.join(map(repr, unknown)) or '(none given)'}; the valid ones "
                         f"are {', '.join(INTERVENTIONS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--interventions lists {', '.join(repeated)} twice")
    notes, keep = [], []
    for n in names:
        missing = {"query_bias": None if cfg.qkv_bias else "has no query bias (its q/k/v projections have none)",
                   "early_mlp": "has no MLPs (attention-only)" if cfg.d_mlp is None else None}.get(n)
        if missing is None:
            keep.append(n)
        elif asked:
            raise ValueError(f"--interventions {n}: this model {missing}; leave {n} out")
        else:
            notes.append(f"note: no {n} intervention: this model {missing}")
    layers = tuple(MLP_LAYERS if mlp_layers is None else mlp_layers)
    bad = [l for l in layers if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < cfg.n_layers]
    if "early_mlp" in keep and (bad or not layers):
        raise ValueError(f"--mlp-layers {','.join(map(str, layers))}: give layers in 0..{cfg.n_layers - 1}")
    if "early_mlp" in keep and layers != tuple(dict.fromkeys(layers)):
        raise ValueError("--mlp-layers repeats a layer: give each once")
    layers = tuple(l for l in layers if l < cfg.n_layers) if "early_mlp" in keep else ()
    return tuple(keep), layers, notes


def expand(names, mlp_layers) -> list[tuple[str, int | None]]:
    """(name, layer) per run: one per early MLP layer, one for each other intervention."""
    out = []
    for n in names:
        out += [(n, l) for l in mlp_layers] if n == "early_mlp" else [(n, None)]
    return out


def label(name: str, layer: int | None) -> str:
    return name if layer is None else f"{name}:{layer}"


@dataclass
class Reference:
    """What the interventions are built from (the unmodified model's pass): the first token's massive dimensions by
    the layer where each appears ({layer: [dims]}; `found`: whether they meet Sun et al.'s criterion), the MLP
    outputs' means {layer: [d_model]} and the first token's unit mean keys {layer: [kv, d_head]}."""

    massive: dict[int, list[int]]
    found: bool
    mlp_means: dict[int, Tensor] = field(default_factory=dict)
    key_dirs: dict[int, Tensor] = field(default_factory=dict)


def choose_massive(first_magnitude: Tensor, medians, minimum: float = MASSIVE_MIN,
                   at_least: float = MASSIVE_RATIO) -> tuple[dict[int, list[int]], bool]:
    """The first token's massive dimensions by the layer where each appears: from its |activation| [layer,
    d_model], each dimension that meets the criterion in some layer, at the first such layer; where none does, the
    (layer, dimension) of the largest ratio to its layer's median (found False)."""
    med = torch.tensor(medians, dtype=torch.float32, device=first_magnitude.device)[:, None]
    ratio = first_magnitude / med.clamp(min=torch.finfo(torch.float32).tiny)
    massive = (first_magnitude > minimum) & (ratio >= at_least)  # [layer, d_model]
    dims = massive.any(0).nonzero()[:, 0].tolist()
    if dims:
        first = massive.float().argmax(0).tolist()  # the first layer where each dimension is massive
        out: dict[int, list[int]] = {}
        for d in dims:
            out.setdefault(int(first[d]), []).append(int(d))
        return dict(sorted(out.items())), True
    layer, dim = divmod(int(ratio.argmax()), ratio.shape[1])
    return {layer: [dim]}, False


def _zero_first(dims: list[int]):
    index = torch.tensor(dims, dtype=torch.long)

    def zero(x, hook):  # x [batch, pos, d_model]
        x = x.clone()
        x[:, 0, index.to(x.device)] = 0
        return x
    return zero


def held(massive: dict[int, list[int]], n_layers: int) -> dict[int, list[int]]:
    """{layer: every dimension that appeared at or before it}, from the first layer on."""
    out, now = {}, []
    for l in range(min(massive), n_layers):
        now = sorted(set(now) | set(massive.get(l, [])))
        out[l] = now
    return out


def hooks_for(model, name: str, layer: int | None, ref: Reference) -> list[tuple[str, object]]:
    """The forward hooks of intervention `name` (`layer`: early_mlp's), built from `ref`."""
    if name in ("massive_dims", "massive_held"):
        where = ref.massive if name == "massive_dims" else held(ref.massive, model.cfg.n_layers)
        return [(f"blocks.{l}.hook_resid_post", _zero_first(dims)) for l, dims in where.items()]
    if name == "query_bias":
        def unbias(bias):
            return lambda x, hook: x - bias.to(x.device, x.dtype)  # [batch, pos, head, d_head] - [head, d_head]
        return [(f"blocks.{l}.attn.hook_q", unbias(model.blocks[l].attn.b_Q.detach()))
                for l in range(model.cfg.n_layers)]
    if name == "early_mlp":
        mean = ref.mlp_means[layer]

        def ablate(x, hook):
            x = x.clone()
            x[:, 0] = mean.to(x.device, x.dtype)
            return x
        return [(f"blocks.{layer}.hook_mlp_out", ablate)]
    if name == "key_direction":
        def project(u):
            def hook(x, hook):  # x [batch, pos, kv, d_head]; u [kv, d_head]
                u_ = u.to(x.device, torch.float32)
                k0 = x[:, 0].float()
                x = x.clone()
                x[:, 0] = (k0 - (k0 * u_).sum(-1, keepdim=True) * u_).to(x.dtype)
                return x
            return hook
        return [(key_hook_name(model, l), project(ref.key_dirs[l])) for l in range(model.cfg.n_layers)]
    raise ValueError(f"unknown intervention {name!r}; the valid ones are {', '.join(INTERVENTIONS)}")


def describe(name: str, layer: int | None, ref: Reference) -> str:
    """One line: what the intervention changed."""
    if name in ("massive_dims", "massive_held"):
        why = "massive" if ref.found else "the largest relative to the median: none meets Sun et al.'s criterion"
        where = "; ".join(f"{', '.join(map(str, dims))} after layer {l}" for l, dims in ref.massive.items())
        return (f"the first token's dimensions ({why}) set to 0 where each appears: {where}"
                + ("" if name == "massive_dims" else "; and after every later layer"))
    if name == "query_bias":
        return "the query bias removed in every layer"
    if name == "early_mlp":
        return f"MLP {layer}'s output at the first position set to its mean over the other positions"
    return "the first token's mean key direction projected out of its key, per KV head, in every layer"
