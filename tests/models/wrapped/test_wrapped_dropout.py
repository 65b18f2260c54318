"""Attention dropout in training mode on a wrapped model (issue 56, D7): the instrumented path and the
explicit path that soft-capping (Gemma 2) takes dropped nothing, so two seeded training-mode forwards of a
tiny Starcoder2 with attention dropout 0.5 differed by 0.224 under transformers' attention and by 0.0 under
ours (Gemma 2: 0.52 against 0.0). Checked by hand against transformers' own attention with the same seed:
eager for the explicit paths, SDPA for the fused one."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_cases import build_hf
from wrapped_cases import build_wrapped_hf

import interp
from interp.models.wrapped import WrappedModel

transformers = pytest.importorskip("transformers")


def _with_dropout(hf, p: float = 0.5):
    for m in hf.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = p
    hf.config.attention_dropout = p
    return hf


def _seeded(model, tokens, seed: int):
    torch.manual_seed(seed)
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _pair(hf):
    """(transformers' own model in eager attention, ours wrapping a copy) in training mode."""
    reference = copy.deepcopy(hf)
    reference.config._attn_implementation = "eager"
    ours = WrappedModel(hf)
    reference.train()
    ours.train()
    return reference, ours


@pytest.mark.parametrize("case", ["starcoder2", "gemma2"])
def test_training_mode_applies_the_modules_dropout_as_eager_does(case):
    hf = _with_dropout(build_wrapped_hf("starcoder2") if case == "starcoder2" else build_hf("gemma2"))
    reference, ours = _pair(hf)
    tokens = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    paths = ["instrumented"] + (["auto"] if case == "gemma2" else [])  # Gemma 2's fused path soft-caps explicitly
    for path in paths:
        with ours.attention(path):
            for seed in (0, 1):
                expected = _seeded(reference, tokens, seed)
                got = _seeded(ours, tokens, seed)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{case} {path} seed {seed}")
            assert float((_seeded(ours, tokens, 0) - _seeded(ours, tokens, 1)).detach().abs().max()) > 0.05  # it drops
    ours.eval()
    with ours.attention("instrumented"):
        assert torch.equal(_seeded(ours, tokens, 0), _seeded(ours, tokens, 1))  # evaluation drops nothing


def test_the_fused_path_drops_as_transformers_sdpa_does():
    hf = _with_dropout(build_wrapped_hf("starcoder2"))
    reference = copy.deepcopy(hf)
    reference.config._attn_implementation = "sdpa"
    ours = WrappedModel(hf)
    reference.train()
    ours.train()
    tokens = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_seeded(ours, tokens, 3), _seeded(reference, tokens, 3), rtol=1e-5, atol=1e-5)
