"""The KV cache and generation: decoding through the cache gives the logits of full recomputation."""

from __future__ import annotations

import pytest
import torch

import interp
from core_models import OWN_CONFIGS, build, hf_pair, left_mask, own, small, tokens
from hf_cases import CASES, build_hf
from near_ties import argmax_loop, assert_greedy_agrees

N, PREFILL = 12, 4  # N > every sliding window (5 for the HF cases, 3-4 for ours)
# llama-dynamic: dynamic NTK re-derives the frequencies from the current length, so keys cached at
# an earlier length are rotated differently from a full recomputation (Hugging Face's cache does the
# same). It is checked against Hugging Face's own cached decoding instead, below.
RECOMPUTABLE = [n for n in CASES if n != "llama-dynamic"]


def decode_step_by_step(model, toks, mask, prefill, steps=1, backend="auto"):
    """Logits of prefill, then chunks of `steps` tokens through one KV cache, concatenated."""
    cache = model.new_kv_cache(toks.shape[0], toks.shape[1])
    with torch.no_grad(), model.attention(backend):
        outs = [model(toks[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], kv_cache=cache)]
        for i in range(prefill, toks.shape[1], steps):
            chunk_mask = None if mask is None else mask[:, i : i + steps]  # each call's mask covers its own tokens
            outs.append(model(toks[:, i : i + steps], attention_mask=chunk_mask, kv_cache=cache))
    assert cache.length == toks.shape[1]
    return torch.cat(outs, dim=1), cache


def assert_same_on_real(a, b, mask, tol=1e-4):
    m = torch.ones(a.shape[:2]) if mask is None else mask
    assert float(((a - b).abs() * m[..., None]).max()) < tol


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", RECOMPUTABLE)
def test_decoding_equals_full_recomputation_hf_families(name, padded):
    _, model = hf_pair(name)
    toks = tokens(3, N, vocab=model.cfg.d_vocab)
    mask = left_mask(3, N) if padded else None
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
    inc, _ = decode_step_by_step(model, toks, mask, PREFILL)
    assert_same_on_real(inc, full, mask)


@pytest.mark.parametrize("backend", ["fused", "instrumented"])
@pytest.mark.parametrize("name", list(OWN_CONFIGS))
def test_decoding_equals_full_recomputation_own_configs(name, backend):
    model = own(name)
    toks, mask = tokens(3, N), left_mask(3, N)
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
    inc, _ = decode_step_by_step(model, toks, mask, PREFILL, backend=backend)
    assert_same_on_real(inc, full, mask)


@pytest.mark.parametrize("steps", [3, 5])
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window-layers", "gpt2", "neox"])
def test_chunked_prefill(name, steps):
    _, model = hf_pair(name)
    toks, mask = tokens(3, N, vocab=model.cfg.d_vocab), left_mask(3, N)
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
    inc, _ = decode_step_by_step(model, toks, mask, PREFILL, steps=steps)
    assert_same_on_real(inc, full, mask)


def test_dynamic_ntk_decoding_matches_hugging_face_cache():
    from transformers import DynamicCache

    hf = build_hf("llama-dynamic")  # fresh: its rotary state depends on the lengths it has seen
    model = interp.from_hf(hf)
    toks = tokens(2, N, vocab=model.cfg.d_vocab)
    inc, _ = decode_step_by_step(model, toks, None, PREFILL)
    pkv = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(toks[:, :PREFILL], past_key_values=pkv, use_cache=True).logits]
        ref += [hf(toks[:, i : i + 1], past_key_values=pkv, use_cache=True).logits for i in range(PREFILL, N)]
    assert float((inc - torch.cat(ref, 1)).abs().max()) < 1e-4


def test_attention_mask_across_calls():
    """Padding given chunk by chunk (each call's mask covers its own tokens) is remembered by the cache."""
    model = own("rotary-rms-swiglu-gqa")
    toks, mask = tokens(3, N), left_mask(3, N)
    mask[2, 6] = 0  # a hole in a later chunk, too
    with torch.no_grad():
        full = model(toks, attention_mask=mask)
        cache = model.new_kv_cache(3, N)
        outs = [model(toks[:, i : i + 4], attention_mask=mask[:, i : i + 4], kv_cache=cache) for i in range(0, N, 4)]
    assert_same_on_real(torch.cat(outs, 1), full, mask)
    assert torch.equal(cache.valid(), mask.bool())
    assert cache.n_seen.tolist() == mask.sum(1).tolist()
    assert torch.equal(cache.tokens[:, :N], toks)


