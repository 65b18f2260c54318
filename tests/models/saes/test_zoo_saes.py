"""The SAEs trained here with SAELens (models/src/zoo/saes/train.py): the small ones shipped in the zoo read on
their model's hook over the held-out text as their eval.json says, and the large ones found by name in the
cache folder ($INTERP_CACHE/saes), with the command that trains one when it is missing."""

from __future__ import annotations

import json
import os

import pytest
import torch

import interp
from interp.errors import CheckpointError
from interp.models.hub import ModelNotFound
from interp.models.saes import SAE, SAEConfig, load_sae
from interp.models.saes.formats import ZOO_SAES, sae_cache, zoo_saes

SHIPPED = {  # name: (d_in, d_sae, k)
    "attn-only-2l/blocks.0.attn.hook_z": (128, 512, 16),
    "attn-only-2l/blocks.1.attn.hook_z": (128, 512, 16),
    "attn-only-2l/blocks.1.hook_resid_pre": (128, 512, 16),
}


def tiny_sae(hook: str, d_in: int = 12, d_sae: int = 24, seed: int = 0) -> SAE:
    """A top-k SAE of random weights (interp's own SAE, no SAELens)."""
    sae = SAE(SAEConfig(architecture="topk", d_in=d_in, d_sae=d_sae, k=3, hook_name=hook, model_name="smollm2-135m"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return sae


def test_trained_saes_resolve_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    assert sae_cache() == tmp_path / "cache" / "saes"
    name = "smollm2-135m/blocks.18.attn.hook_z"
    written = tiny_sae("blocks.18.attn.hook_z")
    written.save_model(sae_cache() / name)
    read = load_sae(name)
    assert read.cfg.source == str(sae_cache() / name) or name in read.cfg.source
    for key, value in written.state_dict().items():
        assert torch.equal(read.state_dict()[key], value), key

    # the zoo comes first: a cache folder of a shipped name is not read
    tiny_sae("blocks.1.attn.hook_z", d_in=128, d_sae=24).save_model(sae_cache() / "attn-only-2l/blocks.1.attn.hook_z")
    assert load_sae("attn-only-2l/blocks.1.attn.hook_z").cfg.d_sae == 512

    # missing: one line with the command that trains it
    with pytest.raises(ModelNotFound) as e:
        load_sae("smollm2-135m/blocks.17.attn.hook_z")
    msg = str(e.value)
    assert "\n" not in msg and str(sae_cache()) in msg
    assert msg.endswith("python models/src/zoo/saes/train.py smollm2-135m blocks.17.attn.hook_z")

    # a cache folder that links out of the cache is refused, as in the zoo
    outside = tmp_path / "elsewhere"
    tiny_sae("blocks.5.hook_resid_pre").save_model(outside)
    os.symlink(outside, sae_cache() / "smollm2-135m" / "blocks.5.hook_resid_pre", target_is_directory=True)
    with pytest.raises(CheckpointError, match="links out of it"):
        load_sae("smollm2-135m/blocks.5.hook_resid_pre")


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_saes_reconstruct_their_hook_on_held_out_text(name):
    """Each zoo SAE on attn-only-2l's hook over the last rows train.py held out: k features per token and the
    explained variance (computed here in plain torch) near what SAELens's evaluator recorded in eval.json."""
    from interp.analyses import evaldata

    assert name in zoo_saes()
    sae, (d_in, d_sae, k) = load_sae(name), SHIPPED[name]
    c = sae.cfg
    assert (c.architecture, c.model_name, c.hook_name, c.d_in, c.d_sae, c.k) == ("topk", "attn-only-2l",
                                                                                 name.split("/")[1], d_in, d_sae, k)
    model = interp.load("attn-only-2l")
    text = evaldata.language_reference().encode()
    n = len(text) // 127
    tail = text[(n - 16) * 127: n * 127]  # the last 16 rows: inside the held-out 10%
    toks = torch.cat([torch.full((16, 1), 256), torch.tensor(list(tail)).reshape(16, 127)], dim=1)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=c.hook_name)
        x = cache[c.hook_name][:, 1:]  # <bos> left out, as the evaluator does
        acts, recon = sae.encode(x), sae(x)
    assert recon.shape == x.shape and ((acts > 0).sum(-1) <= k).all() and ((acts > 0).sum(-1) == k).float().mean() > 0.9
    flat, err = x.reshape(-1, d_in), (x - recon).reshape(-1, d_in)
    explained = 1 - (err ** 2).sum() / ((flat - flat.mean(0)) ** 2).sum()
    record = json.loads((ZOO_SAES / name / "eval.json").read_text())
    recorded = record["metrics"]["reconstruction_quality"]["explained_variance"]
    assert (record["d_sae"], record["k"], record["model"], record["hook"]) == (d_sae, k, "attn-only-2l", c.hook_name)
    assert recorded > 0.7 and abs(float(explained) - recorded) < 0.05, (float(explained), recorded)
    assert record["metrics"]["model_performance_preservation"]["ce_loss_score"] > 0.8
