"""SAE features as nodes of the circuit graph (Marks et al. 2024, "Sparse Feature Circuits", arXiv 2403.19647).

An SAE on a component's output rewrites that output exactly, with SAELens's `use_error_term` meaning:

    output = sum_f acts_f W_dec[f] + b_dec + error          (error: the output less its reconstruction)

so the component's senders can be replaced by the SAE's. Each feature f kept as a node is a sender whose value
is its activation times its decoder row carried to the residual stream, the error is a sender, and b_dec
(carried the same way) is a bias beside the output biases. The stream is still exactly the sum of its senders'
values plus the biases, so every receiver's input is, and patching an edge f -> r gives r the input
`input_r - value_f + value_f(corrupted)`: the graph's one intervention, now on features. EAP, EAP-IG and exact
patching score feature edges as they score any edge; the receivers do not change.

Sites (`SITES`), by the SAE's hook name:

- `blocks.l.attn.hook_z` (the heads flattened, head-major, as SAELens trains it): layer l's heads `L{l}H{h}`
  are replaced by `L{l}F{i}` and `L{l}.sae_error`; a feature's value is acts_f (W_dec[f] @ W_O) (W_O: the
  heads' output projection, [n_heads * d_head, d_model]). Under sandwich norms (Gemma) its value is its share
  of the normalised output, as a head's is, and b_dec's share joins b_O's (no sender: the graph's convention).
- `blocks.l.hook_attn_out`: the same senders; a feature's value acts_f W_dec[f] (what enters the stream, after
  a sandwich norm). b_O is inside what the SAE reads: its bias is b_dec.
- `blocks.l.hook_mlp_out`: `MLP{l}` is replaced by `MLP{l}F{i}` and `MLP{l}.sae_error`.

A top-k SAE that rescales by the decoder norm decodes with the rows divided by their norms: those rows are the
ones used (`decoder_rows`). Features that fire on none of the task's prompts (clean or corrupted) may be left
out as nodes (`Runner(saes=..., all_features=False)`, the default; `fired` finds them): the error node is the
output less the kept features' values and b_dec, so what a left-out feature writes joins it and the sum stays
exact whichever are kept (on the task's own prompts they write nothing; only a patched run can make one fire).

- `blocks.l.hook_resid_pre` / `hook_resid_mid` / `hook_resid_post`: a cut of the residual stream (Marks et al.'s
  other case; `cut` has its conventions). The SAE rewrites the stream there as sum_f acts_f W_dec[f] + b_dec +
  error; its kept features and its error are receivers of every earlier sender (each reads the stream at the cut)
  and the only senders the later receivers read of what came before (b_dec a bias). Named for the stream: `R{l}F{i}`
  and `R{l}.sae_error` at the stream block l reads (hook_resid_pre of block l, or hook_resid_post of block l - 1;
  `R{n_layers}` is the stream the unembedding reads), `R{l}midF{i}` at hook_resid_mid of block l.

Not taken (one line each, `check_saes`): an SAE at any other hook point, two SAEs at one hook point, two replacing
one layer's heads (hook_z and hook_attn_out), two on the residual stream (one cut), hook_resid_mid where the block
has none (no MLP, or attention and MLP in parallel), a width that is not the activation's, and an SAE that
normalises its input (constant_norm_rescale, layer_norm: the reconstruction is then no sum of fixed rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from interp.models.saes.splice import activation_width

# the SAE's hook name after `blocks.l.` -> (the component whose senders it replaces, the site)
SITES = {"attn.hook_z": ("attn", "z"), "hook_attn_out": ("attn", "attn_out"), "hook_mlp_out": ("mlp", "mlp_out")}
RESIDUAL = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "resid_post"}
# SAELens's normalisations that are the identity at inference (`interp.models.saes.sae.NORMALIZATIONS`)
LINEAR_NORMS = ("none", "expected_average_only_in", "covariance_whitening")
TAKEN = ("the circuit graph takes SAEs on attn.hook_z, hook_attn_out or hook_mlp_out of a block, or on its residual "
         "stream (hook_resid_pre, hook_resid_mid, hook_resid_post)")


def site_of(hook_name: str | None, cfg) -> tuple[int, str]:
    """(layer, site) of an SAE's hook name: "z", "attn_out", "mlp_out", "resid_pre", "resid_mid" or "resid_post";
    one line (ValueError) for a hook point the graph has no place for."""
    parts = (hook_name or "").split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"an SAE at {hook_name!r}: {TAKEN} (blocks.L.attn.hook_z, ...)")
    layer, rest = int(parts[1]), ".".join(parts[2:])
    if layer >= cfg.n_layers:
        raise ValueError(f"an SAE at {hook_name}: this model has {cfg.n_layers} layers (0 .. {cfg.n_layers - 1})")
    if rest == "hook_resid_mid" and (cfg.d_mlp is None or cfg.parallel_attn_mlp):
        why = "have no MLP" if cfg.d_mlp is None else "run attention and the MLP in parallel"
        raise ValueError(f"an SAE at {hook_name}: this model's blocks {why}, so they have no hook_resid_mid; put it "
                         f"at blocks.{layer}.hook_resid_pre or hook_resid_post")
    if rest in RESIDUAL:
        return layer, RESIDUAL[rest]
    if rest not in SITES:
        raise ValueError(f"an SAE at {hook_name}: {TAKEN}, whose outputs are the graph's senders")
    if rest == "hook_mlp_out" and cfg.d_mlp is None:
        raise ValueError(f"an SAE at {hook_name}: this model's blocks have no MLP")
    return layer, SITES[rest][1]


def check_saes(cfg, configs: Sequence) -> None:
    """One line (ValueError) for SAEs the graph cannot take together (see the module); `configs`: each SAE's
    config (`SAE.cfg`: hook_name, d_in, normalize_activations), read before any weight."""
    hooks: set[str] = set()
    components: dict = {}  # (layer, "attn" / "mlp") or "resid" -> the hook name of the SAE there
    for c in configs:
        layer, site = site_of(c.hook_name, cfg)
        width = activation_width(cfg, c.hook_name)
        if width is not None and width != c.d_in:
            flat = " (the heads flattened)" if site == "z" else ""
            raise ValueError(f"the SAE at {c.hook_name} reads d_in={c.d_in}, but that activation has width {width}"
                             f"{flat} in this model: it was trained on another model or hook point")
        if c.normalize_activations not in LINEAR_NORMS:
            raise ValueError(f"the SAE at {c.hook_name} normalises its input ({c.normalize_activations}): its "
                             "reconstruction is not a sum of fixed decoder rows, so its features are no senders")
        if c.hook_name in hooks:
            raise ValueError(f"two SAEs at {c.hook_name}: give one SAE per hook point")
        if site.startswith("resid"):
            if "resid" in components:
                raise ValueError(f"SAEs at {components['resid']} and {c.hook_name} would both cut the residual stream: "
                                 "the graph takes one residual-stream SAE (one cut); give one of them")
            hooks.add(c.hook_name)
            components["resid"] = c.hook_name
            continue
        key = (layer, SITES[c.hook_name.split(".", 2)[2]][0])
        if key in components:
            raise ValueError(f"SAEs at {components[key]} and {c.hook_name} would both replace layer {layer}'s "
                             f"{'heads' if key[1] == 'attn' else 'MLP'}: give one of them")
        hooks.add(c.hook_name)
        components[key] = c.hook_name


def sae_config(name):
    """The config of the SAE a path or name gives (`interp.load_sae`'s: a folder, a zoo SAE, a Hub folder), reading
    no weight: what `check_saes` reads before a model loads."""
    from interp.models.saes.files import read
    from interp.models.saes.formats import resolve_sae
    from interp.models.saes.sae import SAEConfig

    folder, where = resolve_sae(name)
    files = read(folder, where=where)
    return SAEConfig(**files.fields, source=files.source)


def decoder_rows(sae) -> Tensor:
    """[d_sae, d_in]: what one unit of each feature's activation adds to the reconstruction (W_dec; a top-k SAE
    that rescales by the decoder norm divides each row by its norm before decoding)."""
    rows = sae.W_dec
    if sae.cfg.architecture == "topk" and sae.cfg.rescale_acts_by_decoder_norm:
        rows = rows * (1 / rows.norm(dim=-1))[:, None]
    return rows


@dataclass(frozen=True, eq=False)
class FeatureNodes:
    """One SAE's nodes in the graph: the features kept as senders (ascending indices into its d_sae) and its
    error, replacing the senders of `component` ("attn": layer `layer`'s heads; "mlp": its MLP)."""

    sae: object  # interp's SAE
    layer: int
    site: str  # "z", "attn_out", "mlp_out"
    features: tuple[int, ...]
    _writers: dict = field(default_factory=dict, repr=False)  # model -> its FeatureWriter (`writer`)

    @property
    def component(self) -> str:
        """"attn" (its heads replaced), "mlp" (its MLP replaced) or "resid" (the stream cut: `cut`)."""
        return "resid" if self.site.startswith("resid") else "mlp" if self.site == "mlp_out" else "attn"

    @property
    def hook_name(self) -> str:
        return self.sae.cfg.hook_name

    @property
    def d_sae(self) -> int:
        return self.sae.cfg.d_sae

    @property
    def prefix(self) -> str:
        if self.component == "resid":  # named for the stream: R{l} is what block l reads
            return f"R{self.layer}mid" if self.site == "resid_mid" else f"R{self.layer + (self.site == 'resid_post')}"
        return f"MLP{self.layer}" if self.component == "mlp" else f"L{self.layer}"

    @property
    def stage(self) -> float:
        """Where a cut sits in the graph's order of computation (`graph.Graph`: layer l's attention at 2l + 1, its
        MLP at 2l + 2): its receivers read and its senders write there, between the two stages around it."""
        return 2 * self.layer + {"resid_pre": 0.5, "resid_mid": 1.5, "resid_post": 2.5}[self.site]

    def names(self) -> list[str]:
        """The senders, in the graph's order: each kept feature, then the error."""
        return [f"{self.prefix}F{i}" for i in self.features] + [f"{self.prefix}.sae_error"]

    @property
    def writes_at(self) -> str:
        """The hook point where its senders' values join the stream (node patching adds a change there)."""
        if self.component == "resid":
            return self.hook_name
        return f"blocks.{self.layer}.hook_{'mlp' if self.component == 'mlp' else 'attn'}_out"

    def writer(self, model) -> "FeatureWriter":
        """What these nodes write, for `model` (made once, again if the weights it read were changed)."""
        key = id(model)
        found = self._writers.get(key)
        if found is None or not found.current(model):
            found = self._writers[key] = FeatureWriter(self, model)
        return found


def feature_nodes(cfg, sae, features: Sequence[int] | None = None) -> FeatureNodes:
    """`sae`'s nodes in the graph of a model of config `cfg`: `features` (None: every one) and its error. `sae`:
    interp's SAE, SAELens's, or `FeatureNodes` (as it is)."""
    if isinstance(sae, FeatureNodes):
        return sae
    from interp.models.saes.formats import as_sae  # reads SAELens's objects; an interp SAE as it is

    sae = as_sae(sae)
    check_saes(cfg, [sae.cfg])
    layer, site = site_of(sae.cfg.hook_name, cfg)
    d_sae = sae.cfg.d_sae
    keep = range(d_sae) if features is None else sorted({int(f) for f in features})
    if keep and not 0 <= keep[0] <= keep[-1] < d_sae:
        raise ValueError(f"features of the SAE at {sae.cfg.hook_name} are 0 .. {d_sae - 1}; got {keep[0]} .. "
                         f"{keep[-1]}")
    return FeatureNodes(sae, layer, site, tuple(keep))


class FeatureWriter:
    """The values one SAE's nodes write into the stream, from the activation at its hook point: each kept
    feature's activation times its row carried to the stream (`rows`, [F, d_model]), and the error, the output
    less those and the bias (`bias`: b_dec carried to the stream)."""

    def __init__(self, nodes: FeatureNodes, model) -> None:
        sae = nodes.sae
        self.nodes, self.sae = nodes, sae
        self.index = torch.tensor(nodes.features, dtype=torch.long, device=sae.device)
        self._read = self._versions(model)
        with torch.no_grad():
            rows, bias = decoder_rows(sae)[self.index], sae.b_dec
            self.W_O = None
            if nodes.site == "z":  # z [.., heads * d_head] -> the stream through the heads' output projection
                self.W_O = model.blocks[nodes.layer].attn.W_O_flat.detach().to(sae.dtype)
                rows, bias = rows @ self.W_O, bias @ self.W_O
            self.rows, self.bias = rows.detach(), bias.detach()

    def _versions(self, model) -> tuple:
        ws = [self.sae.W_dec, self.sae.b_dec]
        if self.nodes.site == "z":
            ws.append(model.blocks[self.nodes.layer].attn.W_O_flat)
        return tuple((w.data_ptr(), w._version) for w in ws)

    def current(self, model) -> bool:
        return self._versions(model) == self._read

    def __call__(self, x: Tensor) -> Tensor:
        """[F + 1, *x's leading dims, d_model]: each kept feature's value, then the error's, in x's dtype (the SAE's
        arithmetic in its own dtype). x: the activation at the hook point ([b, p, heads, d_head] for z)."""
        with torch.no_grad():
            flat = x.flatten(-2) if self.nodes.site == "z" else x
            flat = flat.detach().to(self.sae.dtype)
            acts = self.sae.encode(flat).index_select(-1, self.index)  # [..., F]
            F, lead = acts.shape[-1], acts.shape[:-1]
            values = acts.new_empty((F + 1, *lead, self.rows.shape[-1]))
            torch.mul(acts.movedim(-1, 0)[..., None], self.rows.view(F, *[1] * len(lead), -1), out=values[:F])
            out = flat if self.W_O is None else flat @ self.W_O  # the output without b_O
            torch.sub(out - self.bias, acts @ self.rows, out=values[F])  # the error
            return values.to(x.dtype)


def fired(model, task, saes: Sequence, batch_size: int = 16) -> list[Tensor]:
    """For each SAE, bool [d_sae]: the features whose activation is not 0 somewhere in the task's clean or
    corrupted prompts (every position, padding too), from forwards up to the last SAE's layer."""
    seen = [torch.zeros(s.cfg.d_sae, dtype=torch.bool, device=s.device) for s in saes]

    def hook(i: int):
        def fn(x, hook):
            acts = saes[i].encode(x.detach().to(saes[i].dtype))
            seen[i] |= (acts != 0).reshape(-1, acts.shape[-1]).any(0)
            return x
        return fn

    last = max(site_of(s.cfg.hook_name, model.cfg)[0] for s in saes) + 1
    hooks = [(s.cfg.hook_name, hook(i)) for i, s in enumerate(saes)]
    with torch.no_grad(), model.hooks(hooks):
        for tokens in (task.clean, task.corrupted):
            for start in range(0, tokens.shape[0], batch_size):
                model(tokens[start:start + batch_size].to(model.device), stop_at_layer=last)
    return [s.cpu() for s in seen]
