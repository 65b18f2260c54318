"""Sparse autoencoders read from their formats (`interp.models.saes`: sae.py, files.py, formats.py), against the
code that wrote them.

Oracles we did not write: SAELens 6's own classes and EleutherAI sparsify's own code, run once in a side
environment by tests/data/saes/make_references.py, which saved tiny SAEs of every architecture with their save
methods and recorded what their encode, decode and forward give on a fixed input (reference.safetensors). Here
interp reads the same folders and must give the same numbers. Then what SAELens promises of the error term,
the hook_z shapes, the hook points, the Hub cache read offline, and bad input refused in one line with nothing
written or deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hub_cache import hub_repo, run_offline
from safetensors.torch import load_file, save_file

import interp
from interp.errors import BadValue, CheckpointError, UserError
from interp.models.saes import SAE, SAEConfig, as_sae, load_sae
from interp.models.saes.files import gemma_scope_hook, sparsify_hook

DATA = Path(__file__).resolve().parents[2] / "data" / "saes"
SAE_LENS = ["standard", "standard_layer_norm", "topk", "topk_rescaled", "jumprelu_hook_z", "gated", "legacy_topk"]
GEMMA = ["gemma-scope-tiny-pt-res/layer_1/width_48/average_l0_9",
         "gemma-scope-2-tiny-pt/attn_out/layer_1_width_48_l0_small"]
SPARSIFY = ["sparsify/layers.1", "sparsify/layers.1.mlp"]
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 round-off


def edit(acts, hook):
    """The edit make_references.py made of hook_sae_acts_post."""
    acts = acts.clone()
    acts[..., :3] = 0.0
    acts[..., 7] += 2.0
    return acts


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(DATA / name / "reference.safetensors")


# ---- the same numbers as SAELens's and sparsify's own code ----------------------------------------------------
@pytest.mark.parametrize("name", SAE_LENS + GEMMA)
def test_every_sae_lens_reference(name):
    sae, ref = load_sae(DATA / name), reference(name)
    x = ref["x"]
    with torch.no_grad():
        acts = sae.encode(x)
        torch.testing.assert_close(acts, ref["encode"], **TOL)
        torch.testing.assert_close(sae.decode(acts), ref["decode"], **TOL)
        torch.testing.assert_close(sae(x), ref["forward"], **TOL)
        sae.use_error_term = True
        torch.testing.assert_close(sae(x), ref["forward_error"], **TOL)
        torch.testing.assert_close(sae.run_with_hooks(x, fwd_hooks=[("hook_sae_acts_post", edit)]), ref["forward_edit"], **TOL)
    assert (acts > 0).any() and (acts == 0).any()  # features on and off: the activation is exercised


def test_what_each_folder_says():
    cfgs = {name: load_sae(DATA / name).cfg for name in SAE_LENS + GEMMA + SPARSIFY}
    assert {n: c.architecture for n, c in cfgs.items()} == {
        "standard": "standard", "standard_layer_norm": "standard", "topk": "topk", "topk_rescaled": "topk",
        "jumprelu_hook_z": "jumprelu", "gated": "gated", "legacy_topk": "topk", GEMMA[0]: "jumprelu",
        GEMMA[1]: "jumprelu", SPARSIFY[0]: "topk", SPARSIFY[1]: "topk"}
    assert cfgs["topk"].k == cfgs["legacy_topk"].k == 5 and not cfgs["legacy_topk"].apply_b_dec_to_input
    assert cfgs["standard_layer_norm"].normalize_activations == "layer_norm"
    assert cfgs["topk_rescaled"].rescale_acts_by_decoder_norm and cfgs["topk_rescaled"].normalize_activations == "constant_norm_rescale"
    assert cfgs["jumprelu_hook_z"].reshape_activations == "hook_z" and cfgs["jumprelu_hook_z"].hook_z
    hooks = {n: c.hook_name for n, c in cfgs.items()}
    assert hooks["standard"] == hooks["legacy_topk"] == hooks[GEMMA[0]] == hooks[SPARSIFY[0]] == "blocks.1.hook_resid_post"
    assert hooks["jumprelu_hook_z"] == hooks[GEMMA[1]] == "blocks.1.attn.hook_z"
    assert hooks[SPARSIFY[1]] == "blocks.1.hook_mlp_out"
    assert cfgs["standard"].model_name == "tiny" and cfgs["standard"].metadata["context_size"] == 8
    assert not cfgs[GEMMA[0]].apply_b_dec_to_input and cfgs[SPARSIFY[0]].apply_b_dec_to_input
    assert cfgs[SPARSIFY[1]].topk_activation == "groupmax" and cfgs[SPARSIFY[1]].k == 6
    assert cfgs["standard"].source == str(DATA / "standard")


@pytest.mark.parametrize("name", SPARSIFY)
def test_every_sparsify_reference(name):
    sae, ref = load_sae(DATA / name), reference(name)
    with torch.no_grad():
        acts = sae.encode(ref["x"])
        torch.testing.assert_close(acts, ref["encode"], **TOL)
        torch.testing.assert_close(sae.decode(acts), ref["decode"], **TOL)
        torch.testing.assert_close(sae(ref["x"]), ref["forward"], **TOL)
    assert ((acts > 0).sum(-1) <= sae.cfg.k).all() and (acts > 0).sum() > sae.cfg.k


def test_sparsify_hookpoints_are_interp_hook_names():
    assert sparsify_hook("layers.6") == "blocks.6.hook_resid_post"
    assert sparsify_hook("layers.6.mlp") == "blocks.6.hook_mlp_out"
    assert sparsify_hook("layers.6.self_attn") == sparsify_hook("gpt_neox.layers.6.attention") == "blocks.6.hook_attn_out"
    assert sparsify_hook("h.3") == "blocks.3.hook_resid_post" and sparsify_hook("embed_tokens") == "hook_embed"
    assert sparsify_hook("layers.6.mlp.act_fn") is None


def test_gemma_scope_paths_name_the_hook_as_sae_lens_does():
    assert gemma_scope_hook("google/gemma-scope-2b-pt-res/layer_20/width_16k/average_l0_71") == (
        "blocks.20.hook_resid_post", "gemma-2-2b")
    assert gemma_scope_hook("google/gemma-scope-9b-it-mlp/layer_3/width_16k/average_l0_9") == (
        "blocks.3.hook_mlp_out", "gemma-2-9b-it")
    cached = "/h/hub/models--google--gemma-scope-2b-pt-att/snapshots/abc/layer_7/width_16k/average_l0_70"
    assert gemma_scope_hook(cached) == ("blocks.7.attn.hook_z", "gemma-2-2b")
    assert gemma_scope_hook("google/gemma-scope-2b-pt-res/embedding/width_4k/average_l0_6")[0] == "hook_embed"
    assert gemma_scope_hook("/somewhere/layer_7/params.npz") == (None, None)  # no repo: hook_name= says it


def test_a_hook_name_given_wins(tmp_path):
    folder = tmp_path / "layers.6.mlp.act_fn"  # a sparsify module interp cannot name
    shutil.copytree(DATA / SPARSIFY[0], folder)
    with pytest.raises(CheckpointError, match="pass hook_name="):
        load_sae(folder)
    assert load_sae(folder, hook_name="blocks.6.mlp.hook_post").cfg.hook_name == "blocks.6.mlp.hook_post"
    assert load_sae(DATA / "standard", hook_name="blocks.0.hook_resid_pre").cfg.hook_name == "blocks.0.hook_resid_pre"


# ---- SAELens's promises -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["standard", "topk", "jumprelu_hook_z", "gated", GEMMA[0]])
def test_the_error_term_gives_the_input_back_and_an_edit_moves_it_by_the_decoder(name):
    sae, ref = load_sae(DATA / name, dtype="float64"), reference(name)
    x = ref["x"].double()
    sae.use_error_term = True
    with torch.no_grad():
        clean = sae(x)
        edited = sae.run_with_hooks(x, fwd_hooks=[("hook_sae_acts_post", edit)])
        acts = sae.encode(x)
    torch.testing.assert_close(clean, x, rtol=0, atol=1e-12)
    delta = edit(acts, None) - acts
    torch.testing.assert_close(delta, ref["edit_delta"].double(), **TOL)
    image = (delta @ sae.W_dec).reshape(x.shape)
    torch.testing.assert_close(edited - clean, image, rtol=0, atol=1e-12)
    assert image.abs().max() > 0.1


def test_a_normalising_sae_decodes_with_its_inputs_statistics():
    sae, ref = load_sae(DATA / "standard_layer_norm"), reference("standard_layer_norm")
    with pytest.raises(BadValue, match="call encode"):
        sae.decode(ref["encode"])  # nothing encoded yet: which statistics would it use?
    sae.use_error_term = True
    with torch.no_grad():
        torch.testing.assert_close(sae(ref["x"]), ref["x"], **TOL)


def test_hook_z_shapes():
    sae, ref = load_sae(DATA / "jumprelu_hook_z"), reference("jumprelu_hook_z")
    x = ref["x"]  # [2, 3, n_heads=4, d_head=4]
    seen = {}
    with torch.no_grad():
        out, cache = sae.run_with_cache(x)
        flat = sae(x.flatten(-2))  # the heads already flattened: read as it is, given back flat
    assert out.shape == x.shape and cache["hook_sae_input"].shape == (2, 3, 16)
    assert cache["hook_sae_acts_post"].shape == (2, 3, 48) and cache["hook_sae_recons"].shape == (2, 3, 16)
    assert cache["hook_sae_output"].shape == x.shape and sae.d_head == 4
    torch.testing.assert_close(flat, out.flatten(-2), rtol=0, atol=0)
    torch.testing.assert_close(cache["hook_sae_input"], x.flatten(-2), rtol=0, atol=0)  # head-major, as SAELens
    assert sae.decode(sae.encode(x)).shape == x.shape
    with pytest.raises(BadValue, match=r"n_heads \* d_head = 16.*got shape \(2, 3, 5, 4\)"):
        sae(torch.zeros(2, 3, 5, 4))
    with pytest.raises(BadValue, match=r"\[\.\.\., 16\].*got shape \(2, 3, 15\)"):
        load_sae(DATA / "standard")(torch.zeros(2, 3, 15))
    del seen


@pytest.mark.parametrize("error_term", [False, True])
def test_each_hook_point_fires_once(error_term):
    sae, ref = load_sae(DATA / "gated"), reference("gated")
    sae.use_error_term = error_term
    calls = {name: 0 for name in sae.hook_dict}

    def count(x, hook):
        calls[hook.name] += 1

    with torch.no_grad():
        sae.run_with_hooks(ref["x"], fwd_hooks=[(lambda name: True, count)])
        _, cache = sae.run_with_cache(ref["x"])
    want = {name: 1 for name in calls} | {"hook_sae_error": int(error_term)}
    assert calls == want
    order = ["hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons"]
    assert list(cache.keys()) == order + ["hook_sae_error"] * error_term + ["hook_sae_output"]
    assert all(hp._fwd == [] for hp in sae.hook_dict.values())  # every hook removed after the call


def test_a_backward_hook_on_the_error_gets_its_gradient():
    sae, ref = load_sae(DATA / "standard"), reference("standard")
    sae.use_error_term = True
    grads = {}
    with sae.hooks(bwd_hooks=[("hook_sae_error", lambda g, hook: grads.setdefault("error", g.clone()))]):
        (sae(ref["x"]) * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(grads["error"], torch.arange(16.0).expand(2, 3, 16))


# ---- names: the Hub cache offline, the zoo, SAELens objects ----------------------------------------------------
def test_hub_names_resolve_offline(tmp_path):
    cache = tmp_path / "hub"
    snap = hub_repo(cache, "google/gemma-scope-tiny-pt-res", "c" * 40)
    shutil.copytree(DATA / "gemma-scope-tiny-pt-res/layer_1", snap / "layer_1")
    snap = hub_repo(cache, "interp-tests/saes", "d" * 40, refs=("main", "v1"))
    shutil.copytree(DATA / "standard", snap / "standard")
    (snap / "standard" / "sparsity.safetensors").write_bytes(b"never read")
    outside = tmp_path / "elsewhere"
    shutil.copytree(DATA / "gated", outside)
    os.symlink(outside, snap / "linked", target_is_directory=True)
    out = run_offline(cache, f"""
        import json, torch
        from safetensors.torch import load_file
        import interp
        from interp.errors import UserError
        res = {{}}
        for name, folder in (("google/gemma-scope-tiny-pt-res/layer_1/width_48/average_l0_9",
                              "gemma-scope-tiny-pt-res/layer_1/width_48/average_l0_9"),
                             ("interp-tests/saes/standard", "standard")):
            sae = interp.load_sae(name)
            ref = load_file("{DATA}/" + folder + "/reference.safetensors")
            with torch.no_grad():
                res[name] = [sae.cfg.hook_name, float((sae(ref["x"]) - ref["forward"]).abs().max()), sae.cfg.source]
        res["v1"] = interp.load_sae("interp-tests/saes/standard", revision="v1").cfg.d_sae
        for bad in ("interp-tests/saes/linked", "interp-tests/saes/nothing", "interp-tests/uncached/standard"):
            try:
                interp.load_sae(bad)
                res[bad] = "loaded"
            except UserError as e:
                res[bad] = str(e)
        print(json.dumps(res))
    """)
    gemma = out["google/gemma-scope-tiny-pt-res/layer_1/width_48/average_l0_9"]
    assert gemma[0] == "blocks.1.hook_resid_post" and gemma[1] < 1e-6 and "snapshots" in gemma[2]
    assert out["interp-tests/saes/standard"][:2] == ["blocks.1.hook_resid_post", 0.0] and out["v1"] == 48
    assert "not a file inside" in out["interp-tests/saes/linked"] and "links out of it" in out["interp-tests/saes/linked"]
    assert "no folder 'nothing'" in out["interp-tests/saes/nothing"]
    uncached = out["interp-tests/uncached/standard"]
    assert "HF_HUB_OFFLINE" in uncached and "hf download interp-tests/uncached --include 'standard/*'" in uncached
    assert all("\n" not in v for v in out.values() if isinstance(v, str))


def test_the_zoo_sae_reads_attn_only_2l_heads():
    """The zoo's SAE (trained by SAELens's runner: models/src/zoo/saes/attn-only-2l/blocks.1.attn.hook_z/train.py)
    found by its name, on the model's own hook_z over held-out text interp ships."""
    from interp.analyses import evaldata
    from interp.models.saes import zoo_saes
    from interp.models.saes.formats import ZOO_SAES

    name = "attn-only-2l/blocks.1.attn.hook_z"
    assert name in zoo_saes()
    sae = load_sae(name)
    c = sae.cfg
    assert (c.architecture, c.hook_name, c.d_in, c.d_sae, c.k, c.model_name) == ("topk", name.split("/")[1], 128, 512, 16,
                                                                                  "attn-only-2l")
    model = interp.load("attn-only-2l")
    text = evaldata.language_reference().encode()[-8 * 127:]  # the rows train.py held out
    toks = torch.cat([torch.full((8, 1), 256), torch.tensor(list(text)).reshape(8, 127)], dim=1)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=c.hook_name)
        z = cache[c.hook_name]
        acts, recon = sae.encode(z), sae(z)
    assert z.shape == recon.shape == (8, 128, 4, 32) and ((acts > 0).sum(-1) == 16).all()
    explained = 1 - ((z - recon) ** 2).sum() / ((z - z.mean((0, 1))) ** 2).sum()
    recorded = json.loads((ZOO_SAES / name / "eval.json").read_text())["metrics"]["reconstruction_quality"]
    assert explained > 0.7 and recorded["explained_variance"] > 0.7
    with pytest.raises(CheckpointError, match="links out of it"):
        load_sae("attn-only-2l/../attn-only-2l/blocks.1.attn.hook_z")


