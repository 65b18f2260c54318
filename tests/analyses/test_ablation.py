"""ablate_heads against a plain loop: one full forward per head with a hook that ablates it."""

from __future__ import annotations

import pytest
import torch
from analyses_fixtures import build, tokens

from interp.analyses import ablate_heads
from interp.models import lm_loss


def _loop(model, toks, method, attention_mask=None, seed=0, metric=None):
    """The obvious reference: ablation values computed here from a plain cache, one forward per head."""
    cfg = model.cfg
    valid = torch.ones_like(toks, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_z"), attention_mask=attention_mask)
        clean_logits = model(toks, attention_mask=attention_mask)
    score = (lambda lg: lm_loss(lg, toks, valid)) if metric is None else (lambda lg: metric(lg, toks))
    out = {"clean": float(score(clean_logits))}
    if method == "resample":
        g = torch.Generator().manual_seed(seed)
        while True:  # the documented seeded derangement
            perm = torch.randperm(toks.shape[0], generator=g)
            if not bool((perm == torch.arange(toks.shape[0])).any()):
                break
    for l in range(cfg.n_layers):
        z = cache["z", l]  # [batch, pos, head, d_head]
        for h in range(cfg.n_heads):
            if method == "zero":
                new = torch.zeros_like(z[:, :, h])
            elif method == "mean":
                new = z[:, :, h][valid].mean(0).expand_as(z[:, :, h])
            else:
                new = z[perm][:, :, h]

            def hook(x, hook, h=h, new=new):
                x = x.clone()
                x[:, :, h] = new
                return x

            with torch.no_grad():
                logits = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook)], attention_mask=attention_mask)
            out[(l, h)] = float(score(logits))
    return out


@pytest.mark.parametrize("method", ["mean", "zero", "resample"])
@pytest.mark.parametrize("name", ["learned", "rotary-gqa"])
def test_sweep_equals_the_plain_loop(name, method):
    model = build(name)
    toks = tokens(4, 20, seed=1, vocab=model.cfg.d_vocab)
    frame = ablate_heads(model, toks, method, progress=False)
    ref = _loop(model, toks, method)
    assert len(frame) == model.cfg.n_layers * model.cfg.n_heads
    assert frame["clean_loss"].iloc[0] == pytest.approx(ref["clean"], abs=1e-5)
    for r in frame.itertuples():
        assert r.loss == pytest.approx(ref[(r.layer, r.head)], abs=1e-5)
        assert r.delta == pytest.approx(r.loss - r.clean_loss)
    assert frame["delta"].abs().max() > 1e-3  # the ablations do something


def test_subset_small_batches_and_right_padding():
    model = build("attn-only-3l")
    toks = tokens(3, 18, seed=2, vocab=model.cfg.d_vocab)
    mask = torch.ones_like(toks)
    mask[0, 12:] = 0
    mask[2, 5:] = 0
    heads = [(2, 3), (0, 1), (1, 0), (1, 2), (1, 3)]
    frame = ablate_heads(model, toks, "mean", heads=heads, attention_mask=mask, heads_per_batch=2, progress=False)
    ref = _loop(model, toks, "mean", attention_mask=mask)
    assert [(r.layer, r.head) for r in frame.itertuples()] == sorted(heads)
    for r in frame.itertuples():
        assert r.loss == pytest.approx(ref[(r.layer, r.head)], abs=1e-5)


def test_custom_metric():
    model = build("learned")
    toks = tokens(2, 12, seed=3, vocab=model.cfg.d_vocab)

    def last_logit_margin(logits, tokens):
        top2 = logits[:, -1].topk(2, dim=-1).values
        return (top2[:, 0] - top2[:, 1]).mean()

    frame = ablate_heads(model, toks, "zero", metric=last_logit_margin, progress=False)
    ref = _loop(model, toks, "zero", metric=last_logit_margin)
    assert set(frame.columns) >= {"clean_metric", "metric_value", "metric", "delta"}
    assert (frame["metric"] == "last_logit_margin").all()
    for r in frame.itertuples():
        assert r.metric_value == pytest.approx(ref[(r.layer, r.head)], abs=1e-4)


def test_errors():
    model = build("learned")
    with pytest.raises(ValueError, match="another sequence"):
        ablate_heads(model, tokens(1, 8), "resample")
    with pytest.raises(ValueError, match="method"):
        ablate_heads(model, tokens(2, 8), "gaussian")
    with pytest.raises(ValueError, match="metric"):
        ablate_heads(model, tokens(2, 8), "mean", metric="accuracy")


def test_parallel_attention_mlp_blocks():
    """GPT-NeoX-style blocks (x + attn(ln1 x) + mlp(ln2 x)): the sweep resumes mid-block correctly."""
    from hf_cases import build_hf

    import interp

    model = interp.from_hf(build_hf("neox"))
    assert model.blocks[0].parallel
    toks = tokens(3, 12, seed=4, vocab=model.cfg.d_vocab)
    frame = ablate_heads(model, toks, "resample", seed=1, progress=False)
    ref = _loop(model, toks, "resample", seed=1)
    for r in frame.itertuples():
        assert r.loss == pytest.approx(ref[(r.layer, r.head)], abs=1e-5)
