"""QK attribution in SAE features (`qk_attribution(..., sae=)`, `interp.analyses.circuits.qk_features`): with a
residual-stream SAE at the stream a head reads, the senders are its features (`F{index}`), the rest of them
(`other_features`), `b_dec`, `error` and `bias`, and the terms still add up to the score the model computed (read
from a plain run's hook_attn_scores, not from the decomposition's own run) on our configs, every native family
and the zoo's attn-only-2l; one (feature, feature) term written out by hand; every kind of SAE writing the stream;
the features shown being those of largest summed |term|; the contrast and the corrupted change as without an SAE;
the cached runs and an offloaded model giving what a fresh run gives; the one-line refusals of an SAE at the wrong
place or width."""

from __future__ import annotations


import pytest
import torch

import interp
from interp.analyses.circuits import Runner
from interp.analyses.circuits.qk import qk_attribution
from interp.analyses.circuits.qk_features import Features, sender_values, split_stream
from interp.models.saes import SAE, SAEConfig

from arch_cases import ARCHITECTURES, builder, native_case
from core_models import OWN_CONFIGS, build, rope_by_hand, whole_and_offloaded
from circuit_tasks import random_task

NATIVE = [t for t in ARCHITECTURES if native_case(t) is not None]
NAMED = ("other_features", "b_dec", "error", "bias")


