"""Quantized KV caches against quantization done by hand: the cache's logits equal a forward pass
whose K (after RoPE) and V are quantized and dequantized in hooks, prefill or token by token; a
precision map that keeps everything in full precision changes nothing; bytes are what the codes and
scales take; bad precisions and maps are refused clearly."""

from __future__ import annotations

import pytest
import torch
from analyses_fixtures import build, tokens  # noqa: F401
from smol import needs_smol

import interp
from interp.kernels.kv_quant import bytes_per_vector, dequantize, fake_quantize, quantize


def test_the_scheme_by_hand():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = quantize(x, "int8")
    assert torch.allclose(scale, torch.tensor([1.0 / 127, 1.0]))  # max|x| / 127; a zero vector gets scale 1
    assert codes[0].tolist() == [64, -127, 32, 0]  # round(0.5 * 127) = 64 (63.5 rounds to even 64)
    codes4, scale4 = quantize(x, "int4")
    assert codes4.shape == (2, 2) and codes4.dtype == torch.uint8  # two codes per byte
    s4 = torch.tensor(1.0) / 7  # x / s in float32: 0.5 / (1/7) = 3.4999998, which rounds to 3
    want4 = (x[0] / s4).round().clamp(-7, 7) * s4
    assert torch.allclose(dequantize(codes4, scale4, "int4", torch.float32)[0], want4)
    assert want4.tolist() == pytest.approx([3 / 7, -1.0, 2 / 7, 0.0])
    fp8 = fake_quantize(x, "fp8")[0]
    want = (x[0] / (1.0 / 448)).to(torch.float8_e4m3fn).float() * (1.0 / 448)
    assert torch.equal(fp8, want)
    assert bytes_per_vector("int4", 64) == 32 + 4 and bytes_per_vector("fp16", 64) == 128


def _hand_quantized_logits(model, toks, precision: str, heads=None):
    """A plain forward whose cached K (after RoPE) and V are quantized and dequantized in hooks."""
    def q(x, hook):
        if heads is None:
            return fake_quantize(x, precision)
        layer = int(hook.name.split(".")[1])
        out = x.clone()
        for (l, g) in heads:
            if l == layer:
                out[:, :, g] = fake_quantize(x[:, :, g], precision)
        return out

    names = ("hook_rot_k", "hook_v") if model.cfg.positional == "rotary" else ("hook_k", "hook_v")
    hooks = [(f"blocks.{l}.attn.{n}", q) for l in range(model.cfg.n_layers) for n in names]
    with torch.no_grad():
        return model.run_with_hooks(toks, fwd_hooks=hooks)