def test_cache_shape_and_nbytes():
    cfg = OWN_CONFIGS["rotary-rms-swiglu-gqa"]  # 2 layers, 6 heads, 2 kv-heads, d_head 8
    model = own("rotary-rms-swiglu-gqa")
    cache = model.new_kv_cache(3, 10)
    assert cache.keys.shape == cache.values.shape == (2, 3, 2, 10, 8)  # kv-heads only
    assert cache.allocated_nbytes == 2 * 2 * 2 * 8 * 10 * 3 * 4
    assert cache.allocated_nbytes == cfg.kv_cache_bytes_per_token() * 10 * 3
    assert cache.held_nbytes == cache.nbytes == 0  # nothing cached yet
    assert cfg.kv_cache_bytes_per_token(2) == 2 * 2 * 2 * 8 * 2
    assert cache.queries is None and cache.query_nbytes == 0
    mqa = OWN_CONFIGS["no-norm-mqa-window"]
    half = build(mqa).half().new_kv_cache(2, 5)
    assert half.keys.dtype == torch.float16 and half.keys.shape[2] == 1
    assert half.allocated_nbytes == 2 * 2 * 1 * 8 * 5 * 2 * 2 == mqa.kv_cache_bytes_per_token(2) * 5 * 2
    # The cached keys are the rotated keys of the kv-heads.
    toks = tokens(3, 6)
    cache = model.new_kv_cache(3, 6)
    _, act = model.run_with_cache(toks, names_filter=lambda n: n.endswith(("hook_rot_k", "hook_v")), kv_cache=cache)
    for layer in range(2):
        torch.testing.assert_close(cache.k(layer), act["rot_k", layer].transpose(1, 2))
        torch.testing.assert_close(cache.v(layer), act["v", layer].transpose(1, 2))
    assert "length=6/6" in repr(cache)


def test_cache_errors():
    model = own("learned-layernorm")
    cache = model.new_kv_cache(2, 6)
    with torch.no_grad():
        model(tokens(2, 4), kv_cache=cache)
        with pytest.raises(ValueError, match="full.*max_len=7"):
            model(tokens(2, 3), kv_cache=cache)
        with pytest.raises(ValueError, match="batch 2, got a batch of 3"):
            model(tokens(3, 1), kv_cache=cache)
        assert cache.length == 4  # failed calls wrote nothing
        model(tokens(2, 2), kv_cache=cache)
    with pytest.raises(ValueError, match="capture_queries=True"):
        cache.q(0)
    with pytest.raises(ValueError, match="n_ctx=32"):
        model(tokens(1, 1), kv_cache=_filled(model, 32))


def _filled(model, n):
    cache = model.new_kv_cache(1, n + 1)
    with torch.no_grad():
        model(tokens(1, n), kv_cache=cache)
    return cache


def test_cache_reset_reuses_the_buffers():
    model = own("learned-layernorm")
    cache = model.new_kv_cache(1, 8)
    toks = tokens(1, 8)
    with torch.no_grad():
        first = model(toks, kv_cache=cache)
        cache.reset()
        again = model(toks, kv_cache=cache)
    torch.testing.assert_close(first, again)


# ---- generation -------------------------------------------------------------------------------


def test_generate_greedy_equals_argmax_loop_without_cache():
    """Cached decoding and full forwards round differently: equal wherever the choice is clear (near_ties)."""
    model = own("rotary-rms-swiglu-gqa")
    prompt = tokens(2, 5)
    out = model.generate(prompt, max_new_tokens=6)
    seq, scores = argmax_loop(model, prompt, 6)
    assert_greedy_agrees(out, seq, scores, start=5)


def test_generate_with_left_padding_equals_rows_alone():
    model = own("alibi-window-untied-bias")
    prompt, mask = tokens(3, 6), left_mask(3, 6)
    out = model.generate(prompt, max_new_tokens=5, attention_mask=mask)
    for row in range(3):
        real = prompt[row, mask[row].bool()][None]
        alone = model.generate(real, max_new_tokens=5)
        seq, scores = argmax_loop(model, real, 5)  # the row alone, by full forwards: the reference
        assert_greedy_agrees(alone, seq, scores, start=real.shape[1])
        assert_greedy_agrees(torch.cat([real, out[row:row + 1, 6:]], 1), seq, scores, start=real.shape[1])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2", "mistral-window"])
def test_generate_equals_hugging_face(name, padded):
    """Greedy tokens equal transformers' generate(do_sample=False); left-padded prompts too (it derives
    positions from the mask, as we do). 8 new tokens after 6 cross Mistral's window of 5."""
    hf, model = hf_pair(name)
    prompt = tokens(3, 6, vocab=model.cfg.d_vocab)
    mask = left_mask(3, 6) if padded else torch.ones_like(prompt)
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    out = model.generate(prompt, attention_mask=mask if padded else None, max_new_tokens=8)
    assert_greedy_agrees(out, ref.sequences, torch.stack(ref.scores, dim=1), start=6)  # two implementations


def test_sampling():
    model = own("learned-layernorm")
    prompt = tokens(3, 4)
    greedy = model.generate(prompt, max_new_tokens=8)
    a = model.generate(prompt, max_new_tokens=8, do_sample=True, seed=3)
    b = model.generate(prompt, max_new_tokens=8, do_sample=True, seed=3)
    c = model.generate(prompt, max_new_tokens=8, do_sample=True, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=1, seed=0), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=True, top_p=1e-6, seed=0), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0), greedy)


