"""What the features tests share: the zoo's attn-only-2l (2 layers of 4 heads of 32), random SAEs built in memory
with interp's `SAE`, and SAE folders written here as SAELens writes them (cfg.json + sae_weights.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import interp
from interp.models.saes import SAE, SAEConfig

HOOK_Z = "blocks.1.attn.hook_z"


def random_weights(arch: str, d_in: int, d_sae: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """SAELens's tensors of a random SAE whose features fire on part of attn-only-2l's activations."""
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5,
         "W_dec": torch.randn(d_sae, d_in, generator=g) / d_in ** 0.5,
         "b_dec": torch.randn(d_in, generator=g) * 0.05}
    bias = torch.randn(d_sae, generator=g) * 0.1
    if arch == "gated":
        w.update(b_gate=bias, r_mag=torch.randn(d_sae, generator=g) * 0.1, b_mag=torch.randn(d_sae, generator=g) * 0.1)
    else:
        w["b_enc"] = bias
    if arch == "jumprelu":
        w["threshold"] = torch.rand(d_sae, generator=g) * 0.1
    return w


def random_sae(hook: str = HOOK_Z, d_in: int = 128, d_sae: int = 48, arch: str = "standard", seed: int = 0,
               **cfg) -> SAE:
    """An `SAE` built in memory with `random_weights`."""
    k = cfg.pop("k", 6 if arch == "topk" else None)
    sae = SAE(SAEConfig(architecture=arch, d_in=d_in, d_sae=d_sae, hook_name=hook, k=k, **cfg))
    with torch.no_grad():
        for name, value in random_weights(arch, d_in, d_sae, seed).items():
            getattr(sae, name).copy_(value)
    return sae


def write_sae_lens(folder: Path, hook: str = HOOK_Z, d_in: int = 128, d_sae: int = 48, arch: str = "standard",
                   seed: int = 0, **cfg) -> Path:
    """An SAE folder as SAELens 6 saves one (`SAE.save_model`): cfg.json and sae_weights.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in random_weights(arch, d_in, d_sae, seed).items()},
              str(folder / "sae_weights.safetensors"))
    config = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
              "apply_b_dec_to_input": True, "normalize_activations": "none",
              "reshape_activations": "hook_z" if hook.endswith("hook_z") else "none",
              "metadata": {"hook_name": hook, "model_name": "attn-only-2l", "sae_lens_version": "6.0.0"}, **cfg}
    if arch == "topk":
        config.setdefault("k", 6)
    (folder / "cfg.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model():
    return interp.load("attn-only-2l")


@pytest.fixture(scope="module")
def corpus():
    """8 rows of 48 tokens of the zoo's byte vocabulary (the model's own text matters not to the algebra)."""
    return torch.randint(0, 257, (8, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def make_sae():
    """`random_sae`, for a test (conftest's functions are not importable under importlib mode)."""
    return random_sae


@pytest.fixture
def sae_folder(tmp_path):
    """`write_sae_lens` into the test's tmp_path: sae_folder(name, hook=..., ...) -> the folder."""
    return lambda name="sae", **kw: write_sae_lens(tmp_path / name, **kw)
