"""TransformerLens's weight views of the model: stacked per-layer weights and biases under its names
(`W_Q`, `b_O`, `W_in`, `W_U`, ...), the factored QK / OV circuits, composition scores and the
`tl_parameters()` dictionary its tools read. A mixin of `HookedTransformer`."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from .factored import FactoredMatrix, layered_composition_scores
from ..placement.offload import OffloadRefused


def or_zeros(bias: Tensor | None, like: Tensor, size: int) -> Tensor:
    """A bias the checkpoint lacks reads as zeros (as in TransformerLens's HookedTransformer, and in
    the bridge for b_U): `bias`, or zeros of `size` in `like`'s dtype and device."""
    return bias if bias is not None else like.new_zeros(size)


class OptionalBias:
    """A module's bias that the architecture may lack (`unembed.b_U`, `mlp.b_in`, `attn.b_O`, ...).

    Stored as the module's parameter, None when absent: no state_dict key, and the forward pass
    reads `stored(module, name)` and adds nothing. Read as an attribute it is zeros when absent, so
    TransformerLens code such as `model.unembed.b_U.sort()` or `torch.stack([b.mlp.b_in for b in
    model.blocks])` runs. `weight` names the matrix the bias is added after: its last dimension is the
    bias's size, and its dtype and device the zeros'. Assigning a Parameter (weight processing creating
    a bias) registers it as before."""

    def __init__(self, weight: str) -> None:
        self.weight = weight

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        params = module.__dict__.get("_parameters", {})
        if self.name not in params:  # not registered yet: lets nn.Module register it
            raise AttributeError(f"{type(module).__name__}.{self.name} is not set yet")
        w = getattr(module, self.weight)
        return or_zeros(params[self.name], w, w.shape[-1])

    def __set__(self, module, value) -> None:
        # nn.Module registers Parameters itself; this is reached for None (a bias the model lacks).
        module.register_parameter(self.name, value)


def stored(module: nn.Module, name: str) -> Tensor | None:
    """The bias parameter itself, None when the architecture lacks it (what forward passes read)."""
    return module._parameters[name]


class WeightModel(Protocol):
    """What `WeightViews` needs from the model it is mixed into (`HookedTransformer`), and all it reads."""

    cfg: ModelConfig  # n_layers, n_heads, kv_heads, d_model, positional, attn_only
    embed: nn.Module  # .W_E
    pos_embed: nn.Module | None  # .W_pos; None without learned or sinusoidal positions
    blocks: nn.ModuleList  # TransformerBlocks: .attn (W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O), .mlp (None
    #                        when attention-only; W_in, W_out, b_in, b_out, W_gate when gated), .ln1, .ln2
    ln_final: nn.Module | None
    unembed: nn.Module  # .W_U, .b_U
    device: torch.device
    dtype: torch.dtype
    offload: object  # an `interp.models.placement.offload.Offload` (its units are read one at a time), or None


