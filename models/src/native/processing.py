"""Weight processing as TransformerLens does it: fold norms, centre writing weights and the
unembedding, fold value biases, refactor the factored attention matrices.

Every step leaves the model's log-probabilities unchanged (up to float rounding) and makes the
weights easier to read (Elhage et al. 2021, and TransformerLens's `weight_processing.py`, which
these follow in order and in conditions):

fold_ln       A norm's weight (and a LayerNorm's bias) moves into every matrix that reads its output:
              W' = diag(w) W, b' = b + b_norm W. The norm then only normalises (weight 1, bias 0:
              TransformerLens's "LNPre" / "RMSPre"). For LayerNorm the reading matrices are also
              centred over d_model (their input has mean zero, so the mean row is never read).
              ln1 -> W_Q, W_K, W_V (and their biases), and the output gate's W_gate_attn (refused with
              LayerNorm: its bias would need a gate bias); ln2 -> W_in, W_gate (a mixture of experts: the
              router W_gate, every expert's W_in and W_gate, the shared expert and its gate; refused
              with LayerNorm); ln_final -> W_U, b_U.
center_writing_weights (LayerNorm models only: an RMSNorm input is not mean-free)
              Everything written into the residual stream loses its mean over d_model: W_E, W_pos,
              W_O, b_O, W_out, b_out. The next LayerNorm subtracts that mean anyway.
center_unembed W_U and b_U lose their mean over the vocabulary: logits shift by a constant per position.
              Refused where the logits are soft-capped (Gemma 2): the cap is not shift-invariant.
fold_value_biases
              b_V is constant over positions and the pattern sums to 1, so its contribution is a
              constant b_V W_O per head: it moves into b_O (summed over the query heads sharing a
              KV head under GQA) and b_V becomes 0. hook_v and hook_z change; hook_attn_out does not.
              Refused with learned sink logits (gpt-oss), whose patterns sum to less than 1, and with an
              output gate (`attn_output_gate`), which scales b_V's contribution by position.
refactor_factored_attn_matrices
              Per head, W_Q W_K^T (with biases, as [d_model + 1] x [d_model + 1]) is re-factored by
              SVD into balanced factors U sqrt(S), V sqrt(S), and W_V W_O into U S, V^T (the same
              products; singular vectors are defined up to sign, so q, k, v may differ from
              TransformerLens's in sign per d_head component). Needs positions that do not
              enter the QK product (learned or sinusoidal, not rotary or ALiBi), one KV head per query
              head, and no output gate (it multiplies z per d_head component, which the OV SVD rotates).

Folding can create weights the architecture lacked: folding a tied ln_final into W_U unties it, and
a LayerNorm bias creates a b_U (and attention/MLP biases where there were none), so the processed
model's config may differ (`tie_embeddings`, `unembed_bias`, `qkv_bias`, `mlp_bias`,
`attn_out_bias`). Work is done in float64 and cast back to the model's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .components import Unembed
from ..placement.device_map import attach_unit

STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices")


def check_processing(cfg, *, refactor_factored_attn_matrices=False, center_unembed=False, fold_ln=False,
                     center_writing_weights=False, fold_value_biases=False, **_) -> None:
    """Raise a ValueError naming the fix when this architecture cannot take a requested step. (Steps
    that have nothing to act on are skipped, as TransformerLens skips them: folding a model without
    norms, or the norms a block lacks (OLMo 2's before attention and MLP), centring the writing weights
    of an RMSNorm model.)"""
    if center_unembed and cfg.output_logits_soft_cap is not None:
        raise ValueError(
            f"center_unembed=True: this model soft-caps its logits (output_logits_soft_cap={cfg.output_logits_soft_cap}), "
            "so shifting them by a constant changes its probabilities (TransformerLens skips the step too): "
            "pass center_unembed=False"
        )
    # a b_V to fold: the model's own, or one that folding a LayerNorm's bias into W_V creates
    value_bias = cfg.qkv_bias or (fold_ln and cfg.normalization == "layernorm")
    if fold_value_biases and cfg.learned_sinks and value_bias:
        raise ValueError(
            "fold_value_biases=True: this model's learned attention-sink logits take part of each query's "
            "attention, so b_V adds (1 - the sink's share) b_V W_O, which differs by query, not a constant for "
            "b_O: pass fold_value_biases=False"
        )
    if fold_value_biases and cfg.attn_output_gate and value_bias:
        raise ValueError(
            "fold_value_biases=True: this model gates each head's output (attn_output_gate), so b_V adds "
            "(b_V * gate) W_O, which differs by position, not a constant for b_O: pass fold_value_biases=False"
        )
    if fold_ln and cfg.attn_output_gate and cfg.normalization == "layernorm":
        raise ValueError(
            "fold_ln=True: this model's attention output gate reads ln1's output, so folding the LayerNorm's "
            "bias would need a gate bias (b W_gate_attn) that the architecture lacks: pass fold_ln=False"
        )
    if (fold_ln or center_writing_weights) and cfg.num_experts is not None and cfg.normalization == "layernorm":
        raise ValueError(
            "fold_ln / center_writing_weights on a mixture of experts with LayerNorm (folding its bias into the "
            "router and every expert, centring every expert's output) is not implemented: pass fold_ln=False "
            "and center_writing_weights=False"
        )
    if refactor_factored_attn_matrices:
        if cfg.positional in ("rotary", "alibi"):
            raise ValueError(
                f"refactor_factored_attn_matrices=True: with {cfg.positional} positions the QK circuit depends on "
                "the query and key positions, so W_Q W_K^T cannot be re-factored (TransformerLens refuses too): "
                "pass refactor_factored_attn_matrices=False"
            )
        if cfg.kv_heads != cfg.n_heads:
            raise ValueError(
                "refactor_factored_attn_matrices=True: query heads share key/value heads here (GQA/MQA), so one "
                "head's W_Q W_K^T cannot be re-factored without changing the others: pass "
                "refactor_factored_attn_matrices=False"
            )
        if cfg.attn_output_gate:
            raise ValueError(
                "refactor_factored_attn_matrices=True: this model gates each d_head component of a head's output "
                "(attn_output_gate), so re-factoring W_V W_O (a new d_head basis) changes what the gate multiplies: "
                "pass refactor_factored_attn_matrices=False"
            )
        if cfg.learned_sinks and value_bias:
            raise ValueError(
                "refactor_factored_attn_matrices=True: re-factoring folds b_V into b_O, which the learned sink "
                "logits make query-dependent (see fold_value_biases): pass refactor_factored_attn_matrices=False"
            )


@torch.no_grad()
def process_weights(model, *, fold_ln: bool = True, center_writing_weights: bool = True,
                    center_unembed: bool = True, fold_value_biases: bool = True,
                    refactor_factored_attn_matrices: bool = False) -> None:
    """Process `model`'s weights in place (see the module docstring); TransformerLens's defaults.

    Steps this architecture has no use for are skipped as TransformerLens skips them (centring the
    writing weights of an RMSNorm model); the refactoring raises where it cannot apply."""
    cfg = model.cfg
    check_processing(cfg, refactor_factored_attn_matrices=refactor_factored_attn_matrices, center_unembed=center_unembed,
                     fold_ln=fold_ln, center_writing_weights=center_writing_weights, fold_value_biases=fold_value_biases)
    fold_ln = fold_ln and cfg.normalization is not None
    center_writing_weights = center_writing_weights and cfg.normalization == "layernorm"
    dtype = model.dtype
    # on one device (the first of a model split by `device_map`): the steps combine units (ln_final and W_U)
    p = {k: v.detach().to(model.device, torch.float64).clone() for k, v in model.state_dict().items()}
    sd = _Weights(p, cfg)
    layernorm = cfg.normalization == "layernorm"
    if fold_ln:
        for l, block in enumerate(model.blocks):
            readers = [(f"blocks.{l}.attn.W_qkv", f"blocks.{l}.attn.b_qkv")]
            if block.attn.W_gate_attn is not None:  # the output gate reads ln1's output too (no bias: RMSNorm only)
                readers.append((f"blocks.{l}.attn.W_gate_attn", None))
            sd.fold_norm(f"blocks.{l}.ln1", readers, layernorm)
            if block.mlp is not None and hasattr(block.mlp, "input_weights"):  # experts: the router and each expert
                m = f"blocks.{l}.mlp."
                sd.fold_norm(f"blocks.{l}.ln2", [(m + w, b and m + b) for w, b in block.mlp.input_weights()], layernorm)
            elif block.mlp is not None:
                readers = [(f"blocks.{l}.mlp.W_in", f"blocks.{l}.mlp.b_in")]
                if hasattr(block.mlp, "W_gate"):
                    readers.append((f"blocks.{l}.mlp.W_gate", f"blocks.{l}.mlp.b_gate"))
                sd.fold_norm(f"blocks.{l}.ln2", readers, layernorm)
        sd.fold_norm("ln_final", [("unembed.W_U", "unembed.b_U")], layernorm)
    if center_writing_weights:
        sd.untie()  # a tied unembedding must keep reading the uncentred W_E
        sd.center("embed.W_E")
        if "pos_embed.W_pos" in p:
            sd.center("pos_embed.W_pos")
        for l, block in enumerate(model.blocks):
            sd.center(f"blocks.{l}.attn.W_O_flat")
            sd.center(f"blocks.{l}.attn.b_O")
            if block.mlp is not None:
                sd.center(f"blocks.{l}.mlp.W_out")
                sd.center(f"blocks.{l}.mlp.b_out")
    if center_unembed:
        sd.untie()
        p["unembed.W_U"] = p["unembed.W_U"] - p["unembed.W_U"].mean(-1, keepdim=True)
        if p.get("unembed.b_U") is not None:
            p["unembed.b_U"] = p["unembed.b_U"] - p["unembed.b_U"].mean()
    if fold_value_biases:
        for l in range(cfg.n_layers):
            sd.fold_value_bias(l, center=center_writing_weights)
    if refactor_factored_attn_matrices:
        for l in range(cfg.n_layers):
            sd.refactor(l)
    _install(model, sd, dtype)


class _Weights:
    """The model's state dict in float64, edited by the processing steps; None marks a bias the
    architecture lacks (created only if a step makes it nonzero)."""

    def __init__(self, p: dict[str, Tensor], cfg) -> None:
        self.p, self.cfg = p, cfg
        h, kv, dh, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model
        self.h, self.kv, self.dh, self.d = h, kv, dh, d
        if "unembed.W_U" not in p:  # tied: the unembedding is W_E^T until a step unties it
            p["unembed.W_U"] = None

    def get(self, name: str) -> Tensor | None:
        if name == "unembed.W_U" and self.p["unembed.W_U"] is None:
            return self.p["embed.W_E"].T
        return self.p.get(name)

    def untie(self) -> None:
        if self.p["unembed.W_U"] is None:
            self.p["unembed.W_U"] = self.p["embed.W_E"].T.clone()

    def fold_norm(self, norm: str, readers: list[tuple[str, str]], layernorm: bool) -> None:
        if f"{norm}.w" not in self.p:  # a norm this block does not have (OLMo 2's ln1 / ln2)
            return
        w = self.p[f"{norm}.w"]
        b = self.p.get(f"{norm}.b")
        for W_name, b_name in readers:
            if W_name == "unembed.W_U":
                self.untie()
            W = self.get(W_name)  # [d_model, out]
            if b is not None:
                bias = self.p.get(b_name)
                bias = (torch.zeros(W.shape[1], dtype=W.dtype, device=W.device) if bias is None else bias) + b @ W
                self.p[b_name] = bias
            W = w[:, None] * W
            if layernorm:
                W = W - W.mean(0, keepdim=True)
            self.p[W_name] = W
        self.p[f"{norm}.w"] = torch.ones_like(w)
        if b is not None:
            self.p[f"{norm}.b"] = torch.zeros_like(b)

    def center(self, name: str) -> None:
        t = self.p.get(name)
        if t is not None:
            self.p[name] = t - t.mean(-1, keepdim=True)

    def fold_value_bias(self, l: int, center: bool) -> None:
        a = f"blocks.{l}.attn"
        b_qkv = self.p.get(f"{a}.b_qkv")
        if b_qkv is None:
            return
        h, kv, dh = self.h, self.kv, self.dh
        b_v = b_qkv[(h + kv) * dh:].view(kv, dh).repeat_interleave(h // kv, dim=0)  # [head, d_head]
        W_O = self.p[f"{a}.W_O_flat"].view(h, dh, -1)
        folded = torch.einsum("hd,hdm->m", b_v, W_O)
        b_O = self.p.get(f"{a}.b_O")
        b_O = folded if b_O is None else b_O + folded
        self.p[f"{a}.b_O"] = b_O - b_O.mean() if center else b_O
        b_qkv = b_qkv.clone()
        b_qkv[(h + kv) * dh:] = 0
        self.p[f"{a}.b_qkv"] = b_qkv

    def refactor(self, l: int) -> None:
        """Balanced SVD factors of each head's QK (with biases) and OV circuits."""
        a = f"blocks.{l}.attn"
        h, dh, d = self.h, self.dh, self.d
        W_qkv = self.p[f"{a}.W_qkv"]
        b_qkv = self.p.get(f"{a}.b_qkv")
        b_qkv = torch.zeros(W_qkv.shape[1], dtype=W_qkv.dtype) if b_qkv is None else b_qkv.clone()
        W_qkv = W_qkv.clone()
        W_O = self.p[f"{a}.W_O_flat"].view(h, dh, d).clone()
        b_O = self.p.get(f"{a}.b_O")
        b_O = torch.zeros(d, dtype=W_qkv.dtype) if b_O is None else b_O.clone()
        for i in range(h):
            q = slice(i * dh, (i + 1) * dh)
            k = slice((h + i) * dh, (h + i + 1) * dh)
            v = slice((2 * h + i) * dh, (2 * h + i + 1) * dh)
            Q = torch.cat([W_qkv[:, q], b_qkv[None, q]])  # [d_model + 1, d_head]
            K = torch.cat([W_qkv[:, k], b_qkv[None, k]])
            U, S, Vh = torch.linalg.svd(Q @ K.T)
            U, S, Vh = U[:, :dh], S[:dh].sqrt(), Vh[:dh]
            Q, K = U * S, Vh.T * S
            W_qkv[:, q], b_qkv[q] = Q[:-1], Q[-1]
            W_qkv[:, k], b_qkv[k] = K[:-1], K[-1]
            # OV: fold b_V into b_O first (a constant), then re-factor W_V W_O.
            b_O += b_qkv[v] @ W_O[i]
            b_qkv[v] = 0
            U, S, Vh = torch.linalg.svd(W_qkv[:, v] @ W_O[i])
            W_qkv[:, v], W_O[i] = U[:, :dh] * S[:dh], Vh[:dh]  # as TransformerLens: the scale in W_V
        self.p[f"{a}.W_qkv"], self.p[f"{a}.b_qkv"] = W_qkv, b_qkv
        self.p[f"{a}.W_O_flat"], self.p[f"{a}.b_O"] = W_O.reshape(h * dh, d), b_O


def _install(model, sd: _Weights, dtype: torch.dtype) -> None:
    """Write the processed weights into `model`, first giving it the biases and untied unembedding
    that processing created (and a config that says so)."""
    p = sd.p

    def nonzero(name: str) -> bool:
        t = p.get(name)
        return t is not None and bool(t.abs().max() > 0)

    cfg = model.cfg
    changes = {}
    if cfg.tie_embeddings and p["unembed.W_U"] is not None:
        changes["tie_embeddings"] = False
    if not cfg.unembed_bias and nonzero("unembed.b_U"):
        changes["unembed_bias"] = True
    n = cfg.n_layers
    if not cfg.qkv_bias and any(nonzero(f"blocks.{l}.attn.b_qkv") for l in range(n)):
        changes["qkv_bias"] = True
    if not cfg.attn_out_bias and any(nonzero(f"blocks.{l}.attn.b_O") for l in range(n)):
        changes["attn_out_bias"] = True
    if not cfg.mlp_bias and any(nonzero(f"blocks.{l}.mlp.{b}") for l in range(n) for b in ("b_in", "b_gate", "b_out")):
        changes["mlp_bias"] = True
    if changes:
        new_cfg = cfg.replace(**changes)
        where = model.device_map or {}  # a model split over devices: each new weight on its unit's device
        if "tie_embeddings" in changes or "unembed_bias" in changes:
            # A new module starts in training mode; it takes the model's (eval after interp.load),
            # or TransformerLens's tools refuse the model (they check every module).
            model.unembed = Unembed(new_cfg).to(device=where.get("unembed", model.device), dtype=dtype).train(model.training)
            if where:

                attach_unit(model, "unembed", where["unembed"])
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            device = where.get(f"blocks.{block.layer}", model.device)
            if changes.get("qkv_bias"):
                attn.b_qkv = nn.Parameter(torch.zeros(attn.W_qkv.shape[1], device=device, dtype=dtype))
            if changes.get("attn_out_bias"):
                attn.b_O = nn.Parameter(torch.zeros(cfg.d_model, device=device, dtype=dtype))
            if changes.get("mlp_bias") and mlp is not None:
                for name, size in (("b_in", cfg.d_mlp), ("b_gate", cfg.d_mlp), ("b_out", cfg.d_model)):
                    if hasattr(mlp, name):
                        setattr(mlp, name, nn.Parameter(torch.zeros(size, device=device, dtype=dtype)))
        model.cfg = new_cfg
    state = model.state_dict()
    for name, t in state.items():
        value = p.get(name)
        if value is not None:
            t.copy_(value.to(dtype))
    # the caller (`HookedTransformer.process_weights_`) records the steps and refreshes cfg's view
