"""A sparse autoencoder (SAE) at one hook point, with SAELens 6's meaning (`sae_lens/saes/*_sae.py`).

An SAE rewrites an activation `x [..., d_in]` as a sparse code `acts [..., d_sae]` and a reconstruction:

    sae_in = norm_in(x) - b_dec * apply_b_dec_to_input
    acts   = activation(sae_in @ W_enc + b_enc)                       # [..., d_sae]
    recons = norm_out(acts @ W_dec + b_dec)                           # [..., d_in]

the activation by architecture (SAELens's names, which its state dicts use):

    standard  relu(pre)
    topk      the k largest of pre, relu'd, the rest 0 (`rescale_acts_by_decoder_norm`: pre * |W_dec row|
              before choosing, acts / |W_dec row| before decoding); sparsify's "groupmax" variant: the
              largest relu(pre) of each of k consecutive groups
    jumprelu  relu(pre) where pre > threshold, else 0
    gated     (sae_in @ W_enc + b_gate > 0) * relu(sae_in @ (W_enc * exp(r_mag)) + b_mag); no b_enc

Hook points (interp's `HookPoint`), fired where SAELens fires them, once each per forward:
`hook_sae_input` (x flattened, before normalisation), `hook_sae_acts_pre`, `hook_sae_acts_post`,
`hook_sae_recons` (before norm_out), `hook_sae_error` (only with `use_error_term`), `hook_sae_output`.

`forward(x)` is the reconstruction; with `use_error_term` it adds the error `x - recons(x)`, computed again
with every hook off (SAELens's "clean" pass) and carrying no gradient: with no hooks the output is x to
float round-off, and an edit of `hook_sae_acts_post` changes the output by exactly the decoder's image of
the edit. (The error is made under no_grad as SAELens makes it; its hook point then fires with grad mode
on, so a backward hook there receives d(output)/d(error), which SAELens's no_grad hook cannot.)

A hook_z SAE (`reshape_activations == "hook_z"`, or a hook name ending in hook_z) reads attention's z
`[..., n_heads, d_head]` with the heads flattened (head-major, as SAELens trains it: d_in = n_heads *
d_head) and `forward` gives back the shape it was given; a flat `[..., d_in]` input is read as it is.

Axis names: d_in (the hook point's width; n_heads * d_head for hook_z), d_sae (the features).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Iterator, Literal

import torch
from torch import Tensor, nn

from interp.errors import BadValue, CheckpointError
from ..hooks import HookedRootModule, HookPoint, NamesFilter, caching_hook
from .files import SAEFiles, read

Architecture = Literal["standard", "topk", "jumprelu", "gated"]
ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")
# SAELens's values. At inference only constant_norm_rescale and layer_norm act; expected_average_only_in is
# a scale SAELens folds into the weights (or its training loop applies), and covariance_whitening (SAELens
# 6.5x) is folded into the weights before saving: both are the identity here, as in SAELens's SAE.
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm", "covariance_whitening")
RESHAPES = ("none", "hook_z")
TOPK_ACTIVATIONS = ("topk", "groupmax")
HOOK_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_output",
               "hook_sae_recons", "hook_sae_error")

DTYPES = {"float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
          "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from SAELens's spellings ("float32", "torch.bfloat16", ...) or a dtype."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise BadValue(f"an SAE's dtype must be one of {', '.join(sorted(DTYPES))}, got {name}")
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise BadValue(f"an SAE's dtype must be one of {', '.join(sorted(DTYPES))}, got {name!r}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SAEMetadata(dict):
    """SAELens 6's `cfg.metadata`: what the file said beyond the SAE itself, read as a dict or as attributes
    (`cfg.metadata.hook_name`; a name it does not hold reads None, as SAELens's). It holds the config's
    hook_name and model_name too, kept equal to them when they are set on the config."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value) -> None:
        self[name] = value

    def to_dict(self) -> dict:
        return dict(self)


@dataclass
class SAEConfig:
    """What an SAE is: its architecture and sizes, how it reads its input, where it splices in.

    `hook_name` is interp's (TransformerLens's) hook name: `blocks.L.hook_resid_post`, `blocks.L.attn.hook_z`.
    `source` says where it was read from (a folder, a Hub name; "" when built in memory). `metadata` keeps
    whatever else the file said (SAELens's hook_head_index, prepend_bos, context_size, neuronpedia_id, ...) and,
    as SAELens 6's does, the hook and model names (`cfg.metadata.hook_name`); set those on the config."""

    architecture: Architecture
    d_in: int
    d_sae: int
    hook_name: str | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    reshape_activations: Literal["none", "hook_z"] = "none"
    k: int | None = None  # top-k only: the features kept per input
    dtype: str = "float32"
    model_name: str | None = None
    source: str = ""
    rescale_acts_by_decoder_norm: bool = False  # top-k only (SAELens's TopKSAEConfig)
    topk_activation: Literal["topk", "groupmax"] = "topk"  # top-k only: "groupmax" is sparsify's variant
    d_head: int | None = None  # hook_z only: known from the file, or learnt from the first input
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()
        self.metadata = SAEMetadata(self.metadata)
        self.metadata.update(hook_name=self.hook_name, model_name=self.model_name)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("hook_name", "model_name") and isinstance(self.__dict__.get("metadata"), SAEMetadata):
            self.metadata[name] = value

    def check(self) -> None:
        """BadValue, one line, for a config no SAE can have."""
        if self.architecture not in ARCHITECTURES:
            raise BadValue(f"unknown SAE architecture {self.architecture!r}: interp reads {', '.join(ARCHITECTURES)}")
        for name in ("d_in", "d_sae"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadValue(f"an SAE's {name} must be a positive integer, got {value!r}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise BadValue(f"normalize_activations must be one of {', '.join(NORMALIZATIONS)}, got {self.normalize_activations!r}")
        if self.reshape_activations not in RESHAPES:
            raise BadValue(f"reshape_activations must be 'none' or 'hook_z', got {self.reshape_activations!r}")
        if self.architecture == "topk":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise BadValue(f"a top-k SAE needs k between 1 and d_sae={self.d_sae}, got {self.k!r}")
            if self.topk_activation not in TOPK_ACTIVATIONS:
                raise BadValue(f"topk_activation must be 'topk' or 'groupmax', got {self.topk_activation!r}")
            if self.topk_activation == "groupmax" and self.d_sae % self.k:
                raise BadValue(f"a groupmax SAE splits its d_sae={self.d_sae} features into k={self.k} equal groups; "
                               "k must divide d_sae")
        elif self.k is not None:
            raise BadValue(f"k={self.k} is for top-k SAEs; this one is {self.architecture}")
        if self.d_head is not None and (not isinstance(self.d_head, int) or self.d_head < 1 or self.d_in % self.d_head):
            raise BadValue(f"d_head={self.d_head!r} must be a positive divisor of d_in={self.d_in}")
        if not isinstance(self.apply_b_dec_to_input, bool):
            raise BadValue(f"apply_b_dec_to_input must be true or false, got {self.apply_b_dec_to_input!r}")
        dtype_of(self.dtype)

    @property
    def hook_z(self) -> bool:
        """Reads attention's z with the heads flattened."""
        return self.reshape_activations == "hook_z" or (self.hook_name or "").endswith("hook_z")

    @property
    def hook_layer(self) -> int | None:
        parts = (self.hook_name or "").split(".")
        return int(parts[1]) if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit() else None

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["metadata"] = dict(self.metadata)
        return out

    def sae_lens_dict(self) -> dict:
        """This config as SAELens 6 writes cfg.json (`SAE.save_model`)."""
        out = {"architecture": self.architecture, "d_in": self.d_in, "d_sae": self.d_sae, "dtype": self.dtype,
               "device": "cpu", "apply_b_dec_to_input": self.apply_b_dec_to_input,
               "normalize_activations": self.normalize_activations, "reshape_activations": self.reshape_activations}
        if self.architecture == "topk":
            out.update(k=self.k, rescale_acts_by_decoder_norm=self.rescale_acts_by_decoder_norm)
        out["metadata"] = {"sae_lens_version": "6.0.0", **self.metadata, "hook_name": self.hook_name,
                           "model_name": self.model_name}
        return out


class SAE(HookedRootModule):
    """A sparse autoencoder with SAELens's parameters, hook points and forward (see the module's docstring).

    `SAE(cfg)` holds zeros; `interp.load_sae` fills one from a file, `as_sae` from a SAELens object. It is a
    small hooked root: `sae.run_with_hooks(x, fwd_hooks=[("hook_sae_acts_post", fn)])`,
    `sae.run_with_cache(x)`, `sae.hooks(...)`."""

    W_enc: nn.Parameter  # [d_in, d_sae]
    b_enc: nn.Parameter | None  # [d_sae]; None for gated (SAELens's GatedSAE has b_gate and b_mag instead)
    W_dec: nn.Parameter  # [d_sae, d_in]
    b_dec: nn.Parameter  # [d_in]

    def __init__(self, cfg: SAEConfig, use_error_term: bool = False, device: str | torch.device = "cpu") -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.use_error_term = bool(use_error_term)
        dtype = dtype_of(cfg.dtype)

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device))

        self.W_enc = zeros(cfg.d_in, cfg.d_sae)
        if cfg.architecture == "gated":
            self.b_gate = zeros(cfg.d_sae)
            self.r_mag = zeros(cfg.d_sae)
            self.b_mag = zeros(cfg.d_sae)
            self.b_enc = None
        else:
            self.b_enc = zeros(cfg.d_sae)
        if cfg.architecture == "jumprelu":
            self.threshold = zeros(cfg.d_sae)
        self.W_dec = zeros(cfg.d_sae, cfg.d_in)
        self.b_dec = zeros(cfg.d_in)

        self.hook_sae_input = HookPoint()
        self.hook_sae_acts_pre = HookPoint()
        self.hook_sae_acts_post = HookPoint()
        self.hook_sae_output = HookPoint()
        self.hook_sae_recons = HookPoint()
        self.hook_sae_error = HookPoint()
        self.d_head: int | None = cfg.d_head
        self._quiet = False  # the error term's clean pass: every hook point skipped
        self._norm: tuple[Tensor, ...] | None = None  # what encode's normalisation left for decode (SAELens's way)
        self.setup_hooks()

    @classmethod
    def load_from_disk(cls, path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> "SAE":
        """SAELens's name: the SAE in a local folder (SAELens's, Gemma Scope's or sparsify's format)."""
        return load_from_disk(path, device=device, dtype=dtype)

    def save_model(self, path) -> tuple:
        """SAELens's files in the folder `path` (made if need be): cfg.json and sae_weights.safetensors, which
        SAELens's `SAE.load_from_disk` and `load_sae` read back. Returns (weights file, cfg file), as SAELens's."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        if self.cfg.architecture == "topk" and self.cfg.topk_activation != "topk":
            raise BadValue("SAELens has no groupmax SAE: this one (sparsify's) cannot be saved in SAELens's format")
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        weights, cfg = folder / "sae_weights.safetensors", folder / "cfg.json"
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, weights)
        cfg.write_text(json.dumps(self.cfg.sae_lens_dict()))
        return weights, cfg

    def _apply(self, fn, recurse: bool = True):
        """`.to(dtype)`, `.double()`, ...: the config's dtype follows the weights', as SAELens's `to` keeps it."""
        out = super()._apply(fn, recurse)
        self.cfg.dtype = dtype_name(self.W_dec.dtype)
        return out

    # ---- the parts ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.W_dec.dtype

    @property
    def device(self) -> torch.device:
        return self.W_dec.device

    def _at(self, hook: HookPoint, x: Tensor) -> Tensor:
        return x if self._quiet else hook(x)

    @contextlib.contextmanager
    def _hooks_off(self) -> Iterator[None]:
        saved, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = saved

    def _flatten(self, x: Tensor) -> tuple[Tensor, torch.Size | None]:
        """x as [..., d_in], and the [n_heads, d_head] it had (None when it came flat)."""
        d_in = self.cfg.d_in
        if self.cfg.hook_z and x.dim() >= 2 and x.shape[-1] != d_in and x.shape[-2] * x.shape[-1] == d_in:
            return x.flatten(-2), x.shape[-2:]
        if x.dim() == 0 or x.shape[-1] != d_in:
            want = "[..., n_heads, d_head] with n_heads * d_head = " if self.cfg.hook_z else "[..., "
            raise BadValue(f"this SAE reads {want}{d_in}{']' if not self.cfg.hook_z else ''} "
                           f"(hook {self.cfg.hook_name}); got shape {tuple(x.shape)}")
        return x, None

    def _norm_in(self, x: Tensor) -> Tensor:
        how = self.cfg.normalize_activations
        if how == "constant_norm_rescale":
            coeff = (self.cfg.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)
            self._norm = (coeff,)
            return x * coeff
        if how == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            self._norm = (mu, std)
            return x / (std + 1e-5)
        return x

    def _norm_out(self, x: Tensor) -> Tensor:
        how = self.cfg.normalize_activations
        if how not in ("constant_norm_rescale", "layer_norm"):
            return x
        if self._norm is None:
            raise BadValue(f"this SAE normalises its input ({how}) and decodes with the input's statistics: "
                           "call encode(x) before decode, or forward(x)")
        saved, self._norm = self._norm, None
        if how == "constant_norm_rescale":
            return x / saved[0]
        mu, std = saved
        return x * std + mu

    def _encode(self, x: Tensor) -> tuple[Tensor, torch.Size | None]:
        flat, heads = self._flatten(x)
        sae_in = self._at(self.hook_sae_input, flat.to(self.dtype))
        sae_in = self._norm_in(sae_in)
        sae_in = sae_in - self.b_dec * self.cfg.apply_b_dec_to_input
        arch = self.cfg.architecture
        if arch == "gated":
            active = (sae_in @ self.W_enc + self.b_gate > 0).to(self.dtype)
            pre = self._at(self.hook_sae_acts_pre, sae_in @ (self.W_enc * self.r_mag.exp()) + self.b_mag)
            return self._at(self.hook_sae_acts_post, active * torch.relu(pre)), heads
        pre = self._at(self.hook_sae_acts_pre, sae_in @ self.W_enc + self.b_enc)
        if arch == "standard":
            acts = torch.relu(pre)
        elif arch == "jumprelu":
            acts = torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        else:
            acts = self._topk(pre)
        return self._at(self.hook_sae_acts_post, acts), heads

    def _topk(self, pre: Tensor) -> Tensor:
        k = self.cfg.k
        if self.cfg.topk_activation == "groupmax":  # sparsify: the largest relu'd value of each of k groups
            values, where = torch.relu(pre).unflatten(-1, (k, -1)).max(dim=-1)
            where = where + torch.arange(0, self.cfg.d_sae, self.cfg.d_sae // k, device=pre.device)
        else:
            if self.cfg.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            values, where = torch.topk(pre, k=k, dim=-1, sorted=False)
            values = values.relu()
        return torch.zeros_like(pre).scatter_(-1, where, values)

    def _decode(self, acts: Tensor) -> Tensor:
        if acts.dim() == 0 or acts.shape[-1] != self.cfg.d_sae:
            raise BadValue(f"this SAE decodes [..., d_sae={self.cfg.d_sae}] feature activations; got shape {tuple(acts.shape)}")
        if self.cfg.architecture == "topk" and self.cfg.rescale_acts_by_decoder_norm:
            acts = acts * (1 / self.W_dec.norm(dim=-1))
        out = self._at(self.hook_sae_recons, acts @ self.W_dec + self.b_dec)
        return self._norm_out(out)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.cfg.d_in // self.d_head, self.d_head))

    # ---- SAELens's surface -------------------------------------------------------------------------
    def encode(self, x: Tensor) -> Tensor:
        """Feature activations [..., d_sae] of x [..., d_in] (a hook_z SAE: also [..., n_heads, d_head])."""
        acts, heads = self._encode(x)
        if heads is not None:
            self.d_head = int(heads[-1])
        return acts

    def decode(self, acts: Tensor) -> Tensor:
        """The reconstruction of feature activations: [..., d_in], or for a hook_z SAE whose d_head is
        known (from its file or an encode) [..., n_heads, d_head] as SAELens's decode gives it."""
        out = self._decode(acts)
        return self._heads(out) if self.cfg.hook_z and self.d_head is not None else out

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction of x, in x's shape; with `use_error_term`, plus the error (see the module)."""
        acts, heads = self._encode(x)
        out = self._decode(acts)
        if heads is not None:
            self.d_head = int(heads[-1])
            out = out.unflatten(-1, tuple(heads))
        if self.use_error_term:
            with torch.no_grad(), self._hooks_off():
                clean_acts, _ = self._encode(x)
                clean = self._decode(clean_acts)
                error = (x - (clean if heads is None else clean.unflatten(-1, tuple(heads)))).detach()
            out = out + self.hook_sae_error(error)
        return self.hook_sae_output(out)

    def run_with_cache(self, *args, names_filter: NamesFilter = None, device=None, **kwargs):
        """(output, ActivationCache of the SAE's hook points), as SAELens's SAE gives through TransformerLens."""
        from ..readouts.activation_cache import ActivationCache

        store: dict[str, Tensor] = {}
        with self.hooks([(n, caching_hook(store, device=device)) for n in self.resolve_hook_names(names_filter)]):
            out = self(*args, **kwargs)
        return out, ActivationCache(store, self)  # in the order the hook points fired

    @torch.no_grad()
    def fold_W_dec_norm(self) -> None:
        """Make every decoder row unit-norm without changing the output, as SAELens's `fold_W_dec_norm`
        (the encoder and its biases take the norms; a JumpReLU's threshold too). Refused for a top-k SAE
        that does not rescale by the decoder norm: the choice of the k would change."""
        if self.cfg.architecture == "topk" and not self.cfg.rescale_acts_by_decoder_norm:
            raise BadValue("folding the decoder norms of a top-k SAE changes which k features it keeps "
                           "(SAELens refuses it too, unless rescale_acts_by_decoder_norm)")
        norms = self.W_dec.norm(dim=-1).clamp(min=1e-8)
        self.W_dec.div_(norms.unsqueeze(1))
        self.W_enc.mul_(norms)
        for name in ("b_enc", "b_gate", "b_mag", "threshold"):
            p = getattr(self, name, None)
            if isinstance(p, nn.Parameter):
                p.mul_(norms)

    def extra_repr(self) -> str:
        c = self.cfg
        k = f", k={c.k}" if c.k is not None else ""
        return f"{c.architecture}, d_in={c.d_in}, d_sae={c.d_sae}{k}, hook={c.hook_name!r}"


def build(files: SAEFiles, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> SAE:
    """The SAE a folder's files describe (`files.read`): its config checked, every tensor's shape checked
    against it before one is read, the tensors then read, checked finite and put in place (in `dtype`, else
    the config's, on `device`). Any disagreement is one CheckpointError naming the source."""
    fields = {**files.fields, "source": files.source}
    if dtype is not None:
        fields["dtype"] = dtype_name(dtype_of(dtype))
    try:
        cfg = SAEConfig(**fields)
    except BadValue as e:
        raise CheckpointError(f"{files.source}: {e}") from None
    sae = SAE(cfg, device="meta")
    want = {name: tuple(p.shape) for name, p in sae.state_dict().items()}
    have = dict(files.shapes)
    have.pop("scaling_factor", None)  # SAELens's old scale: read below, dropped when it is all ones
    sizes = f"d_in={cfg.d_in}, d_sae={cfg.d_sae}"
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        said = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                     f"unexpected {', '.join(extra)}" if extra else "") if x)
        raise CheckpointError(f"{files.source} does not hold a {cfg.architecture} SAE's tensors ({said}); "
                              f"a {cfg.architecture} SAE has {', '.join(want)}")
    for name, shape in want.items():
        if tuple(have[name]) != shape:
            raise CheckpointError(f"{files.source}: {name} is {list(have[name])} in the file, but the config says "
                                  f"{sizes}, so it must be {list(shape)}: the config and the weights do not belong together")
    tensors = files.load()
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not bool((scale == 1).all()):
        raise CheckpointError(f"{files.source} holds a scaling_factor that is not all ones (SAELens's old fine-tuning "
                              "scale, which SAELens 6 no longer applies); fold it into W_dec and re-save")
    bad = [f"{n} ({int((~torch.isfinite(t)).sum())} of {t.numel()})" for n, t in tensors.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{files.source} holds non-finite weights (NaN or inf) in {', '.join(bad[:4])}: the SAE is "
                              "damaged or its training diverged; nothing computed from it would mean anything")
    target = dtype_of(cfg.dtype)
    sae.load_state_dict({n: t.to(device=device, dtype=target).contiguous() for n, t in tensors.items()}, assign=True)
    return sae


def load_from_disk(path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                   hook_name: str | None = None, where: str | None = None) -> SAE:
    """The SAE in a local folder of any of the formats `files` reads."""
    from pathlib import Path

    return build(read(Path(path), where=where, hook_name=hook_name), device=device, dtype=dtype)
