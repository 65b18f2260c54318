"""TransformerLens's names for our hook points, in one place: its short forms (`act_name`) and the
second names TransformerLens 4's bridge gives them (`hook_aliases`, resolved by `canonical`).

Our hook points carry TransformerLens's classic names (`blocks.3.hook_resid_pre`,
`blocks.3.attn.hook_z`, `blocks.3.mlp.hook_pre`). TransformerLens 4's `TransformerBridge` names its
hook points after its components (`blocks.3.hook_in`, `blocks.3.attn.o.hook_in`,
`blocks.3.mlp.in.hook_out`) and keeps the classic names as aliases of the same hook points; its
`utilities.get_act_name("in", 3)` gives `blocks.3.hook_in`. So code written against the bridge
names either. The tables below give each of our hook points every other name the bridge has for
that same hook point (its `hook_aliases` in model_bridge/bridge_core.py and in
generalized_components/block.py, attention.py, mlp.py and gated_mlp.py of transformer-lens 4.3),
and every name lookup (`run_with_hooks`, `hooks()`, `add_hook`, `run_with_cache` names and
filters, `hook_dict[...]`, `ActivationCache[...]`) goes through `canonical`.

Sandwich blocks (Gemma 2 / 3: `ln1_post` and `ln2_post` normalise the attention and MLP outputs): the
bridge points `hook_attn_out` / `hook_mlp_out` at the post-norms' outputs (`ln1_post.hook_out`,
`ln2_post.hook_out`), which is where ours fire too, and its `attn.hook_out` / `mlp.hook_out` there are
the outputs *before* the post-norms: a hook point we do not have (no hook of ours fires on the
attention or MLP output before ln1_post / ln2_post), so those two names are not aliases on such blocks.
A block counts as sandwich when the names include a hook of its `ln1_post` (or `ln2_post`), as a
model's hook points always do.

Left out, on purpose: the bridge's hook points that are not aliases there but hooks of their own,
with their own effect when patched (`blocks.L.ln1.hook_in`, `blocks.L.attn.hook_in`,
`blocks.L.mlp.hook_in`, `blocks.L.ln1.hook_out`, `blocks.L.attn.o.hook_out`, `ln_final.hook_in`,
`unembed.hook_in`, `hook_unembed`, `rotary_emb.hook_cos`...), and aliases of hook points we do not
have (`hook_pos_embed` on a rotary model is the bridge's `rotary_emb.hook_out`, the cos/sin table).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

# ---- the bridge's second names ---------------------------------------------------------------------
# our name -> the bridge's other names for the same hook point (inside a block: after `blocks.L.`).
MODEL_ALIASES = {"hook_embed": ("embed.hook_out",), "hook_pos_embed": ("pos_embed.hook_out",)}
# A model with an embedding norm (Bloom's `embed_ln`): hook_embed reads its output, as the bridge's hook_embed
# (`embed_ln.hook_out`); the bridge's `embed.hook_out` is the embedding before it, a hook point we do not have.
EMBED_LN_ALIASES = {"hook_embed": ("embed_ln.hook_out",)}
BLOCK_ALIASES = {
    "hook_resid_pre": ("hook_in",),
    "hook_resid_mid": ("ln2.hook_in",),  # sequential blocks only: parallel ones have no resid_mid
    "hook_resid_post": ("hook_out",),
    "hook_attn_out": ("attn.hook_out",),
    "hook_mlp_out": ("mlp.hook_out",),
    "hook_attn_in": ("attn.hook_attn_in",),  # the optional hook points, once switched on
    "hook_q_input": ("attn.hook_q_input",),
    "hook_k_input": ("attn.hook_k_input",),
    "hook_v_input": ("attn.hook_v_input",),
    "attn.hook_q": ("attn.q.hook_out",),
    "attn.hook_k": ("attn.k.hook_out",),
    "attn.hook_v": ("attn.v.hook_out",),
    "attn.hook_z": ("attn.o.hook_in",),
    "mlp.hook_post": ("mlp.out.hook_in",),
}
# Sandwich blocks: hook_attn_out / hook_mlp_out are the post-norms' outputs, on the bridge as on ours; the
# bridge's attn.hook_out / mlp.hook_out are the outputs before them, which we have no hook point for.
SANDWICH_ATTN_ALIASES = {"hook_attn_out": ("ln1_post.hook_out",)}
SANDWICH_MLP_ALIASES = {"hook_mlp_out": ("ln2_post.hook_out",)}
# `mlp.in` is W_in: the pre-activation of a plain MLP, the linear branch of a gated one (SwiGLU),
# whose activation reads `mlp.gate` instead.
PLAIN_MLP_ALIASES = {"mlp.hook_pre": ("mlp.in.hook_out",)}
GATED_MLP_ALIASES = {"mlp.hook_pre": ("mlp.gate.hook_out",), "mlp.hook_pre_linear": ("mlp.in.hook_out",)}


def hook_aliases(names: Iterable[str]) -> dict[str, str]:
    """{alias: our name} for the hook points `names` (a model's hook points, or a cache's keys):
    only aliases of hook points that exist, so an alias never names something absent."""
    names = set(names)
    post_norms = {n.rsplit(".", 1)[0] for n in names if n.endswith((".ln1_post.hook_scale", ".ln1_post.hook_normalized",
                                                                    ".ln2_post.hook_scale", ".ln2_post.hook_normalized"))}
    out: dict[str, str] = {}
    for own in names:
        parts = own.split(".")
        if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
            prefix, rel = f"blocks.{parts[1]}.", ".".join(parts[2:])
            mlp = GATED_MLP_ALIASES if f"{prefix}mlp.hook_pre_linear" in names else PLAIN_MLP_ALIASES
            table = {**BLOCK_ALIASES, **mlp}
            if prefix + "ln1_post" in post_norms:
                table.update(SANDWICH_ATTN_ALIASES)
            if prefix + "ln2_post" in post_norms:
                table.update(SANDWICH_MLP_ALIASES)
        else:
            embed_ln = "embed_ln.hook_normalized" in names
            prefix, rel, table = "", own, {**MODEL_ALIASES, **EMBED_LN_ALIASES} if embed_ln else MODEL_ALIASES
        for alias in table.get(rel, ()):
            out[prefix + alias] = own
    return out


def canonical(name: str, aliases: Mapping[str, str]) -> str:
    """Our name for `name`: an alias's hook point (a gradient's `_grad` suffix kept), else `name`."""
    own = aliases.get(name)
    if own is not None:
        return own
    if name.endswith("_grad") and name[: -len("_grad")] in aliases:
        return aliases[name[: -len("_grad")]] + "_grad"
    return name


# ---- short forms: TransformerLens's get_act_name -------------------------------------------------
_ATTN = {"q", "k", "v", "z", "rot_q", "rot_k", "attn_scores", "pattern", "result"}
_MLP = {"pre", "post", "mid", "pre_linear"}
_NORM = {"scale", "normalized"}
_SHORT = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
          "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post", "resid": "resid_post"}
_SUBLAYERS = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}
_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")  # "k6", "pre5", "scale4ln1"


def act_name(name: str, layer: int | None = None, sub: str | None = None) -> str:
    """Full hook name from TransformerLens's short forms, as its `get_act_name`: act_name("pattern", 0),
    act_name("normalized", 3, "ln2"), act_name("k6"), act_name("scale4ln1"), act_name("in", 3)
    (`blocks.3.hook_in`, the bridge's name for resid_pre), act_name("out", 3, "mlp").

    Beyond TransformerLens: "resid" means resid_post, and a block's "scale" / "normalized" without a
    sublayer means ln1's (TransformerLens would name a `blocks.L.hook_scale` nothing has)."""
    if "." in name or name.startswith("hook_"):
        return name
    compact = _COMPACT.fullmatch(name) if layer is None and sub is None else None
    if compact is not None:
        name, layer, sub = compact[1], int(compact[2]), compact[3] or None
    name = _SHORT.get(name, name)
    sub = _SUBLAYERS.get(sub, sub) if sub else None
    if layer is None:
        if name in ("embed", "pos_embed"):
            return f"hook_{name}"
        if name in _NORM:
            return f"ln_final.hook_{name}"
        raise KeyError(f"{name!r} needs a layer index, e.g. ({name!r}, 0)")
    if name in _ATTN:
        return f"blocks.{layer}.attn.hook_{name}"
    if name in _MLP:
        return f"blocks.{layer}.mlp.hook_{name}"
    if name in _NORM:
        return f"blocks.{layer}.{sub or 'ln1'}.hook_{name}"
    return f"blocks.{layer}.{sub + '.' if sub else ''}hook_{name}"


__all__ = ["act_name", "canonical", "hook_aliases"]