@pytest.mark.parametrize("precision", ["int8", "fp8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("name", ["rotary-gqa", "learned"])
def test_quantized_cache_equals_quantizing_by_hand(name, precision):
    model = build(name)
    toks = tokens(2, 20, seed=3)
    want = _hand_quantized_logits(model, toks, precision)
    with torch.no_grad():
        cache = model.new_kv_cache(2, 20, precision=precision)
        prefill = model(toks, kv_cache=cache)
        cache = model.new_kv_cache(2, 20, precision=precision)
        stepwise = torch.cat([model(toks[:, i : i + 1], kv_cache=cache) for i in range(20)], dim=1)
    assert torch.allclose(prefill, want, atol=1e-4), (prefill - want).abs().max()
    assert torch.allclose(stepwise, want, atol=1e-4), (stepwise - want).abs().max()
    with torch.no_grad():
        full = model(toks)
    if precision != "fp16":
        assert not torch.allclose(prefill, full, atol=1e-6)  # it did quantize


def test_precision_map_quantizes_only_the_named_heads():
    model = build("rotary-gqa")  # 2 layers x 2 KV heads
    toks = tokens(1, 16, seed=4)
    heads = [(0, 1), (1, 0)]
    want = _hand_quantized_logits(model, toks, "int4", heads)
    with torch.no_grad():
        got = model(toks, kv_cache=model.new_kv_cache(1, 16, precision={h: "int4" for h in heads}))
    assert torch.allclose(got, want, atol=1e-4)


def test_everything_in_full_precision_changes_nothing():
    model = build("rotary-gqa")
    toks = tokens(2, 16, seed=5)
    with torch.no_grad():
        plain = model(toks, kv_cache=model.new_kv_cache(2, 16))
        mapped = model(toks, kv_cache=model.new_kv_cache(2, 16, precision={(0, 0): "fp32"}, default="fp32"))
        out_plain = model.generate(toks, 5)
        out_mapped = model.generate(toks, 5, kv_precision="fp32")
    assert torch.equal(plain, mapped) and torch.equal(out_plain, out_mapped)


def test_bytes_are_the_codes_and_scales_held():
    model = build("rotary-gqa")
    cfg = model.cfg
    for precision, per_vector in [("fp32", 4 * cfg.head_dim), ("int8", cfg.head_dim + 4), ("int4", cfg.head_dim // 2 + 4)]:
        cache = model.new_kv_cache(3, 10, precision=precision)
        assert cache.allocated_nbytes == 2 * cfg.n_layers * cfg.kv_heads * 3 * 10 * per_vector
        model(tokens(3, 7), kv_cache=cache)
        assert cache.held_nbytes == 2 * cfg.n_layers * cfg.kv_heads * 3 * 7 * per_vector  # the 7 tokens held
        assert cache.bytes_per_token() == 2 * cfg.n_layers * cfg.kv_heads * per_vector
    mixed = model.new_kv_cache(1, 10, precision={(0, 0): "fp32"}, default="int4")
    model(tokens(1, 10), kv_cache=mixed)
    assert mixed.nbytes == 2 * 10 * (4 * cfg.head_dim + (cfg.n_layers * cfg.kv_heads - 1) * (cfg.head_dim // 2 + 4))


def test_bad_precisions_are_refused():
    model = build("rotary-gqa")
    with pytest.raises(ValueError, match="unknown KV-cache policy 'int3'; choose from full, fp32, fp16, bf16, int8"):
        model.new_kv_cache(1, 8, precision="int3")
    with pytest.raises(ValueError, match="names \\(5, 0\\); this model has layers 0..1"):
        model.new_kv_cache(1, 8, precision={(5, 0): "int8"})
    with pytest.raises(ValueError, match="keyed by layer or \\(layer, kv_head\\)"):
        model.new_kv_cache(1, 8, precision={"3": "int8"})
    # precision= is a spelling of policy=: a whole layer by its index, as a policy map
    assert {p.name for p in model.new_kv_cache(1, 8, precision={1: "int8"}).policies[1]} == {"int8"}
    odd = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=12, n_heads=4, d_vocab=10, n_ctx=8))
    with pytest.raises(ValueError, match="even d_head"):
        odd.new_kv_cache(1, 8, precision="int4")


@needs_smol
def test_int8_greedy_still_knows_paris(smollm2):
    model = smollm2
    prompt = model.to_tokens("The capital of France is")
    out = model.generate(prompt, 1, kv_precision="int8")
    assert model.to_string(out[0, -1:]) == " Paris"


# ---- the study ----------------------------------------------------------------------------------
def test_head_kl_and_sensitivities_by_hand():
    from interp.analyses.kv.precision import head_table, kv_sensitivity, mixed_precision, precision_table

    model = build("rotary-gqa")
    toks = tokens(2, 24, seed=6)
    heads = head_table(model, toks, ("int4",), chunk=7)  # chunks that do not divide the length
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_rot_q", "hook_rot_k", "hook_v",
                                                                            "hook_pattern")))
    group = model.cfg.n_heads // model.cfg.kv_heads
    for l in range(model.cfg.n_layers):
        q = cache[f"blocks.{l}.attn.hook_rot_q"].transpose(1, 2)
        kq = fake_quantize(cache[f"blocks.{l}.attn.hook_rot_k"], "int4").transpose(1, 2).repeat_interleave(group, 1)
        scores = q @ kq.transpose(-1, -2) * model.blocks[l].attn.scale
        scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
        p, logq = cache["pattern", l], scores.log_softmax(-1)
        kl = torch.where(p > 0, p * (p.log() - logq), 0.0).sum(-1).mean((0, 2))
        got = heads[heads.layer == l].sort_values("head")["kl"].to_numpy()
        assert torch.allclose(torch.tensor(got, dtype=torch.float32), kl, atol=1e-5)
    sens = kv_sensitivity(model, toks, heads)
    assert len(sens) == model.cfg.n_layers * model.cfg.kv_heads and (sens["loss"].abs() > 0).all()
    for r in sens.itertuples():  # the batched loss ranking equals one cache per KV head, by the precision map
        with torch.no_grad():
            one = lm_loss(model(toks, kv_cache=model.new_kv_cache(2, 24, precision={(r.layer, r.kv_head): "int4"})), toks)
            clean = lm_loss(model(toks), toks)
        assert r.loss == pytest.approx(float(one - clean), abs=1e-5)
    table = precision_table(model, toks, ("fp32", "int4"))
    assert table.loc[0, "loss_diff"] == 0 and table.loc[1, "bytes_per_token"] < table.loc[0, "bytes_per_token"]
    mixed = mixed_precision(model, toks, sens, ks=[1], seeds=(0, 1))
    assert set(mixed["selection"]) == {"uniform", "loss", "kl", "gradient", "random"}
    full = mixed[(mixed.selection == "uniform") & (mixed.precision == "fp32")]["loss"].iloc[0]
    assert full == pytest.approx(table.loc[0, "loss"], abs=1e-6)


from interp.models import lm_loss  # noqa: E402


# ---- interp kv ------------------------------------------------------------------------------------
def test_interp_kv_refuses_bad_input_before_loading(tmp_path, capsys):
    import numpy as np

    from interp.cli import main as cli

    out = tmp_path / "out"

    def refused(argv, message):
        assert cli(["kv", "precision", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not out.exists()

    refused(["attn-only-2l", "--precisions", "fp32,int3"], "unknown KV precision 'int3'")
    refused(["attn-only-2l", "--seq-len", "1024"], "longer than this model's context (n_ctx=256)")
    floats = tmp_path / "f.npy"
    np.save(floats, np.zeros((2, 16), dtype=np.float32))
    refused(["attn-only-2l", "--data-file", str(floats)], "token ids must be integers")
    long = tmp_path / "long.npy"
    np.save(long, np.zeros((1, 300), dtype=np.int64))
    refused(["attn-only-2l", "--data-file", str(long)], "longer than this model's context")
    odd = interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=12, n_heads=4, d_vocab=10, n_ctx=16))
    interp.save_model(odd, tmp_path / "odd")
    refused([str(tmp_path / "odd"), "--seq-len", "8"], "even d_head")


def test_interp_kv_on_the_zoo(tmp_path):
    import pandas as pd

    from interp.cli import main as cli

    out = tmp_path / "kv"
    assert cli(["kv", "precision", "attn-only-2l", "--out", str(out), "--seq-len", "96", "--sensitivity-tokens", "64",
                "--seeds", "2", "--no-progress"]) == 0
    table = pd.read_parquet(out / "kv.parquet").set_index("precision")
    cfg = interp.load("attn-only-2l").cfg
    assert table.loc["int8", "bytes_per_token"] == 2 * cfg.n_layers * cfg.kv_heads * (cfg.head_dim + 4)
    assert table.loc["fp32", "loss_diff"] == 0
    heads = pd.read_parquet(out / "kv_heads.parquet")
    assert len(heads) == 3 * cfg.n_layers * cfg.n_heads and (heads["kl"] >= 0).all()
    mixed = pd.read_parquet(out / "kv_mixed.parquet")
    assert {"k", "selection", "seed", "perplexity", "bytes_per_token"} <= set(mixed.columns)
    assert set(mixed["selection"]) == {"uniform", "loss", "kl", "gradient", "random"}
    text = (out / "report.md").read_text()
    assert "of the int4 -> fp32 loss gap" in text and "How the atlas's heads fare" in text
    from interp.analyses import evaldata

    pinned = evaldata.manifest()[evaldata.LANGUAGE_REFERENCE]["sha256"]  # the text, named (issue 36)
    assert f"sha256 {pinned}" in text
    # written through OutputFolder: every file listed as interp's, so a second run replaces them
    import json

    listed = set(json.loads((out / ".interp-manifest.json").read_text())["paths"])
    assert {"kv.parquet", "kv_heads.parquet", "kv_mixed.parquet", "kv_sensitivity.parquet", "settings.json",
            "report.html", "report.md"} <= listed


def test_interp_kv_refuses_a_folder_holding_a_users_file_before_loading(tmp_path, capsys, monkeypatch):
    from interp.cli import main as cli

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the folder was checked")

    monkeypatch.setattr(interp, "load", refuse)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "kv.parquet").write_text("my own table")
    assert cli(["kv", "precision", "attn-only-2l", "--out", str(out), "--seq-len", "96", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already holds files interp did not write (kv.parquet)" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in out.iterdir()) == ["kv.parquet"] and (out / "kv.parquet").read_text() == "my own table"
