"""A circuit task made of random tokens, shared by the circuit, QK-attribution and offload tests, and the
interventions the circuit tests write out by hand with the model's own hooks."""

from __future__ import annotations

import torch

from interp.analyses.circuits import Task
from interp.analyses.circuits.tasks import token_metric
from interp.models.saes import SAE, SAEConfig


def random_task(model, n: int = 3, p: int = 7, seed: int = 0) -> Task:
    """Random clean / corrupted tokens; the answer at the last two positions is a random token, the wrong
    one another."""
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.d_vocab
    clean, corrupted = torch.randint(V, (n, p), generator=g), torch.randint(V, (n, p), generator=g)
    rows = torch.arange(n).repeat_interleave(2)
    positions = torch.tensor([p - 2, p - 1]).repeat(n)
    answers = torch.randint(V, (2 * n, 1), generator=g).tolist()
    wrongs = torch.randint(V, (2 * n, 1), generator=g).tolist()
    return Task("random", clean, corrupted, rows, positions, token_metric("logit-diff", answers, wrongs), "logit-diff")


def head_delta(model, clean: torch.Tensor, corrupted: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Head `head` of layer `layer`'s output (its hook_result, [batch, pos, d_model]) on the corrupted prompts
    less that on the clean ones: what patching the head from the corrupted run adds downstream."""
    name = f"blocks.{layer}.attn.hook_result"
    _, a = model.run_with_cache(clean, names_filter=lambda n: n == name)
    _, b = model.run_with_cache(corrupted, names_filter=lambda n: n == name)
    return b[name][:, :, head] - a[name][:, :, head]


def add_to_head(head: int, delta: torch.Tensor):
    """A forward hook on a per-head input ([batch, pos, head, d_model], e.g. hook_q_input) adding `delta` to head
    `head`'s."""

    def hook(x, hook):
        x = x.clone()
        x[:, :, head] += delta
        return x

    return hook


def run_hooked(model, tokens: torch.Tensor, fwd_hooks=(), split_qkv: bool = False) -> torch.Tensor:
    """The logits of a forward without gradients with `fwd_hooks`; `split_qkv`: with each head's query, key and value
    inputs apart (hook_q_input, ...), put back together after."""
    if split_qkv:
        model.set_use_split_qkv_input(True)
    try:
        with torch.no_grad():
            return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks))
    finally:
        if split_qkv:
            model.set_use_split_qkv_input(False)


def by_hand_metric(model, task: Task, fwd_hooks=(), split_qkv: bool = False) -> float:
    """The task's metric from a whole forward of the clean prompts, with `fwd_hooks` (`run_hooked`)."""
    return metric_of(task, run_hooked(model, task.clean, fwd_hooks, split_qkv))


# ---- SAE features in the graph (test_circuit_features, test_circuit_resid_features) --------------------------
def random_sae(cfg, hook: str, d_sae: int = 24, seed: int = 0, arch: str = "standard") -> SAE:
    """An SAE with random weights at `hook` of a model of config `cfg`: enough features fire, some do not, and the
    reconstruction is poor (the error node carries much); top-k: k=4, rescaled by the decoder norm."""
    z = hook.endswith("hook_z")
    d_in = cfg.n_heads * cfg.d_head if z else cfg.d_model
    extra = dict(k=4, rescale_acts_by_decoder_norm=True) if arch == "topk" else {}
    sae = SAE(SAEConfig(architecture=arch, d_in=d_in, d_sae=d_sae, hook_name=hook,
                        reshape_activations="hook_z" if z else "none", **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec):
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        sae.b_enc.sub_(0.6)  # some features never fire
    return sae


def metric_of_tensor(task, logits) -> torch.Tensor:
    """The task's metric on full logits [b, p, vocab], averaged over its rows (differentiable)."""
    return task.metric(logits[task.rows, task.positions], torch.arange(task.n_answers)).mean()


def metric_of(task, logits) -> float:
    """The same as a float, averaged in float64."""
    return float(task.metric(logits[task.rows, task.positions], torch.arange(task.n_answers)).double().mean())


def spliced(model, sae, tokens, fwd_hooks=()) -> torch.Tensor:
    """Logits of the run with `sae` spliced in (use_error_term: the clean run) and `fwd_hooks` on its hook points."""
    with torch.no_grad(), model.saes([sae], use_error_term=True):
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks))


def cached(model, sae, tokens, point: str) -> torch.Tensor:
    """The spliced SAE's `point` (hook_sae_acts_post, hook_sae_error, ...) on `tokens`."""
    with torch.no_grad():
        _, cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True,
                                                  names_filter=lambda n: n == f"{sae.cfg.hook_name}.{point}")
    return cache[f"{sae.cfg.hook_name}.{point}"]
