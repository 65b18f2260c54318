"""Seven native families (Qwen3, Phi-3 with LongRoPE, GPT-Neo, OPT, Falcon, MPT, XGLM), beyond
the parity matrix that `tests/models/families/test_hf_parity.py` runs on their `hf_cases.py` cases:

- LongRoPE: inverse frequencies and the cos/sin scale against transformers' own `ROPE_INIT_FUNCTIONS`
  (short and long regime, derived and explicit factors, partial rotary); a Phi-3 forward within and
  past `original_max_position_embeddings`; greedy generation that crosses it (the cache is rebuilt
  with the long factors there, as transformers' Phi-3 generation rebuilds it); the config's tuples
  through JSON and our checkpoint;
- greedy `generate` equal to transformers' `generate(do_sample=False)` for every case, unpadded and
  left-padded (8 new tokens after 6 cross the windows of 5);
- `attention_stats` equal to statistics of transformers' eager patterns, `process_weights_` keeping
  the log-probs;
- negative checks, so the parity tests cannot pass vacuously: turning each feature off (QK-norm,
  GPT-Neo's unscaled scores, MPT's softmax_scale, OPT's position offset, Falcon's grouped layout,
  XGLM's embedding scale and fairseq's table layout, the long factors) moves the logits;
- MPT's ALiBi slopes and XGLM's sinusoidal table against transformers' own;
- every refused key raises NotImplementedError in one line naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import interp
from core_models import hf_pair, left_mask, tokens
from hf_cases import CASES, VOCAB, build_hf_from
from near_ties import assert_greedy_agrees

transformers = pytest.importorskip("transformers")

from interp.models.families import get_family  # noqa: E402
from interp.models.formats.build import build_model, convert_weights  # noqa: E402
from interp.models.positions import alibi_slopes, rope_frequencies  # noqa: E402

TOL = 1e-4
OURS = ["qwen3-qknorm-window", "phi3-partial-window", "phi3-longrope", "gpt-neo-local", "opt", "opt-nobias-untied",
        "falcon-7b-style", "falcon-40b-style", "falcon-sequential", "mpt", "xglm"]


def case(name: str, **overrides):
    """A case of hf_cases.py with some of its config kwargs changed."""
    cfg_cls, model_cls, kwargs = CASES[name]
    return build_hf_from(cfg_cls, model_cls, **{**kwargs, **overrides})


def variant(hf, edit=None, **changes):
    """Our model of `hf` with config fields changed (and the state dict edited) after conversion."""
    family = get_family(hf.config.model_type)
    cfg = family.config(hf.config.to_dict())
    sd = convert_weights(family, cfg, dict(hf.state_dict()), "test")
    if edit is not None:
        edit(sd)
    cfg = cfg.replace(**changes)
    if not cfg.qk_norm:
        sd = {k: v for k, v in sd.items() if ".q_norm." not in k and ".k_norm." not in k}
    return build_model(cfg, sd, "test", torch.float32, "cpu")


def max_diff(model, hf, toks) -> float:
    with torch.no_grad():
        return float((model(toks) - hf(toks).logits).abs().max())


def eager_attentions(hf, toks):
    saved = hf.config._attn_implementation
    if saved != "eager":  # Falcon's cases are built eager (it cannot switch)
        hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return hf(toks, output_attentions=True).attentions
    finally:
        if saved != "eager":
            hf.set_attn_implementation(saved)


# ---- LongRoPE ------------------------------------------------------------------------------------------
_SHORT = [1.0 + 0.05 * i for i in range(48)]
_LONG = [1.0 + 0.9 * i ** 1.3 for i in range(48)]
LONGROPE = {
    # Phi-3.5-mini's shape: 96-dim heads, 131072 / 4096 positions, factor and attention factor derived
    "phi3-derived": ("Phi3Config", dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
                                        original_max_position_embeddings=4096,
                                        rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG})),
    "phi3-explicit": ("Phi3Config", dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=8192,
                                         original_max_position_embeddings=2048, rope_theta=250000.0,
                                         rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                                                       "factor": 32.0, "attention_factor": 1.19})),
    "phi3-no-extension": ("Phi3Config", dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=4096,
                                             original_max_position_embeddings=4096,
                                             rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG})),
    # the generic path (registry.rotary_from_hf): a Llama with longrope parameters, partial rotary
    "llama-partial": ("LlamaConfig", dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=16384,
                                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5, "short_factor": _SHORT[:24],
                                                           "long_factor": _LONG[:24], "original_max_position_embeddings": 1024})),
}


@pytest.mark.parametrize("name", list(LONGROPE))
def test_longrope_frequencies_match_hf(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg_cls, kwargs = LONGROPE[name]
    hf_cfg = getattr(transformers, cfg_cls)(num_hidden_layers=1, intermediate_size=64, vocab_size=10, **kwargs)
    ours = get_family(hf_cfg.model_type).config(hf_cfg.to_dict())
    orig = ours.rope_scaling.original_max_position
    assert ours.rope_scaling.kind == "longrope" and orig == hf_cfg.rope_parameters["original_max_position_embeddings"]
    regimes = {}
    for seq_len in (None, 7, orig, orig + 1, 4 * orig):
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
        inv, scale = rope_frequencies(ours, seq_len)
        torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)
        regimes[seq_len is not None and seq_len > orig] = inv
    assert not torch.allclose(regimes[False], regimes[True])  # both regimes were hit, and they differ


PHI3_LONGROPE = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=72,
                     max_position_embeddings=64, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6],
                                                               "long_factor": [1.1, 2.3, 4.7, 9.5]},
                     initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("backend", ["fused", "instrumented"])
def test_phi3_longrope_within_and_past_the_original_context(backend):
    """Short factors while the sequence fits original_max_position_embeddings (16), long ones past it,
    as transformers chooses them for a forward over the whole sequence."""
    hf = build_hf_from("Phi3Config", "Phi3ForCausalLM", original_max_position_embeddings=16, **PHI3_LONGROPE)
    model = interp.from_hf(hf)
    short, long = tokens(2, 12, vocab=VOCAB), tokens(2, 20, seed=1, vocab=VOCAB)
    long[:, :12] = short
    with model.attention(backend):
        assert max_diff(model, hf, short) < TOL
        assert max_diff(model, hf, long) < TOL
        with torch.no_grad():  # the same 12 tokens read differently once the sequence passes 16
            assert float((model(long)[:, :12] - model(short)).abs().max()) > 1e-3


def test_phi3_longrope_generation_crosses_the_original_context():
    """A 6-token prompt and 8 new tokens past original_max_position_embeddings=8: the prefill and the
    first steps rotate with the short factors; at the 9th token the cache is rebuilt from the whole
    sequence with the long ones, in transformers' generate as in ours (so every step equals a full
    forward, which a cache that kept its short-rotated keys would not)."""
    hf = build_hf_from("Phi3Config", "Phi3ForCausalLM", original_max_position_embeddings=8, **PHI3_LONGROPE)
    model = interp.from_hf(hf)
    prompt = tokens(3, 6, seed=2, vocab=VOCAB)
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None,
                          output_scores=True, return_dict_in_generate=True)
    out = model.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    assert_greedy_agrees(out, ref.sequences, torch.stack(ref.scores, dim=1), start=6)
    cache = model.new_kv_cache(3, 14)  # a plain cached decode, without the rebuild, is another computation
    with torch.no_grad():
        model(ref.sequences[:, :8], kv_cache=cache)
        kept = model(ref.sequences[:, 8:9], kv_cache=cache)[:, -1]
    assert float((kept - ref.scores[3]).abs().max()) > 1e-2


def test_longrope_config_round_trips_json_and_our_checkpoint(tmp_path):
    _, model = hf_pair("phi3-longrope")
    cfg = model.cfg
    assert isinstance(cfg.rope_scaling.long_factor, tuple)
    back = type(cfg).from_json(cfg.to_json())
    assert back == cfg and hash(back) == hash(cfg.replace())
    model.save(tmp_path)
    again = interp.load(tmp_path)
    toks = tokens(2, 12, vocab=VOCAB)
    with torch.no_grad():
        assert torch.equal(again(toks), model(toks))


def test_longrope_factors_of_the_wrong_length_are_refused():
    _, model = hf_pair("phi3-longrope")
    s = model.cfg.rope_scaling
    with pytest.raises(ValueError, match="long_factor must be a tuple of rotary_dim / 2 = 4"):
        model.cfg.replace(rope_scaling=dataclasses.replace(s, long_factor=s.long_factor[:3]))


# ---- every case: generation, statistics, weight processing ----------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", OURS)
def test_generate_equals_hugging_face(name, padded):
    hf, model = hf_pair(name)
    prompt = tokens(3, 6, vocab=VOCAB)
    mask = left_mask(3, 6) if padded else torch.ones_like(prompt)
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    out = model.generate(prompt, attention_mask=mask if padded else None, max_new_tokens=8, stop_at_eos=False)
    assert_greedy_agrees(out, ref.sequences, torch.stack(ref.scores, dim=1), start=6)


@pytest.mark.parametrize("name", OURS)
def test_attention_stats_equal_statistics_of_hf_patterns(name):
    """The streaming kernel sees each layer's window, scale, ALiBi slopes and rotated (QK-normed,
    LongRoPE-scaled) q / k: its statistics equal those of transformers' eager attention weights."""
    hf, model = hf_pair(name)
    half = tokens(1, 6, seed=4, vocab=VOCAB)
    toks = torch.cat([half, half], dim=1)
    patterns = eager_attentions(hf, toks)
    stats = model.attention_stats(toks, n_sink=1)
    n = toks.shape[1]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for layer, pattern in enumerate(patterns):  # [batch, head, q, k]
        st = stats[layer]
        torch.testing.assert_close(st.max, pattern.max(-1).values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.sink, pattern[..., 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.previous, (pattern * (j == p - 1)).sum(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.distance, (pattern * (p - j)).sum(-1), atol=1e-4, rtol=1e-5)
        entropy = -(pattern * pattern.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(st.entropy, entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", OURS)
def test_weight_processing_keeps_the_log_probs(name):
    hf, _ = hf_pair(name)
    model = interp.from_hf(hf)  # its own copy: processing edits in place
    toks = tokens(2, 12, vocab=VOCAB)
    with torch.no_grad():
        before = model(toks).log_softmax(-1)
        model.process_weights_()
        assert float((model(toks).log_softmax(-1) - before).abs().max()) < 1e-5


# ---- the features are exercised: turned off, the logits move ---------------------------------------------
def test_qwen3_qk_norm_and_explicit_head_dim():
    hf, model = hf_pair("qwen3-qknorm-window")
    assert model.cfg.qk_norm and model.cfg.d_head == 10 and model.cfg.windows() == [None, 5, 5]
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(model, hf, toks) < TOL
    assert max_diff(variant(hf, qk_norm=False), hf, toks) > 1e-2
    assert max_diff(variant(hf, sliding_window=None, layer_types=None), hf, toks) > 1e-2


def test_qwen3_windows_from_max_window_layers_and_head_dim_default():
    """A config.json without layer_types or head_dim reads as Qwen3Config fills them in."""
    raw = dict(model_type="qwen3", num_hidden_layers=4, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
               intermediate_size=72, vocab_size=VOCAB, use_sliding_window=True, sliding_window=5, max_window_layers=3)
    cfg = get_family("qwen3").config(raw)
    ref = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert cfg.windows() == [5 if t == "sliding_attention" else None for t in ref.layer_types] == [None] * 3 + [5]
    assert cfg.d_head == ref.head_dim == 128
    assert get_family("qwen3").config({**raw, "use_sliding_window": False}).windows() == [None] * 4


def test_phi3_partial_rotary_and_window_are_exercised():
    hf, model = hf_pair("phi3-partial-window")
    assert model.cfg.rot_dim == 4 and model.cfg.sliding_window == 5
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(variant(hf, rotary_dim=None), hf, toks) > 1e-3
    assert max_diff(variant(hf, sliding_window=None), hf, toks) > 1e-3


def test_phi3_long_factors_are_exercised():
    hf, model = hf_pair("phi3-longrope")
    s = model.cfg.rope_scaling
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(variant(hf, rope_scaling=dataclasses.replace(s, long_factor=s.short_factor)), hf, toks) > 1e-3


def test_phi3_legacy_su_rope_reads_as_hugging_face_reads_it():
    """Phi-3's older config.json: rope_scaling type "su" or "yarn" is longrope, and the top-level
    original_max_position_embeddings wins over the one in the rope parameters, whatever the name.

    Which transformers reads it how: before 5.25, Phi3Config renamed "su" only after standardising, so for
    "su" alone the inner value (8 here) won; from 5.25 it renames first and the top-level value (16) wins for
    every name. We read it as 5.25 does ("su" is a spelling of longrope, not a variant), and transformers'
    own Phi-3 built from the same raw config is the oracle for the logits past the original length."""
    from packaging.version import Version

    renames_first = Version(transformers.__version__) >= Version("5.25")
    for kind in ("su", "yarn", "longrope"):
        raw = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=1, intermediate_size=72, vocab_size=VOCAB,
                   max_position_embeddings=64, original_max_position_embeddings=16, rope_theta=500.0,
                   rope_scaling={"type": kind, "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [1.0, 3.0, 5.0, 7.0],
                                 "original_max_position_embeddings": 8},
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
        hf_cfg = transformers.Phi3Config(**copy.deepcopy(raw))  # it edits the dicts it is given
        ref = hf_cfg.rope_parameters
        cfg = get_family("phi3").config({**raw, "model_type": "phi3"})
        s = cfg.rope_scaling
        assert (s.kind, ref["rope_type"]) == ("longrope", "longrope")
        assert s.original_max_position == 16 and list(s.long_factor) == ref["long_factor"]
        assert s.factor == 64 / 16 and cfg.rotary_base == 500.0
        assert ref["original_max_position_embeddings"] == (8 if kind == "su" and not renames_first else 16)
        if ref["original_max_position_embeddings"] != 16:
            continue  # an older transformers reads this legacy spelling apart (above): no oracle for its logits
        torch.manual_seed(0)
        hf = transformers.Phi3ForCausalLM(hf_cfg).eval()
        family = get_family("phi3")
        ours = build_model(cfg, convert_weights(family, cfg, dict(hf.state_dict()), "test"), "test", torch.float32, "cpu")
        toks = tokens(2, 40, vocab=VOCAB)  # past the original 16: the long factors are in use
        assert max_diff(ours, hf, toks) < TOL


def test_gpt_neo_unscaled_scores_and_local_layers():
    hf = case("gpt-neo-local", initializer_range=0.1)  # sharper attention than the shared case
    model = interp.from_hf(hf)
    assert model.cfg.scale == 1.0 and model.cfg.windows() == [5, None, 5]
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(model, hf, toks) < TOL
    assert max_diff(variant(hf, attn_scale=None), hf, toks) > 1e-2
    assert max_diff(variant(hf, sliding_window=None, layer_types=None), hf, toks) > 1e-2


def test_opt_positions_skip_the_first_two_rows():
    hf, model = hf_pair("opt")
    table = hf.state_dict()["model.decoder.embed_positions.weight"]
    assert torch.equal(model.pos_embed.W_pos, table[2:])
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(variant(hf, edit=lambda sd: sd.update({"pos_embed.W_pos": table[:-2]})), hf, toks) > 1e-2


def test_opt_left_padding_without_position_ids():
    """transformers' OPT derives its positions from the attention mask itself (no position_ids given)."""
    hf, model = hf_pair("opt")
    toks, mask = tokens(3, 12, vocab=VOCAB), left_mask(3, 12)
    with torch.no_grad():
        ref = hf(toks, attention_mask=mask).logits
        out = model(toks, attention_mask=mask)
    assert float(((out - ref).abs() * mask[..., None]).max()) < TOL


def test_falcon_grouped_layout_is_exercised():
    """40B-style rows per KV group [q_1 .. q_g, k, v]: read as one [q | k | v] block instead, the logits move."""
    hf, model = hf_pair("falcon-40b-style")
    assert (model.cfg.n_heads, model.cfg.kv_heads, model.cfg.parallel_attn_mlp) == (6, 2, True)
    fused = {l: hf.state_dict()[f"transformer.h.{l}.self_attention.query_key_value.weight"] for l in range(2)}
    naive = variant(hf, edit=lambda sd: sd.update({f"blocks.{l}.attn.W_qkv": w.T.contiguous() for l, w in fused.items()}))
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(naive, hf, toks) > 1e-3
    # its two input norms (ln_attn, ln_mlp) are our ln1 and ln2
    assert torch.equal(model.blocks[0].ln2.w, hf.state_dict()["transformer.h.0.ln_mlp.weight"])


def test_falcon_shared_norm_is_both_of_ours():
    hf, model = hf_pair("falcon-7b-style")
    assert model.cfg.kv_heads == 1 and model.cfg.parallel_attn_mlp
    shared = hf.state_dict()["transformer.h.1.input_layernorm.weight"]
    block = model.blocks[1]
    assert torch.equal(block.ln1.w, shared) and torch.equal(block.ln2.w, shared)
    assert block.ln1.w.data_ptr() != block.ln2.w.data_ptr()  # copies: folding one leaves the other


@pytest.mark.parametrize("backend", ["fused", "instrumented"])
def test_falcon_new_decoder_with_one_shared_norm(backend):
    """new_decoder_architecture with num_ln_in_parallel_attn=1: grouped KV heads, one input_layernorm."""
    hf = case("falcon-40b-style", num_ln_in_parallel_attn=1)
    model = interp.from_hf(hf)
    toks, mask = tokens(3, 12, vocab=VOCAB), left_mask(3, 12)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), model.attention(backend):
        assert max_diff(model, hf, toks) < TOL
        ref = hf(toks, attention_mask=mask, position_ids=position_ids).logits
        assert float(((model(toks, attention_mask=mask) - ref).abs() * mask[..., None]).max()) < TOL


def test_mpt_softmax_scale_is_exercised():
    hf = case("mpt", initializer_range=0.1)
    model = interp.from_hf(hf)
    assert model.cfg.scale == 0.29 and model.cfg.positional == "alibi"
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(model, hf, toks) < TOL
    assert max_diff(variant(hf, attn_scale=None), hf, toks) > 1e-2


@pytest.mark.parametrize("n_heads", range(1, 17))
def test_mpt_alibi_slopes_equal_ours_for_every_head_count(n_heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(n_heads, 5, alibi_bias_max=8)  # [head, 1, key]: slope * (j - 4)
    torch.testing.assert_close(-bias[:, 0, 3], alibi_slopes(n_heads), rtol=1e-6, atol=0)
    if n_heads > 1:  # another alibi_bias_max gives other slopes: why it is refused
        assert not torch.allclose(-build_mpt_alibi_tensor(n_heads, 5, alibi_bias_max=16)[:, 0, 3], alibi_slopes(n_heads))


@pytest.mark.parametrize("d_model", [40, 41])
def test_xglm_position_table_equals_fairseqs(d_model):
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding
    from interp.models.families.xglm import position_table

    ref = XGLMSinusoidalPositionalEmbedding.get_embedding(64 + 2, d_model, padding_idx=1)
    assert torch.equal(position_table(64, d_model), ref[2:])


def test_xglm_embedding_scale_and_table_layout_are_exercised():
    from interp.models.positions import sinusoidal_table

    hf, model = hf_pair("xglm")
    assert model.cfg.embed_scale == pytest.approx(math.sqrt(40))
    toks = tokens(3, 12, vocab=VOCAB)
    assert max_diff(variant(hf, embed_scale=None), hf, toks) > 1e-2
    interleaved = sinusoidal_table(model.cfg.n_ctx + 2, 40)[2:]  # Vaswani's [sin, cos, sin, ...] layout
    assert max_diff(variant(hf, edit=lambda sd: sd.update({"pos_embed.W_pos": interleaved})), hf, toks) > 1e-2


# ---- refusals: one line, naming the key ----------------------------------------------------------------
REFUSED = [
    ("qwen3-qknorm-window", dict(rope_parameters={"rope_type": "mystery", "rope_theta": 1e4}), "rope type 'mystery'"),
    ("phi3-partial-window", dict(hidden_act="gelu"), "hidden_act"),
    ("phi3-partial-window", dict(mlp_bias=True), "mlp_bias"),
    ("phi3-longrope", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4}), "long_factor"),
    ("gpt-neo-local", dict(attention_types=[[["sparse"], 3]]), "attention_types"),
    ("gpt-neo-local", dict(activation_function="tanh"), "activation_function"),
    ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before"),
    ("opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim"),
    ("opt", dict(_remove_final_layer_norm=True), "_remove_final_layer_norm"),
    ("opt", dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine"),
    ("falcon-7b-style", dict(alibi=True), "alibi"),
    ("falcon-40b-style", dict(parallel_attn=False), "parallel_attn"),
    ("falcon-7b-style", dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn"),
    ("falcon-sequential", dict(num_kv_heads=2), "num_kv_heads"),
    ("mpt", dict(attn_config={"clip_qkv": 6.0}), "clip_qkv"),
    ("mpt", dict(attn_config={"qk_ln": True}), "qk_ln"),
    ("mpt", dict(attn_config={"alibi_bias_max": 16}), "alibi_bias_max"),
    ("mpt", dict(attn_config={"alibi": False}), "alibi"),
    ("mpt", dict(attn_config={"attn_type": "multiquery_attention"}), "attn_type"),
    ("mpt", dict(attn_config={"prefix_lm": True}), "prefix_lm"),
    ("mpt", dict(no_bias=False), "no_bias"),
    ("mpt", dict(logit_scale=0.5), "logit_scale"),
    ("xglm", dict(pad_token_id=5), "pad_token_id"),
    ("xglm", dict(add_cross_attention=True), "add_cross_attention"),
]


@pytest.mark.parametrize("name, change, key", REFUSED, ids=[f"{n}-{k}" for n, _, k in REFUSED])
def test_unsupported_keys_are_refused_in_one_line(name, change, key):
    cfg_cls, _, kwargs = CASES[name]
    raw = {**getattr(transformers, cfg_cls)(vocab_size=VOCAB, **kwargs).to_dict(), **change}
    with pytest.raises(NotImplementedError, match=key) as err:
        get_family(raw["model_type"]).config(raw)
    assert "\n" not in str(err.value)
