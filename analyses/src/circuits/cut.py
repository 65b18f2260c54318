"""A residual-stream SAE as a cut of the circuit graph (Marks et al. 2024, "Sparse Feature Circuits", arXiv
2403.19647, their case of SAEs on the stream itself).

At the cut (the stream x [b, p, d_model] at the SAE's hook point: blocks.l.hook_resid_pre, hook_resid_mid or
hook_resid_post) the SAE rewrites the stream exactly, with SAELens's `use_error_term` meaning:

    x = sum_f acts_f(x) W_dec[f] + b_dec + error(x),      error(y) = y - b_dec - sum_f acts_f(y) W_dec[f]

(f over the kept features, `features.FeatureNodes.features`; what a left-out feature writes is in the error). The
graph (`graph.Graph`) cuts the stream there:

- upstream, every earlier sender (the embeddings, earlier heads and MLPs, an earlier SAE's nodes) sends to the
  earlier receivers as before, and to the cut's receivers: each kept feature f, whose input is a copy of the stream
  at the cut (its pre-activation is linear in it, through W_enc[:, f]), and the error, whose input is another copy
  (its value depends on the whole of it). The cut's receivers form one group of F + 1 inputs [b, p, F + 1, d_model],
  as a layer's queries do (F kept features, then the error);
- downstream, the later receivers (later heads' q, k, v, later MLPs, the logits) read no earlier sender: they read
  the cut's senders, each feature's value acts_f W_dec[f] (a top-k SAE that rescales by the decoder norm decodes with
  its rows divided by their norms, `features.decoder_rows`) and the error's value, and b_dec is a bias. The stream
  after the cut is the sum of those, so every receiver's input is still its senders' values plus the biases.

A patched run (`_Patching`) gives each of the cut's receivers its own input. Feature f's activation is the SAE's
own, on feature f's input: its encoder and nonlinearity (standard, jumprelu, gated: elementwise; top-k: feature f
kept where it is among the k the SAE keeps on that input, found by encoding the input whole, `feature_acts`). The
error's value is error(its input). The stream the later blocks read is then

    out = sum_f acts_f(input_f) W_dec[f] + b_dec + error(input_error)

formed as x + (its change from x's own decomposition), so that an unpatched cut gives x back to the bit. So:

- node patching of feature f (every edge out of it) is the spliced run (`model.run_with_saes(..., use_error_term=
  True)`) with that feature's `hook_sae_acts_post` set to its corrupted value: the runner adds the change of its
  value where it writes (`writes_at`: the SAE's hook point); the error's node patching is `hook_sae_error` set to
  its corrupted value;
- an edge s -> feature f patched moves feature f's input (only) by s's corrupted - clean value, then the SAE's
  nonlinearity runs on it; an edge s -> error moves the error's input, error(y) formed on it;
- EAP and EAP-IG take the metric's gradient at each of the cut's inputs (through the nonlinearity's derivative:
  a top-k SAE's choice of the k is piecewise constant) and contract it with the senders' differences, as at any
  receiver.

Cost: the cut's F + 1 inputs are [b, p, F + 1, d_model], as F + 1 heads' would be, and its F + 1 senders' values
as much. A top-k SAE encodes whole, once per position, each input that differs from both the stream and the error's
input (a patched run's changed features; a faithfulness curve's complement changes most of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .features import decoder_rows

ROWS = 4096  # changed inputs a top-k SAE encodes whole at once (4,096 x d_sae activations)


def feature_acts(sae, index: Tensor, inputs: Tensor, refs: tuple[Tensor, ...] = ()) -> Tensor:
    """[..., F]: feature index[f]'s activation from its own input inputs[..., f, :] ([..., F, d_in], the stream
    before the SAE's b_dec is taken off), differentiable in the inputs. `refs`: [..., d_in] inputs many rows
    equal, whose whole encoding a top-k SAE reads for those rows rather than encoding each row."""
    c = sae.cfg
    sae_in = inputs - sae.b_dec * c.apply_b_dec_to_input

    def dot(W: Tensor, b: Tensor) -> Tensor:  # [..., F]: each feature's own input dotted with its encoder column
        return torch.einsum("...fd,df->...f", sae_in, W) + b

    W = sae.W_enc.index_select(1, index)
    if c.architecture == "gated":
        active = (dot(W, sae.b_gate[index]) > 0).to(sae_in.dtype)
        return active * torch.relu(dot(W * sae.r_mag[index].exp(), sae.b_mag[index]))
    pre = dot(W, sae.b_enc[index])
    if c.architecture == "standard":
        return torch.relu(pre)
    if c.architecture == "jumprelu":
        return torch.relu(pre) * (pre > sae.threshold[index]).to(pre.dtype)
    if c.rescale_acts_by_decoder_norm and c.topk_activation == "topk":
        pre = pre * sae.W_dec[index].norm(dim=-1)
    return torch.relu(pre) * _chosen(sae, index, inputs.detach(), refs).to(pre.dtype)


def _chosen(sae, index: Tensor, inputs: Tensor, refs: tuple[Tensor, ...]) -> Tensor:
    """bool [..., F]: whether a top-k SAE keeps feature index[f] on inputs[..., f, :] (its activation there is not 0):
    rows equal to a ref read the ref's encoding, the others are encoded whole, `ROWS` at a time."""
    out = torch.zeros(inputs.shape[:-1], dtype=torch.bool, device=inputs.device)
    todo = torch.ones_like(out)
    with torch.no_grad():
        for ref in refs:
            same = (inputs == ref.detach()[..., None, :]).all(-1) & todo
            if bool(same.any()):
                out |= same & (sae.encode(ref.detach()).index_select(-1, index) != 0)
                todo &= ~same
        rest = todo.nonzero()  # [n, dims]: the rows of their own
        for start in range(0, rest.shape[0], ROWS):
            at = tuple(rest[start:start + ROWS].T)
            acts = sae.encode(inputs[at])  # [k, d_sae]
            out[at] = acts.gather(-1, index[at[-1]][:, None])[:, 0] != 0
    return out