def random_sae(hook: str, d_in: int, d_sae: int, seed: int = 0, architecture: str = "standard", like=None,
               **cfg) -> SAE:
    """An SAE with random weights (many features fire; a poor reconstruction, so the error is large). With `like`
    (activations [..., d_in]), of the stream's size: encoder inputs of order one, a reconstruction as long as the
    stream (random weights of unit scale on a stream of norm 0.1 or 100 write it as terms far larger than the
    score, which then cancel: exact only to float32 round-off of those)."""
    sae = SAE(SAEConfig(architecture=architecture, d_in=d_in, d_sae=d_sae, hook_name=hook, **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if like is not None:
            x = like.detach().reshape(-1, d_in).to(sae.dtype)
            n = float(x.norm(dim=-1).mean())
            sae.W_enc.mul_(1 / (0.3 * n))
            sae.b_dec.mul_(n / d_in ** 0.5)
            sae.W_dec.mul_(n / float((sae.encode(x) @ sae.W_dec).norm(dim=-1).mean().clamp(min=1e-12)))
    return sae


def stream(model, tokens, layer: int) -> torch.Tensor:
    name = f"blocks.{layer}.hook_resid_pre"
    with torch.no_grad():
        return model.run_with_cache(tokens, names_filter=lambda n: n == name)[1][name]


def plain_scores(model, tokens, layer: int, head: int) -> torch.Tensor:
    """The head's scores [batch, q, k] from an ordinary run (capped, with ALiBi, masked -inf)."""
    name = f"blocks.{layer}.attn.hook_attn_scores"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    return cache[name][:, head].double()


def check_sums(model, sae, layer: int, head: int, tokens, query, **kw):
    """The decomposition in features at `query` (one position per row) against an ordinary run: the terms (+ ALiBi)
    give the score (soft-capped: the cap of their sum), the contrast terms the score less its mean over the
    visible keys; the senders named as the docstring says."""
    qk = qk_attribution(model, tokens, layer, head, query, sae=sae, **kw)
    scores = plain_scores(model, tokens, layer, head)
    alibi = qk.alibi.double() if qk.alibi is not None else 0
    total = qk.terms.double().sum((-1, -2)) + alibi  # [N, K]
    cap = model.blocks[layer].attn.softcap
    big = max(1.0, float(total.abs().max()))
    want = torch.stack([scores[r, i, qk.key_pos[r]] for r, i in enumerate(query)])
    got = cap * torch.tanh((total - alibi) / cap) + alibi if cap is not None else total
    torch.testing.assert_close(got, want, atol=2e-5 * big, rtol=1e-5)
    if cap is None:
        rows = [scores[r, i, :i + 1] for r, i in enumerate(query)]
        mean = torch.stack([row[torch.isfinite(row)].mean() for row in rows])[:, None]
        c_alibi = qk.alibi_contrast.double() if qk.alibi is not None else 0
        contrast = qk.contrast.double().sum((-1, -2)) + c_alibi
        torch.testing.assert_close(contrast, want - mean, atol=2e-5 * big, rtol=1e-5)
    assert qk.max_error <= 2e-5 * big and qk.contrast_max_error <= 2e-5 * big
    assert tuple(qk.terms.shape[-2:]) == (len(qk.query_senders), len(qk.key_senders))
    d_sae = sae.cfg.d_sae if isinstance(sae, SAE) else sae.sae.cfg.d_sae
    for senders in (qk.query_senders, qk.key_senders):
        assert tuple(senders[-4:]) == NAMED
        assert all(s[0] == "F" and 0 <= int(s[1:]) < d_sae for s in senders[:-4])
    assert qk.sae_hook == (sae if isinstance(sae, SAE) else sae.sae).cfg.hook_name
    return qk


def last_head(model, d_sae: int | None = None, seed: int = 0):
    """The last layer's last head, a random SAE at the stream it reads (width d_model, of the stream's size) and
    two prompts."""
    cfg = model.cfg
    layer = cfg.n_layers - 1
    tokens = torch.randint(cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    sae = random_sae(f"blocks.{layer}.hook_resid_pre", cfg.d_model, d_sae or 2 * cfg.d_model, seed,
                     like=stream(model, tokens, layer))
    return layer, cfg.n_heads - 1, sae, tokens


@pytest.mark.parametrize("name", sorted(OWN_CONFIGS))
def test_terms_in_features_add_up_to_the_score_on_our_configs(name):
    model = build(OWN_CONFIGS[name])
    layer, head, sae, tokens = last_head(model)
    qk = check_sums(model, sae, layer, head, tokens, [7, 5])
    assert len(qk.query_senders) == 8 + 4 == qk.terms.shape[-2] and qk.terms.shape[-1] == len(qk.key_senders)


@pytest.mark.parametrize("model_type", NATIVE)
def test_terms_in_features_add_up_to_the_score_on_every_native_family(model_type):
    model = interp.from_hf(builder(model_type)())
    layer, head, sae, tokens = last_head(model, d_sae=model.cfg.d_model)
    check_sums(model, sae, layer, head, tokens, [7, 5], top_keys=2)


@pytest.mark.parametrize("kind", ["topk-rescaled", "jumprelu", "gated", "constant_norm_rescale", "layer_norm"])
def test_every_kind_of_sae_writes_the_stream_and_the_terms_add_up(kind):
    """The senders' values (shown features, the others, b_dec, error) add up to the stream the SAE read, and the
    shown features with the others and b_dec to the SAE's own reconstruction, whatever its activation or its
    normalisation of the input."""
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    d = model.cfg.d_model
    kw = {"topk-rescaled": dict(architecture="topk", k=5, rescale_acts_by_decoder_norm=True),
          "jumprelu": dict(architecture="jumprelu"), "gated": dict(architecture="gated")}.get(
        kind, dict(normalize_activations=kind))
    sae = random_sae("blocks.0.hook_resid_post", d, 3 * d, seed=4, **kw)
    tokens = torch.randint(model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.hook_resid_pre")
        x = cache["blocks.1.hook_resid_pre"]
        values = sender_values(split_stream(sae, x), [3, 0, 7])
        torch.testing.assert_close(values.sum(0), x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[:-1].sum(0), sae(x), atol=1e-5, rtol=1e-5)
    qk = check_sums(model, sae, 1, 2, tokens, [7, 6], key_pos=[1, 4], corrupted=tokens.flip(1))
    other_sae = random_sae("blocks.1.hook_resid_pre", d, 50, seed=9)
    other = check_sums(model, other_sae, 1, 2, tokens, [7, 6], key_pos=[1, 4])
    # bias x bias is the norms' and projections' constants alone, whatever the SAE: it took none of the stream
    torch.testing.assert_close(qk.terms[..., -1, -1], other.terms[..., -1, -1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa"])
def test_one_feature_pair_written_out_by_hand(name):
    """The top query-side feature at the query x the top key-side feature at the key, on layer 1's head 3 (for GQA
    its KV head is 1): the activation written out (SAELens's standard SAE), times its W_dec row, ln1 with the
    clean run's scale (LayerNorm: centred, times w; no b: a constant, the bias sender's), W_Q / W_K (no b_Q, b_K),
    RoPE at the query's and the key's positions, the attention scale."""
    model = build(OWN_CONFIGS[name])
    cfg, attn = model.cfg, model.blocks[1].attn
    sae = random_sae("blocks.1.hook_resid_pre", cfg.d_model, 3 * cfg.d_model, seed=2)
    tokens = torch.randint(cfg.d_vocab, (1, 7), generator=torch.Generator().manual_seed(3))
    i, j, h = 6, 2, 3
    qk = qk_attribution(model, tokens, 1, h, i, key_pos=[j], sae=sae)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    resid = cache["blocks.1.hook_resid_pre"][0].double()
    W_enc, b_enc, W_dec, b_dec = (p.detach().double() for p in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
    acts = torch.relu((resid - b_dec) @ W_enc + b_enc)  # [pos, d_sae]
    f, g = int(qk.query_senders[0][1:]), int(qk.key_senders[0][1:])

    def norm_linear(x, p):  # ln1's linear part with the scale frozen at the run's
        ln = model.blocks[1].ln1
        if cfg.normalization == "layernorm":
            c = resid[p] - resid[p].mean()
            return (x - x.mean()) / (c.pow(2).mean() + ln.eps).sqrt() * ln.w.double()
        return x / (resid[p].pow(2).mean() + ln.eps).sqrt() * ln.w.double()

    def rope(v, p):
        return rope_by_hand(v, p, cfg)

    kv = h // (cfg.n_heads // cfg.kv_heads)
    q = rope(norm_linear(acts[i, f] * W_dec[f], i) @ attn.W_Q[h].double(), i)
    k = rope(norm_linear(acts[j, g] * W_dec[g], j) @ attn.W_K[kv].double(), j)
    by_hand = float((q @ k).detach()) * attn.scale
    assert qk.kv_head == kv
    assert float(qk.terms[0, 0, 0, 0]) == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
    assert abs(by_hand) > 1e-3  # not a vacuous zero


def test_the_features_shown_are_those_of_largest_summed_abs_term():
    """Each side shows its `top` features by |term| summed over the other side's senders and every key decomposed:
    the order read from a run that shows every feature it can (the whole pair matrix) is the one chosen; a feature
    off wherever its side was decomposed is not shown."""
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    layer, head, sae, tokens = last_head(model, d_sae=24, seed=6)
    every = qk_attribution(model, tokens, layer, head, [7, 6], top_keys=2, sae=Features(sae, top=24))
    top = qk_attribution(model, tokens, layer, head, [7, 6], top_keys=2, sae=Features(sae, top=3))
    mass = every.terms.double().abs().sum((0, 1))  # [Sq, Sk]
    for shown, senders, m in ((top.query_senders, every.query_senders, mass.sum(1)),
                              (top.key_senders, every.key_senders, mass.sum(0))):
        features = [i for i, s in enumerate(senders) if s.startswith("F")]
        best = sorted(features, key=lambda i: -float(m[i]))[:3]
        assert shown[:3] == [senders[i] for i in best] and len(features) > 6
        assert all(float(m[i]) > 0 for i in features)  # a feature off at every query (or key) is never shown
    assert len(every.query_senders) - 4 < 24


def test_the_contrast_and_the_corrupted_change_are_those_of_the_head_level_split():
    """In features as in the graph's senders: the changes of term add up to the change of score, their
    first-order shares to the first-order change of the weight, and that (a function of the score alone) and
    the true change are the head-level decomposition's."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model, n=3, p=9)
    sae = random_sae("blocks.0.hook_resid_post", model.cfg.d_model, 64, seed=5)
    kw = dict(rows=task.rows, corrupted=task.corrupted, top_keys=4)
    feats = qk_attribution(model, task.clean, 1, 1, task.positions, sae=Features(sae, top=5), **kw)
    heads = qk_attribution(model, task.clean, 1, 1, task.positions, **kw)
    assert len(feats.query_senders) == 5 + 4 and feats.delta_max_error < 1e-5
    torch.testing.assert_close(feats.weight_change.double().sum((-1, -2)), feats.weight_first_order.double(),
                               atol=1e-7, rtol=1e-5)
    for field in ("weight_first_order", "weight_true", "score", "contrast_score", "pattern"):
        torch.testing.assert_close(getattr(feats, field), getattr(heads, field), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(feats.delta.double().sum((-1, -2)), heads.delta.double().sum((-1, -2)), atol=2e-5,
                               rtol=1e-5)
    assert float(feats.weight_true.abs().max()) > 1e-4
    # bias holds the constants alone, the same in both runs (LayerNorm's b, b_Q, b_K; no QK-norm, no rotation)
    assert float(feats.delta[..., -1, -1].abs().max()) < 1e-5 < float(feats.terms[..., -1, -1].abs().max())


def test_the_frame_and_the_pairs_read_features_and_still_add_up():
    """The frame's columns are the head-level ones; its terms add up to each score; the pairs table holds every
    shown pair (b_dec and error among them, on both sides); with top=0 no feature is shown, their sum is."""
    model = build(OWN_CONFIGS["alibi-6heads"])
    layer, head, sae, tokens = last_head(model)
    qk = check_sums(model, Features(sae, top=3), layer, head, tokens, [7, 7], key_pos=[0, 2, 5])
    f = qk.frame
    assert list(f.columns) == ["prompt", "query_pos", "key_pos", "query_sender", "key_sender", "term", "contrast_term"]
    assert len(f) == 2 * 3 * (7 * 7 + 1)  # 2 prompts x 3 keys x (3 features + 4) squared, and ALiBi's term
    sums = f.groupby(["prompt", "key_pos"]).term.sum().to_numpy()
    torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), qk.score.double().flatten(), atol=1e-4,
                               rtol=1e-5)
    pairs = qk.pairs()
    assert len(pairs) == 7 * 7 + 1 and {"b_dec", "error"} <= set(pairs.query_sender) & set(pairs.key_sender)
    assert pairs.mean_term.sum() == pytest.approx(float(qk.score.double().mean()), abs=1e-4)
    none = qk_attribution(model, tokens, layer, head, [7, 7], key_pos=[0, 2, 5], sae=Features(sae, top=0))
    assert none.query_senders == list(NAMED) == none.key_senders
    torch.testing.assert_close(none.terms.sum((-1, -2)), qk.terms.sum((-1, -2)), atol=1e-5, rtol=1e-5)


def test_attn_only_2l_with_a_residual_sae_at_either_name_of_its_stream():
    """The zoo's attn-only-2l, L1H0 on repeated random tokens (its induction keys among the top ones), with a
    random SAE of 512 features: exact against the plain run; `blocks.1.hook_resid_pre` and
    `blocks.0.hook_resid_post` name the same stream, so the same terms."""
    model = interp.load("attn-only-2l")
    g = torch.Generator().manual_seed(0)
    half = torch.randint(1, model.cfg.d_vocab, (3, 10), generator=g)
    tokens = torch.cat([torch.zeros(3, 1, dtype=torch.long), half, half], 1)
    x = stream(model, tokens, 1)
    pre = random_sae("blocks.1.hook_resid_pre", model.cfg.d_model, 512, seed=1, like=x)
    post = random_sae("blocks.0.hook_resid_post", model.cfg.d_model, 512, seed=1, like=x)
    a = check_sums(model, pre, 1, 0, tokens, [20, 18, 15], corrupted=tokens.flip(1), batch_size=2)
    b = check_sums(model, post, 1, 0, tokens, [20, 18, 15], corrupted=tokens.flip(1), batch_size=2)
    assert a.query_senders == b.query_senders and a.key_senders == b.key_senders
    for field in ("terms", "contrast", "delta", "weight_change"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field))
    assert a.delta_max_error < 1e-4 and b.sae_hook == "blocks.0.hook_resid_post"


def test_the_runs_given_by_a_cache_give_what_a_fresh_run_gives():
    """`given` (a Runner's cache: only the head's block runs again) reads the cached stream; over chunks of
    prompts the features shown are chosen over all of them."""
    model = build(OWN_CONFIGS["gemma3-like"])
    task = random_task(model, n=5, p=8)
    layer = model.cfg.n_layers - 1
    sae = random_sae(f"blocks.{layer}.hook_resid_pre", model.cfg.d_model, 64, seed=3)
    name = f"blocks.{layer}.hook_resid_pre"
    with torch.no_grad():
        resid = {w: model.run_with_cache(t, names_filter=lambda n: n == name)[1][name]
                 for w, t in (("clean", task.clean), ("corrupted", task.corrupted))}
    kw = dict(rows=task.rows, corrupted=task.corrupted, sae=sae)
    cached = qk_attribution(model, task.clean, layer, 1, task.positions, batch_size=2,
                            given=lambda which, part: (None, resid[which][part]), **kw)
    fresh = qk_attribution(model, task.clean, layer, 1, task.positions, batch_size=5, **kw)
    assert cached.query_senders == fresh.query_senders and cached.key_senders == fresh.key_senders
    for field in ("terms", "contrast", "score", "delta", "weight_change"):
        torch.testing.assert_close(getattr(cached, field), getattr(fresh, field), atol=5e-5, rtol=1e-4)


def test_the_runner_passes_its_sae_on():
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model, n=3, p=8)
    sae = random_sae("blocks.1.hook_resid_pre", model.cfg.d_model, 64)
    cached = Runner(model, task).qk_attribution("L1H2", sae=sae)
    fresh = qk_attribution(model, task.clean, 1, 2, task.positions, rows=task.rows, corrupted=task.corrupted, sae=sae)
    assert cached.query_senders == fresh.query_senders and cached.sae_hook == "blocks.1.hook_resid_pre"
    torch.testing.assert_close(cached.terms, fresh.terms, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("sae, says", [
    (dict(hook="blocks.1.attn.hook_z"), "this SAE reads attention's z (blocks.1.attn.hook_z); layer 1's heads read "
     "the residual stream at blocks.1.hook_resid_pre (or blocks.0.hook_resid_post)"),
    (dict(d_in=24), "this SAE reads d_in=24, but the residual stream at blocks.1.hook_resid_pre has width d_model=40"),
    (dict(hook="blocks.0.hook_resid_pre"), "this SAE is at blocks.0.hook_resid_pre; layer 1's heads read the residual "
     "stream at blocks.1.hook_resid_pre (or blocks.0.hook_resid_post)"),
    (dict(hook="blocks.1.hook_resid_post"), "this SAE is at blocks.1.hook_resid_post; layer 1's heads read"),
    (dict(hook=None), "this SAE names no hook (cfg.hook_name); layer 1's heads read"),
    (dict(top=-1), "Features(top=...): how many features to show on each side, 0 or more; got -1"),
])
def test_an_sae_at_the_wrong_place_or_width_is_refused_in_one_line_before_any_run(sae, says, monkeypatch):
    model = build(OWN_CONFIGS["learned-layernorm"])
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("ran"))
    made = random_sae(sae.get("hook", "blocks.1.hook_resid_pre"), sae.get("d_in", model.cfg.d_model), 16)
    with pytest.raises(ValueError) as e:
        qk_attribution(model, torch.zeros(2, 7, dtype=torch.long), 1, 0, 3, sae=Features(made, top=sae.get("top", 8)))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_offloaded_model_gives_what_the_whole_model_gives(tmp_path):
    whole, offloaded, tokens = whole_and_offloaded(tmp_path / "m")
    sae = random_sae("blocks.0.hook_resid_post", whole.cfg.d_model, 64, like=stream(whole, tokens, 1))
    a = qk_attribution(whole, tokens, 1, 2, 7, corrupted=tokens.flip(1), sae=sae)
    b = qk_attribution(offloaded, tokens, 1, 2, 7, corrupted=tokens.flip(1), sae=sae)
    assert a.query_senders == b.query_senders and a.key_senders == b.key_senders
    for field in ("terms", "contrast", "score", "weight_change"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field))


def _residual_sae_folder(folder, hook: str, d_in: int, seed: int = 0) -> str:
    random_sae(hook, d_in, 64, seed=seed).save_model(folder)
    return str(folder)


def test_the_command_splits_qk_in_the_features_of_a_residual_sae(tmp_path):
    """`interp circuit --qk L1H0 --sae RESIDUAL`: the qk table's senders are the SAE's (F{index}, b_dec, error), the
    terms still add up to the score, and settings.json names the SAE's hook; the circuit graph stays the heads'."""
    from interp.analyses.store import read_table
    from interp.cli import main as cli

    sae = _residual_sae_folder(tmp_path / "sae", "blocks.0.hook_resid_post", 128)  # attn-only-2l: d_model 128
    out = tmp_path / "out"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "2", "--method", "eap", "--qk", "L1H0",
                "--sae", sae, "--no-progress", "--out", str(out)]) == 0
    qk = read_table(out, "qk")
    senders = set(qk.query_sender) | set(qk.key_sender)
    assert {"b_dec", "error"} <= senders and any(s.startswith("F") and s[1:].isdigit() for s in senders)
    assert not any(s.startswith("L0H") for s in senders)  # the heads' outputs are inside the features and error
    record = __import__("json").loads((out / "settings.json").read_text())
    assert record["qk"][0]["sae_hook"] == "blocks.0.hook_resid_post" and record["qk"][0]["max_abs_error"] < 1e-3
    assert record["saes"] is None  # the graph took no SAE: the residual one served --qk alone
    assert "the features of the SAE at blocks.0.hook_resid_post" in (out / "report.md").read_text()


# (a residual SAE no --qk head reads is no longer refused: it cuts the circuit graph's stream instead,
# tests/analyses/circuits/test_circuit_resid_features.py)
@pytest.mark.parametrize("argv, says", [
    (["--qk", "L1H0", "--sae", "{sae},{sae2}"], "are both at the stream layer 1's heads read: give one"),
    (["--qk", "L1H0", "--sae", "{narrow}"], "reads d_in=64, but the residual stream has width d_model=128"),
])
def test_bad_residual_saes_for_qk_are_refused_before_loading(tmp_path, capsys, monkeypatch, argv, says):
    from interp.cli import main as cli

    sae = _residual_sae_folder(tmp_path / "sae", "blocks.0.hook_resid_post", 128)
    sae2 = _residual_sae_folder(tmp_path / "sae2", "blocks.1.hook_resid_pre", 128, seed=1)
    narrow = _residual_sae_folder(tmp_path / "narrow", "blocks.1.hook_resid_pre", 64, seed=2)
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    argv = [a.format(sae=sae, sae2=sae2, narrow=narrow) for a in argv]
    assert cli(["circuit", "attn-only-2l", "--task", "induction", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "x").exists()
