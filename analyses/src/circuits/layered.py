"""EAP and EAP-IG one block at a time, in memory that grows with positions x d_model, not with the graph's
receivers times that, nor with positions squared: the attribution of long prompts (a passkey circuit at 4,096
tokens).

The whole-graph attribution (`Runner._gradients`) differentiates one forward through every block and keeps
each receiver's gradient, `[receivers, batch, positions, d_model]`: 841 receivers x 4,096 positions x 576
on SmolLM2 is 7.9 GB per prompt, on top of the activations autograd saves for every block (q, k and v read
per head: another ~4 GB at 4,096 tokens). Here instead, for each chunk of prompts and each point of the
integral:

1. the stream of the run the gradient is taken at (the clean run for EAP, a point between the corrupted and
   the clean run for EAP-IG) is known block by block: the clean run's is cached already, a point's is run
   once without autograd, keeping each block's input (`positions x d_model` per block);
2. the metric's gradient at the final stream is taken, then each block is run again from its input, with
   autograd, alone, and the gradient at its output carried through it: the gradient at each of its
   receivers' inputs and at its input (the next block down's output). That is the chain rule, block by
   block (checkpointing at block boundaries): the same gradients as one backward through the whole model;
3. each block's receiver gradients are contracted with the senders' differences (corrupted - clean value,
   formed a few senders at a time from the cached runs) as soon as they exist, and dropped.

The attention runs on the fused kernel forward and backward (no pattern is built), so the only n x n work is
the kernel's own. What is held: every sender's cached difference (corrupted - clean: senders x positions x
d_model, the runner's lean cache) and both runs' block inputs, one block's autograd state, and one block's
receiver gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .passes import graph_mode

SENDER_CHUNK = 32  # senders whose differences are formed at once (32 x 4,096 x 576 floats: 0.3 GB)


def layered_attribution(runner, i: int, point, scores: Tensor, weight: float, positions=None) -> None:
    """Add `weight` x the EAP (point None) or one EAP-IG point's scores of chunk `i` to `scores` [S, R] (or
    [S, R, C] with `positions`, `positions.Positions`: kept apart per position class), float64 on the host,
    block by block. The values are `Runner._gradients`' contracted as `_attribution` contracts them, to
    float32 round-off (the order of the sums differs)."""
    model, g, task = runner.model, runner.graph, runner.task
    part, answers = runner.chunks[i]
    substitute = _substitution(runner, i, point)
    stream, final = _stream(runner, i, point, substitute)
    final = final.detach().requires_grad_(True)
    x = substitute((g.n_layers, "logits"), final)
    metric = runner._final_metric(x, answers, part.start).sum() / task.n_answers
    (grad,) = torch.autograd.grad(metric, [final])
    contract = _contraction(g, scores, lambda s, e: runner._differences(i, s, e), weight, positions, part)
    contract(g.groups[(g.n_layers, "logits")], grad[None])
    for l in reversed(range(g.n_layers)):
        grad, received = _through_block(model, g, l, stream[l], grad, substitute)
        for rs, per_receiver in received:
            contract(rs, per_receiver)
        del received


def _through_block(model, g, l: int, x: Tensor, grad: Tensor, substitute):
    """Block `l` run again from its input `x` with autograd, and the gradient `grad` at its output carried
    through it: (the gradient at its input, [(receiver indices, their gradients [n, b, p, d])])."""
    inputs: dict[tuple, Tensor] = {}

    def receive(x, hook, group):
        x = substitute(group, x)
        inputs[group] = x
        return x

    hooks = _receiver_hooks(g, [l], receive)
    x_in = x.detach().requires_grad_(True)
    with torch.enable_grad(), graph_mode(model), model.hooks(hooks):
        out = model(x_in, start_at_layer=l, stop_at_layer=l + 1)
    keys = list(inputs)
    found = torch.autograd.grad(out, [x_in] + [inputs[k] for k in keys], grad_outputs=grad, allow_unused=True)
    received = [(g.groups[key], gr.permute(2, 0, 1, 3) if gr.dim() == 4 else gr[None])  # [n, b, p, d]
                for key, gr in zip(keys, found[1:]) if gr is not None]
    return found[0], received


def _receiver_hooks(g, layers, fn) -> list:
    """(hook name, hook) for every receiver input of `layers` (q, k, v, and the MLP's), calling fn(x, hook, group)."""
    kinds = ("q", "k", "v", "mlp") if g.has_mlp else ("q", "k", "v")
    name = lambda l, kind: f"blocks.{l}.hook_mlp_in" if kind == "mlp" else f"blocks.{l}.hook_{kind}_input"  # noqa: E731
    return [(name(l, kind), _bound(fn, (l, kind))) for l in layers for kind in kinds]


def _bound(fn, group):
    return lambda x, hook: fn(x, hook, group)


def _substitution(runner, i: int, point):
    """EAP-IG on "activations": each receiver's input takes the interpolated value, its gradient through the
    stream (as `Runner._gradients`); otherwise the inputs as they are."""
    if point is None or point[1] != "activations":
        return lambda group, x: x
    alpha = point[0]
    clean_in, corrupt_in = runner._receiver_inputs(i, "clean"), runner._receiver_inputs(i, "corrupted")

    def substitute(group, x):
        target = corrupt_in[group] + alpha * (clean_in[group] - corrupt_in[group])
        return x + (target - x).detach()
    return substitute


def _stream(runner, i: int, point, substitute) -> tuple[list[Tensor], Tensor]:
    """Each block's input and the final stream of the run the gradient is taken at."""
    c = runner._chunk(i)
    cached_resid, cached_final = c["clean"][1], c["clean"][2]
    if point is None:
        return cached_resid, cached_final
    model, g = runner.model, runner.graph
    alpha, on = point
    if on == "inputs":
        clean0, corrupt0 = cached_resid[0], c["corrupted"][1][0]
        x = corrupt0 + alpha * (clean0 - corrupt0)
    else:
        x = cached_resid[0]
    hooks = []
    if on == "activations":
        hooks = _receiver_hooks(g, range(g.n_layers), lambda x, hook, group: substitute(group, x))
    stream = []
    with torch.no_grad(), graph_mode(model), model.hooks(hooks):
        for l in range(g.n_layers):
            stream.append(x)
            x = model(x, start_at_layer=l, stop_at_layer=l + 1)
    return stream, x


def _contraction(g, scores: Tensor, differences, weight: float, positions, part):
    """contract(rs, grads): scores[s, r] += weight x (corrupted_s - clean_s) . grads[r] for the senders that
    can reach the receivers `rs` (the rest are not edges), a few senders at a time (`differences(s, e)`:
    senders s..e's corrupted - clean values)."""

    def contract(rs: list[int], grads: Tensor) -> None:
        allowed = g.allowed[:, rs].any(1).nonzero().flatten()
        if allowed.numel() == 0:
            return
        n = int(allowed.max()) + 1  # senders are in the order of computation: those that can reach come first
        flat = grads.flatten(1).float()  # [n_r, b*p*d]
        for s in range(0, n, SENDER_CHUNK):
            e = min(n, s + SENDER_CHUNK)
            diff = differences(s, e)
            if positions is not None:
                part_scores = positions.contract(part, diff, grads)  # [k, n_r, C]
            else:
                part_scores = diff.flatten(1).float() @ flat.T
            scores[s:e, rs] += part_scores.to(device=scores.device, dtype=scores.dtype) * weight
    return contract
