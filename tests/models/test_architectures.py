"""Every causal LM of the issue's list, the same checks, against transformers itself.

For each `model_type` (native families from `hf_cases.CASES`, wrapped ones from `wrapped_cases.WRAPPED`),
on tiny random weights from transformers' own config classes:

- logits within 1e-4 of transformers' default implementation, on the fused path and the instrumented
  one, without padding and with left padding;
- every layer's `hook_pattern` equal to transformers' eager `output_attentions` within 1e-5;
- one head ablated through `hook_z` equal to transformers with that head's slice zeroed at the input of
  its attention output projection;
- the streaming statistics (`model.attention_stats`) equal to the same statistics summed out of
  transformers' eager patterns with TransformerLens's detection patterns;
- greedy `generate` equal to transformers' `generate(do_sample=False)`.

The oracle is always a second transformers model built from the same seed, never the wrapped one.
"""

from __future__ import annotations

import functools

import pytest
import torch

import interp
from interp.kernels.stats.reference import (
    duplicate_detection_pattern,
    induction_detection_pattern,
    previous_detection_pattern,
)

transformers = pytest.importorskip("transformers")
from arch_cases import ARCHITECTURES, COVERED, N, builder  # noqa: E402 - needs transformers

def tokens(batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, N), generator=g)  # 0-2: pad / bos / eos of the wrapped cases


def left_mask() -> torch.Tensor:
    mask = torch.ones(3, N, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, : N - 3] = 0
    return mask


@functools.lru_cache(maxsize=None)
def pair(model_type: str):
    """(reference transformers model, our model made from an identical second one)."""
    make = builder(model_type)
    return make(), interp.from_hf(make())


def out_projection(attn: torch.nn.Module) -> torch.nn.Module:
    """The output projection of a transformers attention module (its input is [batch, pos, head * d_head])."""
    for name, mod in attn.named_modules():
        if name.rsplit(".", 1)[-1] in ("o_proj", "dense", "out_proj", "c_proj", "o"):
            return mod
    raise AssertionError(f"no output projection in {type(attn).__name__}")


def attention_modules(hf) -> list[torch.nn.Module]:
    from interp.models.wrapped import _ATTN_NAMES, _child, _decoder_layers

    return [_child(layer, _ATTN_NAMES)[1] for layer in _decoder_layers(hf)[1]]


def eager_patterns(hf, toks, mask=None):
    saved = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        kwargs = {} if mask is None else dict(attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        with torch.no_grad():
            return hf(toks, output_attentions=True, **kwargs).attentions
    finally:
        hf.set_attn_implementation(saved)


def test_every_architecture_is_covered_or_refused():
    """At least 40 of the 41 run; the rest are refused in one line before any weight is read."""
    from interp.models.wrapped import check_wrappable
    from interp.models.families import FAMILIES

    missing = [t for t in ARCHITECTURES if t not in COVERED]
    assert len(COVERED) >= 40, f"not covered: {missing}"
    for t in missing:
        assert t not in FAMILIES
        with pytest.raises(interp.errors.UserError, match=t):
            check_wrappable(t)


@pytest.mark.parametrize("model_type", COVERED)
def test_logits_match_transformers(model_type):
    hf, model = pair(model_type)
    toks, mask = tokens(), left_mask()
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(toks).logits
        ref_padded = hf(toks, attention_mask=mask, position_ids=position_ids).logits
        for backend in ("fused", "instrumented"):
            with model.attention(backend):
                assert float((model(toks) - ref).abs().max()) < 1e-4, backend
                out = model(toks, attention_mask=mask)
                assert float(((out - ref_padded).abs() * mask[..., None]).max()) < 1e-4, backend
    assert float(ref.abs().max()) > 1e-2


@pytest.mark.parametrize("model_type", COVERED)
def test_patterns_match_eager_attentions(model_type):
    hf, model = pair(model_type)
    toks, mask = tokens(), left_mask()
    ref = eager_patterns(hf, toks, mask)
    _, cache = model.run_with_cache(toks, attention_mask=mask, names_filter=lambda n: n.endswith("hook_pattern"))
    real = mask.bool()[:, None, :, None]
    for layer in range(model.cfg.n_layers):
        assert float(((cache["pattern", layer] - ref[layer]).abs() * real).max()) < 1e-5, layer


@pytest.mark.parametrize("model_type", COVERED)
def test_head_ablation_through_hook_z(model_type):
    hf, model = pair(model_type)
    toks = tokens()
    layer, head = model.cfg.n_layers - 1, 1
    d_head = model.cfg.d_head

    def zero_slice(module, args):
        x = args[0].clone()
        x[..., head * d_head:(head + 1) * d_head] = 0
        return (x, *args[1:])

    handle = out_projection(attention_modules(hf)[layer]).register_forward_pre_hook(zero_slice)
    try:
        with torch.no_grad():
            ref = hf(toks).logits
    finally:
        handle.remove()

    def zero_head(z, hook):
        z[:, :, head] = 0
        return z

    with torch.no_grad():
        out = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)])
        assert float((out - ref).abs().max()) < 1e-4
        assert float((out - model(toks)).abs().max()) > 1e-4  # the ablation did something


def stats_from_patterns(pattern: torch.Tensor, toks: torch.Tensor) -> dict[str, torch.Tensor]:
    """sink (key 0), previous, duplicate, induction, entropy, max, distance of a [batch, head, n, n] pattern."""
    p = pattern.double()
    n = p.shape[-1]
    delta = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).double()
    return {
        "sink": p[..., 0],
        "previous": (p * previous_detection_pattern(n)).sum(-1),
        "duplicate": (p * duplicate_detection_pattern(toks)[:, None]).sum(-1),
        "induction": (p * induction_detection_pattern(toks)[:, None]).sum(-1),
        "entropy": -torch.special.xlogy(p, p).sum(-1),
        "max": p.amax(-1),
        "distance": (p * delta).sum(-1),
    }


@pytest.mark.parametrize("model_type", COVERED)
def test_streaming_statistics_match_patterns(model_type):
    hf, model = pair(model_type)
    g = torch.Generator().manual_seed(3)
    half = torch.randint(3, 97, (2, N // 2), generator=g)
    toks = torch.cat([half, half], dim=1)  # repeated: duplicate and induction are not all zero
    ref = eager_patterns(hf, toks)
    stats = model.attention_stats(toks)
    for layer in range(model.cfg.n_layers):
        want = stats_from_patterns(ref[layer], toks)
        for name, value in want.items():
            got = getattr(stats[layer], name).double()
            assert float((got - value).abs().max()) < 1e-4, (layer, name)


@pytest.mark.parametrize("model_type", COVERED)
def test_greedy_generate_matches_transformers(model_type):
    hf, model = pair(model_type)
    toks = tokens(batch=1)
    with torch.no_grad():
        ref = hf.generate(toks, attention_mask=torch.ones_like(toks), max_new_tokens=6, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    out = model.generate(toks, max_new_tokens=6, stop_at_eos=False)
    assert out.shape == ref.shape and torch.equal(out.cpu(), ref)