def test_as_sae_takes_ours_and_a_sae_lens_object():
    ours = load_sae(DATA / "topk")
    assert as_sae(ours) is ours

    class Metadata:  # SAELens 6's SAEMetadata: attributes, to_dict
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def to_dict(self):
            return dict(self.__dict__)

    class Config:  # SAELens 6's TopKSAEConfig: architecture() a classmethod, to_dict() with the metadata
        d_in, d_sae, k, dtype, apply_b_dec_to_input = 16, 48, 5, "float32", False
        normalize_activations, reshape_activations, rescale_acts_by_decoder_norm = "none", "none", False
        metadata = Metadata(hook_name="blocks.1.hook_resid_post", model_name="tiny")

        @classmethod
        def architecture(cls):
            return "topk"

        def to_dict(self):
            return {"d_in": 16, "d_sae": 48, "k": 5, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": False,
                    "normalize_activations": "none", "reshape_activations": "none",
                    "rescale_acts_by_decoder_norm": False, "metadata": self.metadata}

    class TheirSAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg, self.use_error_term = Config(), True
            for name, t in load_file(DATA / "topk" / "sae_weights.safetensors").items():
                setattr(self, name, torch.nn.Parameter(t))

    theirs = as_sae(TheirSAE())
    ref = reference("topk")
    assert isinstance(theirs, SAE) and theirs.use_error_term and theirs.cfg.k == 5
    assert theirs.cfg.hook_name == "blocks.1.hook_resid_post" and theirs.cfg.architecture == "topk"
    with torch.no_grad():
        torch.testing.assert_close(theirs(ref["x"]), ref["forward_error"], **TOL)
    with pytest.raises(BadValue, match="as_sae takes"):
        as_sae(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["topk_rescaled", "gated", "jumprelu_hook_z", "standard_layer_norm"])
