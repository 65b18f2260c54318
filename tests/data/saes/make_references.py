"""Makes tests/data/saes/: tiny SAEs written by SAELens's and EleutherAI sparsify's own code, and what their own
code computes from them on a fixed input (`reference.safetensors` beside each), for
tests/models/saes/test_sae_formats.py to hold interp's SAE to.

Run it in a side virtual environment, never in interp's (sae-lens pins transformer-lens<4):

    python3.11 -m venv /work/saevenv
    /work/saevenv/bin/pip install -c constraints.txt torch==2.13.0     # the CPU wheel first
    /work/saevenv/bin/pip install sae-lens==6.54.12 eai-sparsify==1.3.3
    /work/saevenv/bin/python tests/data/saes/make_references.py

Each SAE has random weights from a fixed seed, d_in 16 and d_sae 48. What each folder holds:

    standard/              SAELens StandardSAE, save_model (cfg.json + sae_weights.safetensors)
    standard_layer_norm/   normalize_activations="layer_norm"
    topk/                  TopKSAE, k=5, apply_b_dec_to_input=False
    topk_rescaled/         TopKSAE, k=5, rescale_acts_by_decoder_norm, normalize_activations="constant_norm_rescale"
    jumprelu_hook_z/       JumpReLUSAE at blocks.1.attn.hook_z (4 heads of d_head 4), reshape_activations="hook_z"
    gated/                 GatedSAE
    legacy_topk/           topk/'s weights under a pre-6 flat cfg.json (hook_point, activation_fn_str "topk",
                           activation_fn_kwargs {"k": 5}), as SAELens 6 still reads it (its handle_pre_6_0_config)
    gemma-scope-tiny-pt-res/layer_1/width_48/average_l0_9/params.npz
                           Gemma Scope's layout (W_enc, W_dec, b_enc, b_dec, threshold); its reference from SAELens's
                           JumpReLUSAE with the config SAELens's gemma_2 loader gives (apply_b_dec_to_input False)
    gemma-scope-2-tiny-pt/attn_out/layer_1_width_48_l0_small/params.safetensors (+ config.json)
                           Gemma Scope 2's layout (w_enc, w_dec, b_enc, b_dec, threshold; SAELens's gemma_3 loader)
    sparsify/layers.1/, sparsify/layers.1.mlp/
                           sparsify's SparseCoder.save_to_disk (cfg.json + sae.safetensors), topk and groupmax

reference.safetensors: x (the input), encode, decode (of encode), forward, forward_error (use_error_term),
forward_edit (use_error_term, with hook_sae_acts_post edited: features 0-2 zeroed, 2.0 added to feature 7),
edit_delta (the edit, [..., d_sae]). For sparsify: x, encode (dense), decode, forward (SparseCoder's own).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
D_IN, D_SAE, K = 16, 48, 5

warnings.filterwarnings("ignore", category=DeprecationWarning)  # SAELens warns when use_error_term is set directly


def randomise(sae, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            scale = {"threshold": 0.4, "r_mag": 0.3}.get(name, 0.5)
            value = torch.randn(p.shape, generator=g) * scale
            p.copy_(value.abs() if name == "threshold" else value)


def edit(acts, hook):
    acts = acts.clone()
    acts[..., :3] = 0.0
    acts[..., 7] += 2.0
    return acts


def references(sae, x) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        acts = sae.encode(x)
        out = {"x": x, "encode": acts, "decode": sae.decode(acts)}
        sae.use_error_term = False
        out["forward"] = sae(x)
        sae.use_error_term = True
        out["forward_error"] = sae(x)
        sae.add_hook("hook_sae_acts_post", edit)
        out["forward_edit"] = sae(x)
        sae.reset_hooks()
        sae.use_error_term = False
        out["edit_delta"] = edit(acts, None) - acts
    return {k: v.detach().contiguous() for k, v in out.items()}


def sae_lens_cases():
    from sae_lens import GatedSAE, JumpReLUSAE, StandardSAE, TopKSAE
    from sae_lens.saes.gated_sae import GatedSAEConfig
    from sae_lens.saes.jumprelu_sae import JumpReLUSAEConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.standard_sae import StandardSAEConfig
    from sae_lens.saes.topk_sae import TopKSAEConfig

    def meta(hook):
        return SAEMetadata(model_name="tiny", hook_name=hook, context_size=8, prepend_bos=True)

    resid = "blocks.1.hook_resid_post"
    return {
        "standard": StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta(resid))),
        "standard_layer_norm": StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, normalize_activations="layer_norm",
                                                             metadata=meta(resid))),
        "topk": TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=K, apply_b_dec_to_input=False, metadata=meta(resid))),
        "topk_rescaled": TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=K, rescale_acts_by_decoder_norm=True,
                                               normalize_activations="constant_norm_rescale", metadata=meta(resid))),
        "jumprelu_hook_z": JumpReLUSAE(JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE, reshape_activations="hook_z",
                                                         metadata=meta("blocks.1.attn.hook_z"))),
        "gated": GatedSAE(GatedSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta(resid))),
    }


def inputs(seed: int, hook_z: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn((2, 3, 4, 4) if hook_z else (2, 3, D_IN), generator=g)


def fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def make_sae_lens() -> None:
    from sae_lens import SAE

    for seed, (name, sae) in enumerate(sae_lens_cases().items()):
        randomise(sae, seed)
        folder = fresh(HERE / name)
        sae.save_model(folder)
        loaded = SAE.load_from_disk(folder)  # what a SAELens user gets from the folder
        x = inputs(seed, name.endswith("hook_z"))
        save_file(references(loaded, x), folder / "reference.safetensors")
        if name == "topk":
            make_legacy(folder, loaded, x)


def make_legacy(topk: Path, sae, x) -> None:
    """topk/'s weights under the flat cfg.json SAELens wrote before 6.0 (read by its handle_pre_6_0_config)."""
    from sae_lens import SAE

    folder = fresh(HERE / "legacy_topk")
    shutil.copy(topk / "sae_weights.safetensors", folder / "sae_weights.safetensors")
    cfg = {"model_name": "tiny", "hook_point": "blocks.1.hook_resid_post", "hook_point_layer": 1,
           "hook_point_head_index": None, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": K}, "apply_b_dec_to_input": False,
           "normalize_activations": False, "finetuning_scaling_factor": False, "context_size": 8,
           "prepend_bos": True, "sae_lens_training_version": "3.13.0"}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    loaded = SAE.load_from_disk(folder)
    assert loaded.cfg.architecture() == "topk" and loaded.cfg.k == K and not loaded.cfg.apply_b_dec_to_input
    save_file(references(loaded, x), folder / "reference.safetensors")