class WeightViews:
    """TransformerLens's weight views, mixed into a `WeightModel` (`HookedTransformer`): every view
    reads the host only through the `WeightModel` attributes (cfg, embed, pos_embed, blocks,
    ln_final, unembed, device, dtype) and this mixin's own views (tests/contract/test_layers.py checks it)."""

    # ---- weights, TransformerLens names -------------------------------------------------------
    def _read(self, unit: str, read):
        """`read()` of weights in `unit` ("blocks.3", "embed", "unembed"). On an offloaded model
        (`interp.models.placement.offload`) the unit is brought to the device for the read and the result is a copy
        (the unit is released after); on a model held whole it is the parameter itself."""
        offload = self.offload
        if offload is None:
            return read()
        with offload.holding(unit):
            return read().clone()

    @property
    def W_E(self) -> Tensor:
        return self._read("embed", lambda: self.embed.W_E)

    @property
    def W_U(self) -> Tensor:
        return self._read("unembed", lambda: self.unembed.W_U)

    @property
    def W_pos(self) -> Tensor:
        if self.pos_embed is None:
            raise AttributeError(f"this model has {self.cfg.positional!r} positions, so no W_pos")
        return self._read("pos_embed", lambda: self.pos_embed.W_pos)

    def _stack(self, attr: str) -> Tensor:
        # a model split over devices (`device_map`): each layer's weights brought to the first device
        return torch.stack([self._read(f"blocks.{l}", lambda: getattr(b.attn, attr)).to(self.device)
                            for l, b in enumerate(self.blocks)])

    W_Q = property(lambda self: self._stack("W_Q"), doc="[layer, head, d_model, d_head]")
    W_K = property(lambda self: self._stack("W_K"), doc="[layer, kv_head, d_model, d_head]")
    W_V = property(lambda self: self._stack("W_V"), doc="[layer, kv_head, d_model, d_head]")
    W_O = property(lambda self: self._stack("W_O"), doc="[layer, head, d_head, d_model]")
    b_Q = property(lambda self: self._stack("b_Q"), doc="[layer, head, d_head] (zeros without biases)")
    b_K = property(lambda self: self._stack("b_K"), doc="[layer, kv_head, d_head] (zeros without biases)")
    b_V = property(lambda self: self._stack("b_V"), doc="[layer, kv_head, d_head] (zeros without biases)")

    b_O = property(lambda self: self._stack("b_O"), doc="[layer, d_model] (zeros without biases)")

    def _stack_mlp(self, attr: str) -> Tensor:
        if self.cfg.attn_only:
            raise AttributeError(f"{attr}: this model is attention-only, it has no MLPs")
        if attr == "W_gate" and not hasattr(self.blocks[0].mlp, "W_gate"):
            raise AttributeError("W_gate: this model's MLPs are not gated")
        return torch.stack([self._read(f"blocks.{l}", lambda: getattr(b.mlp, attr)).to(self.device)
                            for l, b in enumerate(self.blocks)])

    W_in = property(lambda self: self._stack_mlp("W_in"), doc="[layer, d_model, d_mlp]")
    W_gate = property(lambda self: self._stack_mlp("W_gate"), doc="[layer, d_model, d_mlp] (gated MLPs)")
    W_out = property(lambda self: self._stack_mlp("W_out"), doc="[layer, d_mlp, d_model]")
    b_in = property(lambda self: self._stack_mlp("b_in"), doc="[layer, d_mlp] (zeros without biases)")
    b_out = property(lambda self: self._stack_mlp("b_out"), doc="[layer, d_model] (zeros without biases)")

    @property
    def b_U(self) -> Tensor:
        """[d_vocab] (zeros without an unembedding bias)."""
        return self._read("unembed", lambda: self.unembed.b_U)

    @property
    def W_E_pos(self) -> Tensor:
        """[d_vocab + n_ctx, d_model]: W_E stacked on W_pos, the whole input space of a model with
        learned positions."""
        return torch.cat([self.W_E, self.W_pos], dim=0)

    def _kv_to_heads(self, w: Tensor, dim: int = 1) -> Tensor:
        """kv heads -> query heads along `dim` ([layer, kv_head, ...] by default): query head h reads
        kv head h // (n_heads / n_kv_heads)."""
        return w.repeat_interleave(self.cfg.n_heads // self.cfg.kv_heads, dim=dim)

    @property
    def QK(self) -> "FactoredMatrix":
        """W_Q W_K^T per head, [layer, head, d_model, d_model], factored (`interp.FactoredMatrix`);
        under GQA each query head with its kv head. Positions (rotary, ALiBi) are not included."""
        return FactoredMatrix(self.W_Q, self._kv_to_heads(self.W_K).transpose(-2, -1))

    @property
    def OV(self) -> "FactoredMatrix":
        """W_V W_O per head, [layer, head, d_model, d_model], factored (`interp.FactoredMatrix`). Weights only:
        a gated model's output gate (`attn_output_gate`: z * sigmoid(x W_gate_attn), per position and d_head
        component) depends on the input and is not in it, nor are learned sink logits."""
        return FactoredMatrix(self._kv_to_heads(self.W_V), self.W_O)

    def tl_parameters(self) -> dict[str, Tensor]:
        """The weights under TransformerLens's names and per-head shapes, as the bridge's
        `tl_parameters()` (what `SVDInterpreter` and other TransformerLens tools read):
        `blocks.L.attn.W_Q` [head, d_model, d_head], W_K / W_V expanded to one per query head under
        GQA, absent biases as zeros, `blocks.L.ln1.w`, `unembed.W_U`, ... Views of the live
        weights, not copies.

        Gemma 3's extra norms come under the names TransformerLens 4's components have
        (`blocks.L.ln1_post.w`, `blocks.L.ln2_post.w`, `blocks.L.attn.q_norm.w`, `blocks.L.attn.k_norm.w`),
        which its bridge's own `tl_parameters()` leaves out. Every norm weight here is the whole multiplier
        (1 + Hugging Face's stored w for Gemma): our cfg has no `rmsnorm_uses_offset`, so TransformerLens's
        tools use it as it is, where the bridge reports w and sets `cfg.rmsnorm_uses_offset`.

        TransformerLens has no learned sink logits nor output gate: they come as `blocks.L.attn.sinks` and
        `blocks.L.attn.W_gate_attn` [head, d_model, d_head], and its weight-only tools (OV circuits,
        `SVDInterpreter`) leave them out."""
        if self.offload is not None:

            raise OffloadRefused("tl_parameters() gives views of every live weight, and this model is offloaded "
                                 f"({self.offload.kind}): read one layer's inside `with model.holding(layer):`, or load "
                                 "the model without offload")
        out: dict[str, Tensor] = {"embed.W_E": self.W_E}
        if self.pos_embed is not None:
            out["pos_embed.W_pos"] = self.W_pos
        expand = lambda w: self._kv_to_heads(w, dim=0)  # noqa: E731
        for i, block in enumerate(self.blocks):
            a, pre = block.attn, f"blocks.{i}."
            out.update({
                pre + "attn.W_Q": a.W_Q, pre + "attn.W_K": expand(a.W_K), pre + "attn.W_V": expand(a.W_V),
                pre + "attn.W_O": a.W_O, pre + "attn.b_Q": a.b_Q, pre + "attn.b_K": expand(a.b_K),
                pre + "attn.b_V": expand(a.b_V), pre + "attn.b_O": a.b_O,
            })
            if a.sinks is not None:  # learned sink logits (gpt-oss), [head]
                out[pre + "attn.sinks"] = a.sinks
            if getattr(a, "W_gate_attn", None) is not None:  # the output gate, [head, d_model, d_head] as W_Q
                out[pre + "attn.W_gate_attn"] = a.W_gate_attn.unflatten(-1, (a.n_heads, a.d_head)).permute(1, 0, 2)
            for norm in ("q_norm", "k_norm"):  # QK-norm (Gemma 3): one weight of d_head, shared by the heads
                module = getattr(a, norm, None)
                for k, v in (module.named_parameters() if module is not None else ()):
                    out[f"{pre}attn.{norm}.{k}"] = v
            if block.mlp is not None and hasattr(block.mlp, "experts"):  # a mixture: TransformerLens's MoE names
                out.update({f"{pre}mlp.{k}": v for k, v in block.mlp.named_parameters()})  # mlp.W_gate: the router
            elif block.mlp is not None:
                m = block.mlp
                out[pre + "mlp.W_in"], out[pre + "mlp.W_out"] = m.W_in, m.W_out
                out[pre + "mlp.b_in"], out[pre + "mlp.b_out"] = m.b_in, m.b_out
                if getattr(m, "W_gate", None) is not None:
                    out[pre + "mlp.W_gate"] = m.W_gate
            for norm in ("ln1", "ln1_post", "ln2", "ln2_post"):  # the *_post norms: sandwich blocks only
                module = getattr(block, norm, None)
                for k, v in (module.named_parameters() if module is not None else ()):
                    out[f"{pre}{norm}.{k}"] = v
        for k, v in (self.ln_final.named_parameters() if self.ln_final is not None else ()):
            out[f"ln_final.{k}"] = v
        out["unembed.W_U"], out["unembed.b_U"] = self.W_U, self.b_U
        return out

    def tl_named_parameters(self):
        """`tl_parameters()` as (name, tensor) pairs, as the bridge's."""
        return iter(self.tl_parameters().items())

    def all_composition_scores(self, mode: str) -> Tensor:
        """[layer, head, layer, head] Q-, K- or V-composition scores (`mode` "Q", "K", "V") of every
        earlier head with every later one, zero where the first layer is not earlier, as
        TransformerLens's. `interp.analyses.composition_scores` gives them as a table, with a
        random baseline. From the weights alone (`OV`, `QK`): a gated model's input-dependent output gate
        is not in them."""
        if mode not in ("Q", "K", "V"):
            raise ValueError(f"mode must be 'Q', 'K' or 'V', got {mode!r}")
        # Only pairs with an earlier first layer are computed (half the work of all pairs); float32 at
        # least, as TransformerLens computes them in the weights' dtype; one matrix product per layer
        # (`layered_composition_scores`).
        dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            left = self.OV
            right = {"Q": self.QK, "K": self.QK.T, "V": left}[mode]
            return layered_composition_scores(left, right, dtype)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """[d_model]: the attention (b_O) and MLP (b_out) output biases added to the residual stream
        before block `layer` (with mlp_input, also block `layer`'s b_O). TransformerLens's signature."""
        total = torch.zeros(self.cfg.d_model, device=self.device, dtype=self.dtype)
        for i, block in enumerate(self.blocks[: layer + 1 if mlp_input else layer]):
            total = total + self._read(f"blocks.{i}", lambda: block.attn.b_O)  # absent biases read as zeros
            if include_mlp_biases and i < layer and block.mlp is not None:
                total = total + self._read(f"blocks.{i}", lambda: block.mlp.b_out)
        return total