def test_top_k_and_top_p_filtering():
    from interp.models.generate import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, do_sample=True, top_k=2, generator=g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1}
    draws = torch.stack([sample_next(logits, do_sample=True, top_p=0.7, generator=g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8: the two most likely
    draws = torch.stack([sample_next(logits, do_sample=True, top_p=0.81, generator=g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {0, 1, 2}
    freq = (torch.stack([sample_next(logits, do_sample=True, generator=g) for _ in range(4000)]) == 0).float().mean()
    assert abs(float(freq) - 0.5) < 0.04


def test_stop_tokens_stop_rows_and_pad():
    model = own("learned-layernorm")
    prompt = tokens(3, 4)
    greedy = model.generate(prompt, max_new_tokens=8)
    stop = int(greedy[0, 6])  # row 0 emits it at its third new token
    out = model.generate(prompt, max_new_tokens=8, stop_tokens=stop, pad_token_id=0)
    for row in range(3):
        new = greedy[row, 4:].tolist()
        if stop in new:
            k = new.index(stop)
            assert out[row, 4 : 5 + k].tolist() == new[: k + 1]
            assert (out[row, 5 + k :] == 0).all()
        else:
            assert out[row, 4:].tolist() == new[: out.shape[1] - 4]
    if all(stop in greedy[r, 4:].tolist() for r in range(3)):
        assert out.shape[1] < greedy.shape[1]  # every row stopped: generation ended early
    one = model.generate(prompt[:1], max_new_tokens=8, stop_tokens=[stop, 10_000])
    first = greedy[0, 4:].tolist().index(stop)
    assert one.shape[1] == 4 + first + 1 and one[0, -1] == stop


def test_capture_queries():
    model = own("rotary-rms-swiglu-gqa")
    toks = tokens(2, 7)
    cache = model.new_kv_cache(2, 7, capture_queries=True)
    _, act = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_rot_q"), kv_cache=cache)
    for layer in range(2):
        torch.testing.assert_close(cache.q(layer), act["rot_q", layer].transpose(1, 2))
    assert cache.query_nbytes == 2 * 2 * 6 * 7 * 8 * 4
    out, gen_cache = model.generate(toks[:, :4], max_new_tokens=3, capture_queries=True, return_kv_cache=True)
    assert gen_cache.length == 6  # 4 prompt tokens + 2 fed back (the last one generated is not fed)
    _, act = model.run_with_cache(out[:, :6], names_filter=lambda n: n.endswith(("hook_rot_q", "hook_rot_k")))
    for layer in range(2):
        torch.testing.assert_close(gen_cache.q(layer), act["rot_q", layer].transpose(1, 2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gen_cache.k(layer), act["rot_k", layer].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_learned_positions_with_left_padding_in_the_cache():
    """GPT-2-style learned positions: a left-padded row's tokens get positions 0, 1, ... as if alone."""
    model = build(small(n_ctx=8))
    toks, mask = tokens(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="n_ctx=8"):
        model(toks, attention_mask=mask)  # row 0 reaches position 9
    mask[0, :3] = 0
    with torch.no_grad():
        full = model(toks, attention_mask=mask)  # 7 real tokens each: positions 0..6
        inc, _ = decode_step_by_step(model, toks, mask, 5)
        alone = model(toks[1, 3:][None])
    assert_same_on_real(inc, full, mask)
    torch.testing.assert_close(full[1, 3:], alone[0])


def test_penalties_by_hand():
    """repetition_penalty and freq_penalty on a hand-made example (TransformerLens's / Hugging Face's rules)."""
    from interp.models.generate import sample_next

    logits = torch.tensor([[2.0, 1.9, -1.0, -1.2]])
    counts = torch.tensor([[1.0, 0.0, 3.0, 0.0]])
    assert sample_next(logits, do_sample=False).item() == 0
    # token 0 was seen: 2.0 / 2 = 1.0 < 1.9; token 2's -1.0 becomes -2.0, below token 3's -1.2
    assert sample_next(logits, do_sample=False, counts=counts, repetition_penalty=2.0).item() == 1
    # greedy ignores freq_penalty (as TransformerLens); sampling subtracts penalty * count after the temperature
    assert sample_next(logits, do_sample=False, counts=counts, freq_penalty=5.0).item() == 0
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, do_sample=True, top_k=1, counts=counts, freq_penalty=0.2, generator=g)
                         for _ in range(20)])
    assert set(draws.flatten().tolist()) == {1}  # 2.0 - 0.2 = 1.8 < 1.9: top-1 is now token 1
    model = own("learned-layernorm")
    prompt = tokens(2, 5)
    with pytest.raises(ValueError, match="freq_penalty must be >= 0"):
        model.generate(prompt, freq_penalty=-1.0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        model.generate(prompt, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="need the KV cache"):
        model.generate(prompt, use_past_kv_cache=False, return_kv_cache=True)
    # without the cache (the whole sequence recomputed each step) the same tokens, left padding too
    mask = left_mask(2, 5)
    assert torch.equal(model.generate(prompt, attention_mask=mask, max_new_tokens=6),
                       model.generate(prompt, attention_mask=mask, max_new_tokens=6, use_past_kv_cache=False))