def make_gemma_scope() -> None:
    """A params.npz as Gemma Scope ships it, and SAELens's JumpReLUSAE on the config its gemma_2 loader makes."""
    from sae_lens import JumpReLUSAE
    from sae_lens.saes.jumprelu_sae import JumpReLUSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    sae = JumpReLUSAE(JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE, apply_b_dec_to_input=False,
                                        metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post")))
    randomise(sae, 10)
    root = HERE / "gemma-scope-tiny-pt-res"
    if root.exists():
        shutil.rmtree(root)
    folder = fresh(root / "layer_1" / "width_48" / "average_l0_9")
    np.savez(folder / "params.npz", **{k: v.numpy() for k, v in sae.state_dict().items()})
    save_file(references(sae, inputs(10, False)), folder / "reference.safetensors")

    # Gemma Scope 2 (google/gemma-scope-2-*): params.safetensors with lowercase names, a config.json beside it
    # (SAELens's gemma_3 loader); an attention-output SAE reads o_proj's input, blocks.L.attn.hook_z, flat
    sae = JumpReLUSAE(JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE, apply_b_dec_to_input=False,
                                        metadata=SAEMetadata(hook_name="blocks.1.attn.hook_z")))
    randomise(sae, 11)
    root = HERE / "gemma-scope-2-tiny-pt"
    if root.exists():
        shutil.rmtree(root)
    folder = fresh(root / "attn_out" / "layer_1_width_48_l0_small")
    sd = sae.state_dict()
    save_file({"w_enc": sd["W_enc"], "w_dec": sd["W_dec"], "b_enc": sd["b_enc"], "b_dec": sd["b_dec"],
               "threshold": sd["threshold"]}, folder / "params.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "architecture": "jump_relu", "model_name": "gemma-v3-tiny-pt",
        "hf_hook_point_in": "model.layers.1.self_attn.o_proj.input"}))
    save_file(references(sae, inputs(11, False)), folder / "reference.safetensors")


def make_sparsify() -> None:
    from sparsify import SparseCoder, SparseCoderConfig

    root = HERE / "sparsify"
    if root.exists():
        shutil.rmtree(root)
    for seed, (hookpoint, activation) in enumerate((("layers.1", "topk"), ("layers.1.mlp", "groupmax")), start=20):
        torch.manual_seed(seed)
        coder = SparseCoder(D_IN, SparseCoderConfig(activation=activation, num_latents=D_SAE, k=K if activation == "topk" else 6))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in coder.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        folder = root / hookpoint
        coder.save_to_disk(folder)
        coder = SparseCoder.load_from_disk(folder)
        x = inputs(seed, False).reshape(-1, D_IN)  # sparsify reads [tokens, d_in]
        with torch.no_grad():
            top_acts, top_indices, _ = coder.encode(x)
            dense = torch.zeros(x.shape[0], D_SAE).scatter_(-1, top_indices, top_acts)
            ref = {"x": x, "encode": dense, "decode": coder.decode(top_acts, top_indices), "forward": coder(x).sae_out}
        save_file({k: v.contiguous() for k, v in ref.items()}, folder / "reference.safetensors")


if __name__ == "__main__":
    make_sae_lens()
    make_gemma_scope()
    make_sparsify()
    total = sum(f.stat().st_size for f in HERE.rglob("*") if f.is_file())
    print(f"tests/data/saes: {total / 1024:.0f} KB")
    assert total < 500 * 1024