def test_save_model_writes_what_it_read(tmp_path, name):
    """SAELens's files back (SAELens 6 itself reads them: checked once in the side environment), the same SAE."""
    sae, ref = load_sae(DATA / name), reference(name)
    sae.save_model(tmp_path / "again")
    again = load_sae(tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["cfg.json", "sae_weights.safetensors"]
    saved = json.loads((tmp_path / "again" / "cfg.json").read_text())
    assert saved["metadata"]["hook_name"] == sae.cfg.hook_name and saved["architecture"] == sae.cfg.architecture
    for field in ("architecture", "d_in", "d_sae", "k", "hook_name", "apply_b_dec_to_input", "normalize_activations",
                  "reshape_activations", "rescale_acts_by_decoder_norm", "dtype", "model_name"):
        assert getattr(again.cfg, field) == getattr(sae.cfg, field), field
    with torch.no_grad():
        torch.testing.assert_close(again(ref["x"]), ref["forward"], **TOL)
    with pytest.raises(BadValue, match="no groupmax SAE"):
        load_sae(DATA / SPARSIFY[1]).save_model(tmp_path / "groupmax")


def test_the_config_reads_as_sae_lens_6s():
    sae = load_sae(DATA / "jumprelu_hook_z")
    meta = sae.cfg.metadata
    assert meta.hook_name == meta["hook_name"] == "blocks.1.attn.hook_z" and meta.model_name == "tiny"
    assert meta.context_size == 8 and meta.prepend_bos is True and meta.neuronpedia_id is None
    sae.cfg.hook_name = "blocks.0.attn.hook_z"
    assert sae.cfg.metadata.hook_name == "blocks.0.attn.hook_z"
    sae.double()
    assert sae.cfg.dtype == "float64" and sae.W_enc.dtype == torch.float64


def test_dtype_and_device():
    sae = interp.load_sae(DATA / "gated", dtype="float64")
    assert sae.W_enc.dtype == torch.float64 and sae.cfg.dtype == "float64" and sae.r_mag.dtype == torch.float64
    assert load_sae(DATA / "gated").W_enc.dtype == torch.float32
    with pytest.raises(BadValue, match="not available"):
        load_sae(DATA / "gated", device="cuda:7")
    with pytest.raises(BadValue, match="dtype must be one of"):
        load_sae(DATA / "gated", dtype="int8")


def test_a_config_no_sae_can_have_is_refused():
    with pytest.raises(BadValue, match="top-k SAE needs k"):
        SAEConfig(architecture="topk", d_in=4, d_sae=8)
    with pytest.raises(BadValue, match="unknown SAE architecture 'batchtopk'"):
        SAEConfig(architecture="batchtopk", d_in=4, d_sae=8)
    with pytest.raises(BadValue, match="normalize_activations must be one of"):
        SAEConfig(architecture="standard", d_in=4, d_sae=8, normalize_activations="whatever")
    assert SAE(SAEConfig(architecture="gated", d_in=4, d_sae=8)).b_enc is None  # SAELens's GatedSAE has none


# ---- bad input: one line, before any weight is read, and nothing written or deleted ---------------------------
def _copy(tmp_path, name, to="sae"):
    return Path(shutil.copytree(DATA / name, tmp_path / to))


def _edit_cfg(folder, **changes):
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.update(changes)
    (folder / "cfg.json").write_text(json.dumps(cfg))


def _nan(folder):
    sd = load_file(folder / "sae_weights.safetensors")
    sd["W_dec"][3, 2] = float("nan")
    save_file(sd, folder / "sae_weights.safetensors")


def _npz_with_objects(folder):
    np.savez(folder / "params.npz", W_enc=np.zeros((16, 48), np.float32), extra=np.array([{"a": 1}], dtype=object))


HOSTILE = {
    "no weights": ("standard", lambda f: (f / "sae_weights.safetensors").unlink(),
                   "has cfg.json but neither sae_weights.safetensors"),
    "no cfg.json": ("standard", lambda f: (f / "cfg.json").unlink(), "has sae_weights.safetensors but no cfg.json"),
    "unknown architecture": ("standard", lambda f: _edit_cfg(f, architecture="matryoshka_batchtopk"),
                             "unknown SAE architecture 'matryoshka_batchtopk'"),
    "shapes disagree": ("standard", lambda f: _edit_cfg(f, d_sae=64),
                        r"W_enc is \[16, 48\] in the file, but the config says d_in=16, d_sae=64"),
    "missing tensor": ("jumprelu_hook_z", lambda f: _edit_cfg(f, architecture="gated"),
                       "missing b_gate, b_mag, r_mag; unexpected b_enc, threshold"),
    "NaN": ("standard", _nan, r"non-finite weights \(NaN or inf\) in W_dec \(1 of 768\)"),
    "no format": ("standard", lambda f: [p.unlink() for p in list(f.iterdir())] and (f / "sae.pt").write_bytes(b"x"),
                  r"holds no SAE interp reads: it looked for SAELens.*sae.pt is a pickle, never read"),
    "pickled npz": (GEMMA[0], _npz_with_objects, "holds Python objects"),
    "transcoder": (SPARSIFY[0], lambda f: _edit_cfg(f, transcode=True), "is a transcoder"),
    "no k": ("topk", lambda f: _edit_cfg(f, k=None), "a top-k SAE needs k"),
    "not json": ("standard", lambda f: (f / "cfg.json").write_text("{not json"), "could not read .*cfg.json"),
}


def _state(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, case):
    name, damage, message = HOSTILE[case]
    folder = _copy(tmp_path, name)
    damage(folder)
    before = _state(tmp_path)
    with pytest.raises(UserError, match=message) as err:
        load_sae(folder)
    assert "\n" not in str(err.value)
    assert _state(tmp_path) == before


def test_names_that_give_nothing_say_so(tmp_path):
    with pytest.raises(UserError, match="no SAE at 'nowhere'"):
        load_sae("nowhere")
    with pytest.raises(BadValue, match="for an SAE object use"):
        load_sae(load_sae(DATA / "standard"))
    with pytest.raises(BadValue, match="revision='v1' applies to Hugging Face repos"):
        load_sae(DATA / "standard", revision="v1")
    assert load_sae(DATA / "standard" / "cfg.json").cfg.d_sae == 48  # a file names its folder