def cut_hook(p, nodes):
    """The forward hook at a cut (`nodes`: a residual SAE's `features.FeatureNodes`) for the pass `p`
    (`passes._Pass`): its receivers' inputs offered to `p.receive` as group (layer, "cut"), its senders' values
    appended to `p.values` (F kept features, then the error; none where `p.features` is off), and the stream the
    later blocks read given back (see the module)."""
    sae = nodes.sae
    index = torch.tensor(nodes.features, dtype=torch.long, device=sae.device)
    with torch.no_grad():
        rows = decoder_rows(sae).index_select(0, index).detach()  # [F, d]
    F = len(nodes.features)
    group = (nodes.layer, "cut")
    needs = getattr(p.receive, "needs", None)

    def hook(x, hook):
        b, n, d = x.shape
        view = x[:, :, None].expand(b, n, F + 1, d)
        inputs = view if p.receive is None else p.receive(group, view, p.values)
        first = len(p.values)
        make = p.features and (needs is None or needs(first, first + F + 1))
        if p.features and not make:  # a patching that reads none of them
            p.values.extend([None] * (F + 1))
        xs = x.to(sae.dtype)
        grad = torch.is_grad_enabled() and inputs.requires_grad
        if inputs is view and not grad:  # nothing changed at the cut: the stream as it is
            if make:
                with torch.no_grad():
                    acts = sae.encode(xs).index_select(-1, index)
                    _append(p, acts, rows, xs - sae.b_dec - acts @ rows, x.dtype)
            return x
        ins = inputs.to(sae.dtype)
        feats, e_in = ins[:, :, :F], ins[:, :, F]
        acts = feature_acts(sae, index, feats, refs=(xs, e_in))  # [b, n, F]
        acts_e = sae.encode(e_in).index_select(-1, index)
        if grad:  # the stream from the cut's inputs alone: the gradient reaches the earlier senders through them
            out = acts @ rows + sae.b_dec + (e_in - sae.b_dec - acts_e @ rows)
        else:  # x + the change from x's own decomposition (0 where nothing changed)
            acts_x = sae.encode(xs).index_select(-1, index)
            out = xs + ((acts - acts_x) @ rows + (e_in - xs) - (acts_e - acts_x) @ rows)
        if make:
            with torch.no_grad():
                _append(p, acts, rows, e_in - sae.b_dec - acts_e @ rows, x.dtype)
        return out.to(x.dtype)

    return hook


def _append(p, acts: Tensor, rows: Tensor, error: Tensor, dtype) -> None:
    """The cut's senders' values [F + 1, b, n, d] appended to the pass's at once: acts_f W_dec[f], then the error."""
    F, lead = acts.shape[-1], acts.shape[:-1]
    values = acts.new_empty((F + 1, *lead, rows.shape[-1]))
    torch.mul(acts.detach().movedim(-1, 0)[..., None], rows.view(F, *[1] * len(lead), -1), out=values[:F])
    values[F] = error.detach()
    p.values.extend_block(values.to(dtype))
