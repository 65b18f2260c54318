"""TransformerLens 2-3 idioms that circuit libraries written for its `HookedTransformer` use (EAP-IG,
hannamw/EAP-IG, among them), on our model with nothing but the import changed:

1. `model.cfg.use_split_qkv_input = True` (and `use_attn_in`, `use_hook_mlp_in`, `use_attn_result`):
   assigning a switch is calling `model.set_<switch>`, and reading it follows the model;
2. `model.cfg.ungroup_grouped_query_attention = True` / `set_ungroup_grouped_query_attention(True)`:
   under GQA, k / v and their split inputs per query head, the outputs unchanged bit for bit;
3. `model.tokenizer.padding_side` on the zoo's byte tokenizer, honoured by `to_tokens`.

Compared with TransformerLens 4's bridge (installed) where it has the feature, and with TransformerLens
3's `HookedTransformer` where it is importable (TransformerLens 4 removed `ungroup_grouped_query_attention`)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from core_models import build, small, tokens

import interp
from interp.models.formats.tokenizer import ByteTokenizer, load_tokenizer

GQA = small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48, n_heads=6,
            n_kv_heads=2, qkv_bias=True)
UNGROUPED = {"attn.hook_k", "attn.hook_v", "attn.hook_rot_k", "attn.hook_k_normed", "attn.k_norm.hook_scale",
             "attn.k_norm.hook_normalized", "hook_k_input", "hook_v_input"}


def gqa(**changes) -> interp.HookedTransformer:
    return build(dataclasses.replace(GQA, **changes) if changes else GQA)


def shapes(model, toks) -> dict[str, tuple]:
    _, cache = model.run_with_cache(toks)
    return {k: tuple(v.shape) for k, v in cache.items()}


# ---- 1. the switches, assigned on the config ---------------------------------------------------------
@pytest.mark.parametrize("switch", ["use_split_qkv_input", "use_attn_in", "use_hook_mlp_in"])
def test_assigning_a_switch_is_calling_its_setter(switch):
    by_setter, by_cfg = gqa(), gqa()
    kept = by_cfg.cfg  # a config read before the switch, as TransformerLens code keeps `cfg = model.cfg`
    assert getattr(kept, switch) is False
    getattr(by_setter, f"set_{switch}")(True)
    setattr(by_cfg.cfg, switch, True)
    assert getattr(by_cfg.cfg, switch) is True and getattr(kept, switch) is True
    assert list(by_cfg.hook_dict) == list(by_setter.hook_dict)
    toks = tokens(2, 7)
    assert shapes(by_cfg, toks) == shapes(by_setter, toks)
    assert torch.equal(by_cfg(toks), by_setter(toks))
    setattr(kept, switch, False)  # through the kept config: the same model
    assert getattr(by_cfg.cfg, switch) is False and list(by_cfg.hook_dict) == list(gqa().hook_dict)


def test_assignment_refuses_what_the_setter_refuses_and_other_fields_stay_frozen():
    model = gqa()
    model.cfg.use_attn_in = True
    with pytest.raises(ValueError, match="mutually exclusive"):
        model.cfg.use_split_qkv_input = True
    assert model.cfg.use_split_qkv_input is False
    attn_only = build(small(d_mlp=None))
    with pytest.raises(ValueError, match="attention-only"):
        attn_only.cfg.use_hook_mlp_in = True
    model.cfg.use_attn_result = True  # accepted: hook_result exists whenever it is hooked
    assert model.cfg.use_attn_result is True
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"^cannot assign to field 'n_layers'$"):
        model.cfg.n_layers = 3
    with pytest.raises(dataclasses.FrozenInstanceError, match="not held by a model.*set_use_split_qkv_input"):
        GQA.use_split_qkv_input = True
    for copied in (copy.deepcopy(model.cfg), pickle.loads(pickle.dumps(model.cfg))):
        assert copied == model.cfg and copied.use_attn_in is True  # the switches as they were
        with pytest.raises(dataclasses.FrozenInstanceError, match="not held by a model"):
            copied.use_attn_in = False  # a copy belongs to no model
    assert model.cfg.use_attn_in is True


def test_a_wrapped_model_refuses_the_assignment_as_its_setter():
    pytest.importorskip("transformers")
    from interp.models.base import NativeOnly
    from wrapped_cases import build_wrapped_hf

    wrapped = interp.from_hf(build_wrapped_hf("starcoder2"))
    assert not wrapped.native and wrapped.cfg.use_split_qkv_input is False
    for switch in ("use_split_qkv_input", "use_hook_mlp_in", "ungroup_grouped_query_attention"):
        with pytest.raises(NativeOnly):
            getattr(wrapped, f"set_{switch}")(True)
        with pytest.raises(NativeOnly):
            setattr(wrapped.cfg, switch, True)
        assert getattr(wrapped.cfg, switch) is False
    wrapped.cfg.use_attn_result = True  # accepted there too


def test_assignment_matches_the_bridge():
    """TransformerLens 4's bridge routes `cfg.<switch> = ...` through its setters too: the same hook
    points, shapes and values come out of both."""
    pytest.importorskip("transformer_lens")
    from tl_pairs import TEXT, close, pair

    ours, bridge = pair("llama-gqa")
    for model in (ours, bridge):
        model.cfg.use_split_qkv_input = True
        model.cfg.use_hook_mlp_in = True
    try:
        _, ca = ours.run_with_cache(TEXT)
        _, cb = bridge.run_with_cache(TEXT)
        for l in range(ours.cfg.n_layers):
            for hook in ("hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in"):
                close(ca[f"blocks.{l}.{hook}"], cb[f"blocks.{l}.{hook}"])
    finally:
        for model in (ours, bridge):
            model.cfg.use_split_qkv_input = False
            model.cfg.use_hook_mlp_in = False
    assert not ours.cfg.use_split_qkv_input and "blocks.0.hook_k_input" not in ours.hook_dict


# ---- 2. keys and values per query head ----------------------------------------------------------------
@pytest.mark.parametrize("split", [False, True])
def test_ungrouped_hooks_have_transformer_lens_3s_shapes(split):
    """TransformerLens 3 (`GroupedQueryAttention`, `TransformerBlock`): hook_k / hook_v (and the rotated
    and normalised keys) [batch, pos, n_heads, d_head]; with split inputs hook_k_input / hook_v_input
    [batch, pos, n_heads, d_model]; every other hook point as before."""
    model, toks = gqa(qk_norm=True), tokens(2, 7)
    model.set_use_split_qkv_input(split)
    before = shapes(model, toks)
    model.set_ungroup_grouped_query_attention(True)
    assert model.cfg.ungroup_grouped_query_attention is True
    after = shapes(model, toks)
    assert after.keys() == before.keys()
    # With split inputs ln1 runs on each of them, the value input last (TransformerLens 3's order): its hooks
    # keep that one's shape.
    ungrouped = UNGROUPED | ({"ln1.hook_scale", "ln1.hook_normalized"} if split else set())
    for name, shape in after.items():
        if name.split(".", 2)[-1] in ungrouped:  # [batch, pos, kv_head, ...] -> [batch, pos, head, ...]
            assert before[name][2] == GQA.n_kv_heads, name
            assert shape == (*before[name][:2], GQA.n_heads, *before[name][3:]), name
        else:
            assert shape == before[name], name
    assert after["blocks.0.attn.hook_k"] == (2, 7, GQA.n_heads, GQA.head_dim)
    assert split == any(k.endswith("hook_k_input") for k in after)
    if split:
        assert after["blocks.1.hook_v_input"] == (2, 7, GQA.n_heads, GQA.d_model)
    model.cfg.ungroup_grouped_query_attention = False
    assert shapes(model, toks) == before


CONFIGS = {
    "gqa-rotary-bias": GQA,
    "mqa-window-no-norm": small(positional="rotary", normalization=None, n_kv_heads=1, sliding_window=4),
    "gqa-qknorm-alibi": small(positional="alibi", d_model=48, n_heads=6, n_kv_heads=3, qk_norm=True),
    "gqa-learned-sinks-softcap": small(d_model=48, n_heads=6, n_kv_heads=2, learned_sinks=True, output_logits_soft_cap=5.0),
    "gqa-projection-qknorm-mha": small(d_model=48, n_heads=6, qk_norm=True, qk_norm_over="projection"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["fused", "instrumented"])
def test_ungrouping_leaves_the_outputs_bit_for_bit(name, backend):
    model, toks = build(CONFIGS[name]), tokens(3, 9)
    mask = torch.ones_like(toks, dtype=torch.bool)
    mask[0, :3] = False  # a left-padded row
    for split in (False, True):
        model.set_use_split_qkv_input(split)
        with model.attention(backend):
            model.set_ungroup_grouped_query_attention(False)
            off = model(toks, attention_mask=mask)
            model.set_ungroup_grouped_query_attention(True)
            on = model(toks, attention_mask=mask)
        assert torch.equal(on, off), (name, backend, split)
    model.set_ungroup_grouped_query_attention(False)
    model.set_use_split_qkv_input(False)


def test_ungrouped_keys_are_the_kv_heads_copied_as_transformer_lens_gives_them():
    """The values: each query head's key / value is its KV head's (the bridge's hook_k, KV heads) copied
    for its group (`repeat_interleave`, TransformerLens 3's expansion)."""
    pytest.importorskip("transformer_lens")
    from tl_pairs import TEXT, close, pair

    ours, bridge = pair("llama-gqa")
    group = ours.cfg.n_heads // ours.cfg.kv_heads
    _, cb = bridge.run_with_cache(TEXT)
    ours.cfg.ungroup_grouped_query_attention = True
    try:
        _, ca = ours.run_with_cache(TEXT)
    finally:
        ours.cfg.ungroup_grouped_query_attention = False
    for l in range(ours.cfg.n_layers):
        for kind in ("k", "v"):
            close(ca[kind, l], cb[kind, l].repeat_interleave(group, dim=2))


def test_patching_one_query_heads_key_input_reaches_that_head_alone():
    """EAP-IG's edit: one query head's k (or v) input changed; only that head's key, pattern and z move."""
    model, toks = gqa(), tokens(2, 8)
    model.cfg.use_split_qkv_input = True
    model.cfg.ungroup_grouped_query_attention = True
    names = lambda n: n.startswith("blocks.1.attn.hook_") and n.rsplit("_", 1)[-1] in ("k", "v", "pattern", "z")  # noqa: E731
    _, clean = model.run_with_cache(toks, names_filter=names)
    for kind, target in (("k", 4), ("v", 1)):
        def patch(x, hook, target=target):
            x = x.clone()
            x[:, :, target] += torch.randn_like(x[:, :, target])
            return x

        with model.hooks([(f"blocks.1.hook_{kind}_input", patch)]):
            _, patched = model.run_with_cache(toks, names_filter=names)
        moved = {n: (patched[n] - clean[n]).abs().amax(dim=(0, 1, 3) if n.endswith(("_k", "_v", "_z")) else (0, 2, 3))
                 for n in clean.keys()}
        others = torch.arange(GQA.n_heads) != target
        for n, change in moved.items():
            assert change[others].max() == 0, (kind, n)
        assert moved[f"blocks.1.attn.hook_{kind}"][target] > 1e-3 and moved["blocks.1.attn.hook_z"][target] > 1e-4
        assert moved["blocks.1.attn.hook_pattern"][target] > 0 if kind == "k" else moved["blocks.1.attn.hook_pattern"].max() == 0


def test_per_query_head_gradients_sum_to_the_kv_heads():
    """EAP-IG reads the gradient at each query head's k / v input: summed over a group it is the gradient at
    the KV head's input (ungrouping off), so attribution per query head splits the grouped one exactly."""
    model, toks = gqa(), tokens(2, 8)
    model.set_use_split_qkv_input(True)
    grads = {}

    def keep(x, hook):
        grads[hook.name] = x

    def run():
        with model.hooks(bwd_hooks=[("blocks.1.hook_k_input", keep), ("blocks.1.hook_v_input", keep)]):
            model(toks)[:, -1, 5].sum().backward()
        return {k: v.clone() for k, v in grads.items()}

    grouped = run()
    model.cfg.ungroup_grouped_query_attention = True
    ungrouped = run()
    group = GQA.n_heads // GQA.n_kv_heads
    for name, g in ungrouped.items():
        assert g.shape[2] == GQA.n_heads
        summed = g.unflatten(2, (GQA.n_kv_heads, group)).sum(3)
        torch.testing.assert_close(summed, grouped[name], rtol=1e-5, atol=1e-7)
        assert g.abs().amax(dim=(0, 1, 3)).min() > 0  # every query head's copy has its own gradient


def test_ungrouped_generation_and_the_kv_cache():
    model = gqa()
    prompt = tokens(1, 5)
    off = model.generate(prompt, max_new_tokens=6)
    model.set_ungroup_grouped_query_attention(True)
    assert torch.equal(model.generate(prompt, max_new_tokens=6), off)

    def split_a_group(x, hook):
        x = x.clone()
        x[:, :, 1] += 1.0
        return x

    with model.hooks([("blocks.0.attn.hook_k", split_a_group)]):
        model(prompt)  # without a cache: the edit reaches query head 1 alone
        with pytest.raises(ValueError, match="one key and value per KV head.*without the cache"):
            model.generate(prompt, max_new_tokens=2)


def test_ungrouping_without_gqa_and_its_refusals():
    mha = build(small())
    toks = tokens(2, 6)
    before = shapes(mha, toks)
    mha.cfg.ungroup_grouped_query_attention = True  # as in TransformerLens: nothing to ungroup
    assert mha.cfg.ungroup_grouped_query_attention and shapes(mha, toks) == before
    olmo_like = build(small(d_model=48, n_heads=6, n_kv_heads=2, qk_norm=True, qk_norm_over="projection"))
    with pytest.raises(ValueError, match="whole key projection"):
        olmo_like.set_ungroup_grouped_query_attention(True)
    assert olmo_like.cfg.ungroup_grouped_query_attention is False


def _tl3_twin(ours):
    """TransformerLens 3's HookedTransformer on our model's weights (learned positions, LayerNorm, GQA)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    c = ours.cfg
    tl_cfg = HookedTransformerConfig(n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads, d_head=c.head_dim,
                                     n_key_value_heads=c.kv_heads, d_mlp=c.d_mlp, d_vocab=c.d_vocab, n_ctx=c.n_ctx,
                                     act_fn=c.act_fn, normalization_type="LN", eps=c.norm_eps,
                                     positional_embedding_type="standard", default_prepend_bos=False)
    twin = HookedTransformer(tl_cfg)
    state = {"embed.W_E": ours.W_E, "pos_embed.W_pos": ours.W_pos, "unembed.W_U": ours.W_U, "unembed.b_U": ours.b_U,
             "ln_final.w": ours.ln_final.w, "ln_final.b": ours.ln_final.b}
    for l, block in enumerate(ours.blocks):
        a, m = block.attn, block.mlp
        state |= {f"blocks.{l}.{k}": v for k, v in {
            "ln1.w": block.ln1.w, "ln1.b": block.ln1.b, "ln2.w": block.ln2.w, "ln2.b": block.ln2.b,
            "attn.W_Q": a.W_Q, "attn._W_K": a.W_K, "attn._W_V": a.W_V, "attn.W_O": a.W_O,
            "attn.b_Q": a.b_Q, "attn._b_K": a.b_K, "attn._b_V": a.b_V, "attn.b_O": a.b_O,
            "mlp.W_in": m.W_in, "mlp.b_in": m.b_in, "mlp.W_out": m.W_out, "mlp.b_out": m.b_out}.items()}
    missing = twin.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False).missing_keys
    assert not [k for k in missing if "IGNORE" not in k and "mask" not in k], missing
    return twin.eval()


def test_ungrouping_matches_transformer_lens_3():
    """A tiny GQA model built both ways (ours, and TransformerLens 3's HookedTransformer on the same weights),
    with `cfg.use_split_qkv_input`, `use_attn_result` and `ungroup_grouped_query_attention` assigned on both:
    every hook point of ours is one of theirs, with the same shape and values. Skipped where TransformerLens 4 is installed (it has no
    HookedTransformer); run it with TransformerLens 3 on the path."""
    tl = pytest.importorskip("transformer_lens")
    try:
        tl.HookedTransformerConfig
    except (ImportError, AttributeError):
        pytest.skip("TransformerLens 4 removed HookedTransformer and ungroup_grouped_query_attention")
    ours = build(small(d_model=48, n_heads=6, n_kv_heads=2, act_fn="gelu_new", d_mlp=56))
    twin = _tl3_twin(ours)
    toks = tokens(2, 9)
    torch.testing.assert_close(twin(toks), ours(toks), rtol=1e-4, atol=1e-4)
    for model in (ours, twin):
        model.cfg.use_split_qkv_input = True
        model.cfg.use_attn_result = True
        model.cfg.ungroup_grouped_query_attention = True
    _, ca = ours.run_with_cache(toks)
    _, cb = twin.run_with_cache(toks)
    shared = [k for k in ca.keys() if k in cb.cache_dict]
    assert len(shared) == len(list(ca.keys())) and {"blocks.1.hook_k_input", "blocks.1.attn.hook_k"} <= set(shared)
    for k in shared:
        assert tuple(ca[k].shape) == tuple(cb[k].shape), k
        if "attn_scores" not in k and "hook_normalized" not in k:  # the masked entries; the norm's weight
            torch.testing.assert_close(ca[k], cb[k], rtol=1e-4, atol=1e-4, msg=k)


# ---- the three together, as EAP-style code written for TransformerLens runs them ---------------------------
def _tl_style_attribution(model, clean_texts, corrupt_texts, answer: int, ungroup: bool) -> dict[str, torch.Tensor]:
    """Edge attribution as circuit code written for TransformerLens's HookedTransformer does it (its switches
    assigned on the config, its attention mask from the tokenizer's padding side, per-head receivers): each
    sender's corrupted-minus-clean output against the gradient at each receiver's input, per receiver."""
    from transformer_lens.utilities.tokenize_utils import get_attention_mask

    model.cfg.use_split_qkv_input = True
    model.cfg.use_attn_result = True
    model.cfg.use_hook_mlp_in = True
    if model.cfg.n_key_value_heads is not None:
        model.cfg.ungroup_grouped_query_attention = ungroup
    model.tokenizer.padding_side = "right"
    runs = []
    for texts in (clean_texts, corrupt_texts):
        toks = model.to_tokens(texts, prepend_bos=True, padding_side="right")
        runs.append((toks, get_attention_mask(model.tokenizer, toks, True)))
    n_layers = model.cfg.n_layers
    senders = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.{h}" for l in range(n_layers)
                                              for h in ("attn.hook_result", "hook_mlp_out")]
    outs: dict[str, list] = {name: [] for name in senders}
    keep = lambda x, hook: outs[hook.name].append(x.detach())  # noqa: E731
    for toks, mask in reversed(runs):  # corrupted first, then clean
        with torch.no_grad(), model.hooks([(n, keep) for n in senders]):
            model(toks, attention_mask=mask)
    diff = {n: (corrupt - clean) for n, (corrupt, clean) in outs.items()}
    receivers = [f"blocks.{l}.hook_{r}" for l in range(n_layers) for r in ("q_input", "k_input", "v_input", "mlp_in")]
    grads: dict[str, torch.Tensor] = {}
    toks, mask = runs[0]
    with model.hooks(bwd_hooks=[(n, lambda g, hook: grads.__setitem__(hook.name, g)) for n in receivers]):
        last = mask.sum(1) - 1
        model(toks, attention_mask=mask)[torch.arange(len(toks)), last, answer].sum().backward()
    scores = {}  # receiver -> [sender, receiver head]
    for r, g in grads.items():
        g = g if g.dim() == 4 else g[:, :, None]  # [batch, pos, head, d_model]
        scores[r] = torch.cat([torch.einsum("bpsd,bphd->sh", d if d.dim() == 4 else d[:, :, None], g)
                               for d in diff.values()])
    model.cfg.ungroup_grouped_query_attention = False
    model.cfg.use_split_qkv_input = False
    model.cfg.use_hook_mlp_in = False
    return scores


def test_tl_style_attribution_runs_and_ungrouped_splits_the_grouped():
    """The code runs on ours with only its model changed: padded texts of different lengths through the byte
    tokenizer, every switch assigned. Ungrouped, each query head's k / v receiver gets its own scores, and
    over a group they sum to the KV head's (ungrouping off); queries and MLPs score the same either way."""
    pytest.importorskip("transformer_lens")
    model = gqa(d_vocab=257, prepend_bos=True)
    model.tokenizer = ByteTokenizer()
    clean, corrupt = ["abcab", "xyzxyzx", "hello"], ["abcaq", "xyzqyzx", "hellp"]
    grouped = _tl_style_attribution(model, clean, corrupt, answer=98, ungroup=False)
    ungrouped = _tl_style_attribution(model, clean, corrupt, answer=98, ungroup=True)
    group = GQA.n_heads // GQA.n_kv_heads
    for r, score in ungrouped.items():
        if r.endswith(("k_input", "v_input")):
            assert score.shape[1] == GQA.n_heads and grouped[r].shape[1] == GQA.n_kv_heads
            assert (score.unflatten(1, (GQA.n_kv_heads, group)).std(2) > 1e-6).any()  # the copies differ
            score = score.unflatten(1, (GQA.n_kv_heads, group)).sum(2)
        torch.testing.assert_close(score, grouped[r], rtol=1e-4, atol=1e-6, msg=r)
    assert not model.cfg.use_split_qkv_input and not model.cfg.ungroup_grouped_query_attention


# ---- 3. the byte tokenizer's padding side ---------------------------------------------------------------
def test_byte_tokenizer_padding_side_is_honoured_as_hugging_faces():
    model = build(small(d_vocab=257, prepend_bos=True))
    model.tokenizer = ByteTokenizer()
    texts = ["ab", "abcd"]
    assert model.tokenizer.padding_side == "right" and model.cfg.default_padding_side == "right"
    right = model.to_tokens(texts)
    assert right[0].tolist() == [256, 97, 98, 256, 256]
    model.tokenizer.padding_side = "left"
    assert model.cfg.default_padding_side == "left"
    left = model.to_tokens(texts)
    assert left[0].tolist() == [256, 256, 256, 97, 98]
    assert torch.equal(model.to_tokens(texts, padding_side="right"), right)  # a call's own side wins
    logits = model(texts)
    alone = model("ab")
    torch.testing.assert_close(logits[0, -3:], alone[0], rtol=1e-5, atol=1e-5)  # padding masked
    with pytest.raises(ValueError, match=r"^padding_side must be 'right' or 'left', got 'middle'$"):
        model.tokenizer.padding_side = "middle"


def test_transformer_lens_attention_mask_reads_the_byte_tokenizer():
    """`transformer_lens.utils.get_attention_mask(model.tokenizer, tokens, prepend_bos)` (EAP-IG's
    tokenize_plus) reads `padding_side` and the pad id off our tokenizer and agrees with our mask."""
    pytest.importorskip("transformer_lens")
    try:
        from transformer_lens.utils import get_attention_mask
    except ImportError:
        from transformer_lens.utilities.tokenize_utils import get_attention_mask
    model = build(small(d_vocab=257, prepend_bos=True))
    model.tokenizer = ByteTokenizer()
    texts = ["a", "abc", "ab"]
    for side in ("right", "left"):
        model.tokenizer.padding_side = side
        toks = model.to_tokens(texts, prepend_bos=True)
        assert torch.equal(get_attention_mask(model.tokenizer, toks, True), model.to_text_mask(texts))


def test_byte_tokenizer_padding_side_is_saved(tmp_path):
    tok = ByteTokenizer()
    tok.save_pretrained(tmp_path / "right")
    assert "padding_side" not in (tmp_path / "right" / "tokenizer.json").read_text()  # older files unchanged
    tok.padding_side = "left"
    tok.save_pretrained(tmp_path / "left")
    assert load_tokenizer(tmp_path / "left").padding_side == "left"
    assert load_tokenizer(tmp_path / "right").padding_side == "right"
