"""TransformerLens interop: its own utilities give the same numbers on our model as on its bridge.

Every comparison runs TransformerLens 4's code unchanged (`head_detector.detect_head`, the
`patching` sweeps, its `ActivationCache` helpers) on two models holding one set of weights: a
random-init `transformers` model from `hf_cases.py` (GPT-2, and Llama with GQA: 6 query heads
sharing 2 kv-heads) converted with `interp.from_hf`, and the same model booted into a
`TransformerBridge` (`interp.interop.bridge_from_hf`: no download, no weight processing). Both
keep their defaults: text gets BOS first on both sides (TransformerLens's convention, which ours
follows: `cfg.default_prepend_bos`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest
import torch

tl = pytest.importorskip("transformer_lens")
pytest.importorskip("transformers")

import interp  # noqa: E402
import interp.analyses  # noqa: E402
from hf_cases import VOCAB, build_hf  # noqa: E402, F401
from interp.interop import bridge_from_hf, conforms, to_tl_cache  # noqa: E402, F401
from smol import smollm2_hf  # noqa: E402
from tl_pairs import CASES, CLEAN, CORRUPTED, TEXT, TOL, close, metric, pair, tokenizer  # noqa: E402
from transformer_lens import patching  # noqa: E402
from transformer_lens.head_detector import detect_head  # noqa: E402

# ---- the protocol --------------------------------------------------------------------------------
# What TransformerLens's utilities read from model.cfg (patching, head_detector, ActivationCache).
TL_CFG = [
    "n_layers", "n_heads", "d_model", "d_vocab", "d_vocab_out", "n_ctx", "d_mlp", "act_fn", "attn_only",
    "n_key_value_heads", "normalization_type", "final_rms", "positional_embedding_type", "parallel_attn_mlp",
    "eps", "device", "dtype", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "n_devices",
    "default_prepend_bos",
]


@pytest.mark.parametrize("name", CASES)
def test_our_model_is_a_transformer_lens_model(name):
    ours, bridge = pair(name)
    assert conforms(ours, weights=False) and conforms(ours, weights=True)
    assert conforms(bridge)  # the check itself accepts TransformerLens's own model
    assert isinstance(ours, tl.model_protocol.TransformerLensModelWithWeights)
    for attr in TL_CFG:
        assert getattr(ours.cfg, attr) == getattr(bridge.cfg, attr), attr
    assert ours.cfg.head_dim == bridge.cfg.d_head
    assert ours.cfg.default_prepend_bos is True  # TransformerLens's convention: BOS first


def test_cfg_device_and_dtype_follow_the_model():
    cfg = interp.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, d_mlp=32)
    with pytest.raises(AttributeError, match="not held by a model"):
        cfg.device
    a, b = interp.HookedTransformer(cfg), interp.HookedTransformer(cfg)
    assert (a.cfg.device, a.cfg.dtype) == ("cpu", torch.float32)
    b.to(torch.float64)
    assert b.cfg.dtype == torch.float64 and a.cfg.dtype == torch.float32  # a shared config is not mutated
    assert a.cfg == cfg == b.cfg and hash(b.cfg) == hash(cfg)
    assert "device" not in b.cfg.to_dict() and "dtype" not in json.loads(b.cfg.to_json())
    assert interp.ModelConfig.from_json(b.cfg.to_json()) == cfg
    with pytest.raises(AttributeError):
        b.cfg.n_layers = 3  # still frozen


# ---- hooks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_every_shared_hook_matches_the_bridge(name):
    """Same names, same shapes (k/v over kv-heads under GQA), same values.

    Two known differences, excluded here: `ln*.hook_normalized` (the bridge hooks the normalised
    input before the norm's weight and bias, we hook the norm's output), and the masked entries of
    `hook_attn_scores` (-inf here, float32's lowest there), compared on the causal triangle only."""
    ours, bridge = pair(name)
    tokens = ours.to_tokens(CLEAN)
    _, ca = ours.run_with_cache(tokens)
    _, cb = bridge.run_with_cache(tokens)
    shared = [k for k in ca.keys() if k in cb.cache_dict and not k.endswith("hook_normalized")]
    assert len(shared) >= 14 * ours.cfg.n_layers
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    for k in shared:
        a, b = ca[k], cb[k]
        if k.endswith("hook_attn_scores"):
            a, b = a[..., causal], b[..., causal]
        close(a, b)
    kv = ours.cfg.kv_heads
    assert ca["k", 0].shape == cb["k", 0].shape == (2, tokens.shape[1], kv, ours.cfg.head_dim)


# ---- head_detector -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("head", ["previous_token_head", "duplicate_token_head", "induction_head"])
def test_detect_head_matches_the_bridge(name, head):
    ours, bridge = pair(name)
    a, b = detect_head(ours, TEXT, head), detect_head(bridge, TEXT, head)
    close(a, b)
    assert a.shape == (ours.cfg.n_layers, ours.cfg.n_heads) and (a > -1).all() and a.std() > 0
    kw = dict(error_measure="abs", exclude_bos=True, exclude_current_token=True)
    close(detect_head(ours, TEXT, head, **kw), detect_head(bridge, TEXT, head, **kw))
    # Our cache is accepted where theirs is.
    _, cache = ours.run_with_cache(ours.to_tokens(TEXT), remove_batch_dim=True)
    close(detect_head(ours, TEXT, head, cache=cache), b)


# ---- patching ------------------------------------------------------------------------------------
SWEEPS = ["get_act_patch_attn_head_out_all_pos", "get_act_patch_resid_pre", "get_act_patch_attn_head_all_pos_every"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("sweep", SWEEPS)
def test_patching_sweeps_match_the_bridge(name, sweep):
    ours, bridge = pair(name)
    clean, corrupted = ours.to_tokens(CLEAN), ours.to_tokens(CORRUPTED)
    assert torch.equal(clean, bridge.to_tokens(CLEAN))
    with torch.no_grad():
        _, cache_ours = ours.run_with_cache(clean)
        _, cache_bridge = bridge.run_with_cache(clean)
        fn = getattr(patching, sweep)
        a, b = fn(ours, corrupted, cache_ours, metric), fn(bridge, corrupted, cache_bridge, metric)
        close(a, b)
        assert a.abs().max() > 1e-3  # the patches do move the metric
        if sweep == "get_act_patch_attn_head_out_all_pos":
            close(fn(ours, corrupted, to_tl_cache(cache_ours), metric), b)  # their cache class on ours
            ra = fn(ours, corrupted, cache_ours, lambda lg: lg[:, -1, 9] - lg[:, -1, 3], reduce="none", baseline=True)
            rb = fn(bridge, corrupted, cache_bridge, lambda lg: lg[:, -1, 9] - lg[:, -1, 3], reduce="none", baseline=True)
            close(ra.values, rb.values)
            close(ra.baseline, rb.baseline)
    if sweep == "get_act_patch_attn_head_all_pos_every" and ours.cfg.kv_heads < ours.cfg.n_heads:
        assert a[2:4, :, ours.cfg.kv_heads:].abs().max() == 0  # k/v sweeps over kv-heads, zero-padded


# ---- ActivationCache helpers ---------------------------------------------------------------------
CACHE_CALLS = [
    ("stack_head_results", {}),
    ("stack_head_results", dict(layer=1, return_labels=True)),
    ("stack_head_results", dict(apply_ln=True, incl_remainder=True, pos_slice=-1)),
    ("stack_head_results", dict(apply_ln=True, pos_slice=(2, 5))),
    ("decompose_resid", {}),
    ("decompose_resid", dict(apply_ln=True, return_labels=True)),
    ("decompose_resid", dict(layer=1, mlp_input=True, mode="attn")),
    ("decompose_resid", dict(layer=1, mlp_input=True, apply_ln=True, mode="mlp", return_labels=True)),
    ("decompose_resid", dict(incl_embeds=False, pos_slice=[0, 3], apply_ln=True)),
    ("accumulated_resid", {}),
    ("accumulated_resid", dict(apply_ln=True)),
    ("accumulated_resid", dict(layer=1, incl_mid=True, apply_ln=True, return_labels=True)),
    ("accumulated_resid", dict(layer=1, mlp_input=True, apply_ln=True, return_labels=True)),
    ("accumulated_resid", dict(incl_mid=True, pos_slice=-1, return_labels=True)),
    ("get_full_resid_decomposition", dict(expand_neurons=False, apply_ln=True, return_labels=True)),
    ("get_full_resid_decomposition", dict(expand_neurons=True, apply_ln=True, pos_slice=-1, return_labels=True)),
    ("get_full_resid_decomposition", dict(layer=1, mlp_input=True, expand_neurons=False, return_labels=True)),
    ("stack_neuron_results", dict(layer=2, return_labels=True, incl_remainder=True)),
    ("stack_neuron_results", dict(layer=1, apply_ln=True, neuron_slice=(0, 7), pos_slice=-1)),
    ("stack_activation", dict(activation_name="pattern")),
    ("stack_activation", dict(activation_name="scale", sublayer_type="ln2")),
]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_activation_cache_arithmetic_matches_the_bridge(name, processed):
    """Our own ActivationCache (no conversion) gives TransformerLens's numbers and labels for its
    residual-stream arithmetic, on raw weights and on weights processed on both sides (where the
    apply_ln approximations are the ones TransformerLens intends)."""
    hf = build_hf(name)
    ours = interp.from_hf(hf, tokenizer=tokenizer(), **(PROCESSED if processed else {}))
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    if processed:
        bridge.enable_compatibility_mode(disable_warnings=True)
    tokens = ours.to_tokens(CLEAN)
    _, a = ours.run_with_cache(tokens)
    _, b = bridge.run_with_cache(tokens)
    assert isinstance(a, interp.ActivationCache)
    for method, kw in CACHE_CALLS:
        x, y = getattr(a, method)(**kw), getattr(b, method)(**kw)
        if kw.get("return_labels"):
            assert x[1] == y[1], method
            x, y = x[0], y[0]
        close(x, y, TOL * max(1.0, y.abs().max().item()))
    direction = torch.randn(ours.cfg.d_model, generator=torch.Generator().manual_seed(1))
    kw = dict(expand_neurons=False, apply_ln=True, project_output_onto=direction)
    close(a.get_full_resid_decomposition(**kw), b.get_full_resid_decomposition(**kw))
    stack_a, stack_b = a.decompose_resid(), b.decompose_resid()
    tok, wrong = torch.tensor([9, 4]), torch.tensor([3, 5])
    close(a.logit_attrs(stack_a, tok, incorrect_tokens=wrong), b.logit_attrs(stack_b, tok, incorrect_tokens=wrong))
    close(a.logit_attrs(stack_a, "w9", incorrect_tokens="w3"), b.logit_attrs(stack_b, "w9", incorrect_tokens="w3"))
    close(a.logit_attrs(stack_a[:, :, -1], tok, pos_slice=-1), b.logit_attrs(stack_b[:, :, -1], tok, pos_slice=-1))
    per_pos = tokens[:, 1:].cpu()
    close(a.logit_attrs(stack_a[:, :, :-1], per_pos, pos_slice=(0, -1)),
          b.logit_attrs(stack_b[:, :, :-1], per_pos, pos_slice=(0, -1)))
    with pytest.raises(ValueError, match="same shape"):
        a.logit_attrs(stack_a, tok, incorrect_tokens=torch.tensor([3]))
    # The final ln's logit lens reproduces the logits (processed: up to the unembedding's bias).
    if processed:
        lens = a.accumulated_resid(apply_ln=True)[-1] @ ours.W_U
        if ours.unembed.b_U is not None:
            lens = lens + ours.unembed.b_U
        close(lens, ours(tokens), 1e-4)


def test_tl_cache_type_and_conversion_still_work():
    ours, bridge = pair("gpt2")
    tokens = ours.to_tokens(CLEAN)
    _, a = ours.run_with_cache(tokens, cache_type="transformer_lens")
    _, b = bridge.run_with_cache(tokens)
    assert isinstance(a, tl.ActivationCache)
    close(a.decompose_resid(apply_ln=True), b.decompose_resid(apply_ln=True))
    _, ours_cache = ours.run_with_cache(tokens)
    converted = to_tl_cache(ours_cache)
    close(converted.decompose_resid(apply_ln=True), b.decompose_resid(apply_ln=True))
    assert converted["resid_pre", 1] is ours_cache["resid_pre", 1]
    with pytest.raises(ValueError, match="cache_type"):
        ours.run_with_cache(tokens, cache_type="tl")


def test_model_helpers_match_the_bridge():
    ours, bridge = pair("gpt2")
    assert ours.to_single_token("w9") == bridge.to_single_token("w9") == 9
    for t in ("w9", 9, torch.tensor([9]), torch.tensor([[9, 4], [3, 5]])):
        close(ours.tokens_to_residual_directions(t), bridge.tokens_to_residual_directions(t))
    for layer, mlp_input in [(0, False), (1, False), (1, True), (2, False)]:
        close(ours.accumulated_bias(layer, mlp_input), bridge.accumulated_bias(layer, mlp_input))
    with pytest.raises(ValueError, match="not one"):
        ours.to_single_token("w9 w4")


# ---- from_transformer_lens -----------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("processed", [False, True], ids=["raw", "compatibility_mode"])
def test_from_transformer_lens(name, processed):
    hf = build_hf(name)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    assert all(torch.equal(before[k], v) for k, v in hf.state_dict().items())  # wrapped a copy
    if processed:  # folds LayerNorm, centres weights, folds value biases: edits the bridge's weights
        bridge.enable_compatibility_mode(disable_warnings=True)
    ours = interp.from_transformer_lens(bridge)
    assert ours.tokenizer is bridge.tokenizer
    tokens = ours.to_tokens(CLEAN)
    close(ours(tokens), bridge(tokens))
    _, ca = ours.run_with_cache(tokens, names_filter=lambda n: n.endswith(("resid_post", "hook_z")))
    _, cb = bridge.run_with_cache(tokens)
    for k in ca.keys():
        close(ca[k], cb[k])
    if not processed:  # the unprocessed bridge gives exactly interp.from_hf's model
        direct = interp.from_hf(hf)
        assert ours.cfg == direct.cfg
        for k, v in direct.state_dict().items():
            assert torch.equal(v, ours.state_dict()[k]), k
    elif name == "gpt2":  # folding ln_final into W_U unties it and creates b_U
        assert not ours.cfg.tie_embeddings and ours.cfg.unembed_bias


def test_from_transformer_lens_rejects_other_objects():
    with pytest.raises(TypeError, match="TransformerBridge"):
        interp.from_transformer_lens(build_hf("gpt2"))


# ---- optional dependency -------------------------------------------------------------------------
def test_transformer_lens_stays_optional():
    """Importing interp (and this module, and the benchmark) never imports transformer_lens; with it
    missing, the interop functions say how to install it."""
    code = (
        "import sys\n"
        "import interp, interp.interop, interp.benchmarks.patching, interp.models, interp.analyses, interp.loading\n"
        "assert 'transformer_lens' not in sys.modules, 'imported at module import time'\n"
        "sys.modules['transformer_lens'] = None\n"
        "cfg = interp.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4)\n"
        "m = interp.HookedTransformer(cfg)\n"
        "_, cache = m.run_with_cache(__import__('torch').tensor([[1, 2]]))\n"
        "try:\n"
        "    interp.interop.to_tl_cache(cache)\n"
        "except ImportError as e:\n"
        "    assert 'interp[tl]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-2000:]


# ---- the benchmark script ------------------------------------------------------------------------
def test_bench_patching_runs(capsys):
    from interp.benchmarks import patching as bench_patching

    assert bench_patching.main(["--shape", "tiny", "--seqs", "12", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "attn_head_out_all_pos" and cells[2] == "12" and cells[4] == "8"  # 2 layers x 4 heads
    assert float(cells[5]) > 0 and float(cells[6]) > 0 and float(cells[8]) < TOL


# ---- optional hook points ------------------------------------------------------------------------
SWITCHES = {
    "set_use_split_qkv_input": ["hook_q_input", "hook_k_input", "hook_v_input"],
    "set_use_attn_in": ["hook_attn_in"],
    "set_use_hook_mlp_in": ["hook_mlp_in"],
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_optional_hooks_match_the_bridge(name, switch):
    """Same names, shapes (k/v inputs per KV head under GQA) and values as the bridge's; patching
    through them gives the bridge's logits; switched off, the hook points are gone again."""
    ours, bridge = pair(name)
    base = ours(TEXT)
    getattr(ours, switch)(True)
    getattr(bridge, switch)(True)
    try:
        flag = {"set_use_split_qkv_input": "use_split_qkv_input", "set_use_attn_in": "use_attn_in",
                "set_use_hook_mlp_in": "use_hook_mlp_in"}[switch]
        assert getattr(ours.cfg, flag) is True and getattr(bridge.cfg, flag) is True
        close(ours(TEXT), base, 1e-5)  # the split path computes the same model
        _, ca = ours.run_with_cache(TEXT)
        _, cb = bridge.run_with_cache(TEXT)
        for l in range(ours.cfg.n_layers):
            for hook in SWITCHES[switch]:
                key = f"blocks.{l}.{hook}"
                close(ca[key], cb[key])
        kv = ours.cfg.kv_heads
        if switch == "set_use_split_qkv_input":
            assert ca["blocks.0.hook_k_input"].shape[2] == kv and ca["blocks.0.hook_q_input"].shape[2] == ours.cfg.n_heads
        # Patch one head's input on both sides with the same edit.
        hook = f"blocks.1.{SWITCHES[switch][-1]}"  # the value input: it moves the logits most directly
        noise = torch.randn(ours(TEXT).shape[1], ours.cfg.d_model, generator=torch.Generator().manual_seed(0))

        def edit(x, hook):
            x = x.clone()
            if x.dim() == 4:
                x[0, :, 1] += 3 * noise  # only (KV) head 1's copy
            else:
                x[0] += 3 * noise
            return x

        a = ours.run_with_hooks(TEXT, fwd_hooks=[(hook, edit)])
        b = bridge.run_with_hooks(TEXT, fwd_hooks=[(hook, edit)])
        close(a, b)
        assert (a - base).abs().max() > 1e-3
    finally:
        getattr(ours, switch)(False)
        getattr(bridge, switch)(False)
    assert not any(n.endswith(tuple(SWITCHES[switch])) for n in ours.hook_dict)
    with pytest.raises(KeyError, match=rf"exists only after model\.{switch}\(True\)"):
        ours.run_with_hooks(TEXT, fwd_hooks=[(f"blocks.0.{SWITCHES[switch][0]}", lambda x, hook: x)])


def test_patching_one_heads_query_input_changes_only_that_head():
    ours, _ = pair("llama-gqa")
    ours.set_use_split_qkv_input(True)
    try:
        _, clean = ours.run_with_cache(TEXT, names_filter=lambda n: n.endswith(("hook_q", "hook_k", "hook_v")))

        def patch(x, hook):
            x = x.clone()
            x[:, :, 4] = torch.randn_like(x[:, :, 4])
            return x

        with ours.hooks([("blocks.1.hook_q_input", patch)]):
            _, patched = ours.run_with_cache(TEXT, names_filter=lambda n: n.endswith(("hook_q", "hook_k", "hook_v")))
        dq = (patched["q", 1] - clean["q", 1]).abs().amax(dim=(0, 1, 3))
        assert dq[4] > 1e-3 and dq[torch.arange(6) != 4].max() == 0
        for name in ("k", "v"):
            assert torch.equal(patched[name, 1], clean[name, 1])
        assert torch.equal(patched["q", 0], clean["q", 0])
    finally:
        ours.set_use_split_qkv_input(False)
    with pytest.raises(ValueError, match="mutually exclusive"):
        ours.set_use_attn_in(True)
        ours.set_use_split_qkv_input(True)
    ours.set_use_attn_in(False)


def test_optional_hooks_off_keep_the_fused_path():
    """With every switch off, no layer leaves the fused kernel for a plain forward, and turning a
    switch on and off again leaves the same hook points as a fresh model."""
    ours, _ = pair("gpt2")
    names = list(ours.hook_dict)
    ours.set_use_split_qkv_input(True)
    ours.set_use_split_qkv_input(False)
    ours.set_use_hook_mlp_in(True)
    ours.set_use_hook_mlp_in(False)
    assert list(ours.hook_dict) == names
    assert not any(b.attn.instrumented_now() for b in ours.blocks)
    assert all(b.split_input is None and not b.mlp_in for b in ours.blocks)


# ---- weight processing ---------------------------------------------------------------------------
PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
PROCESS_CASES = ["gpt2", "llama-gqa", "neox", "llama-llama3-bias", "qwen2-window-layers", "llama-linear-tied"]


def compare_caches(ca, cb, tol=TOL):
    """Every activation both caches hold, equal (scores on the causal triangle); returns how many."""
    shared = [k for k in ca.keys() if k in cb.cache_dict]
    for k in shared:
        a, b = ca[k], cb[k]
        if k.endswith("hook_attn_scores"):
            keep = torch.isfinite(a)
            a, b = a[keep], b[keep]
        close(a, b, tol * max(1.0, b.abs().max().item()))
    return len(shared)


@pytest.mark.parametrize("name", PROCESS_CASES)
def test_processed_weights_match_the_bridge(name):
    """`from_hf(..., fold_ln, center_writing_weights, center_unembed, fold_value_biases)` gives the
    logits and every cached activation (hook_normalized included: folded norms only normalise) of the
    bridge after `enable_compatibility_mode()`; log-probs stay the unprocessed model's."""
    hf = build_hf(name)
    raw = interp.from_hf(hf, tokenizer=tokenizer())
    ours = interp.from_hf(hf, tokenizer=tokenizer(), **PROCESSED)
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True)
    close(ours(TEXT), bridge(TEXT))
    close(ours(TEXT).log_softmax(-1), raw(TEXT).log_softmax(-1), 1e-5)
    _, ca = ours.run_with_cache(TEXT)
    _, cb = bridge.run_with_cache(TEXT)
    assert compare_caches(ca, cb) >= 16 * ours.cfg.n_layers
    assert ours.cfg.normalization_type in ("LNPre", "RMSPre")
    for block in ours.blocks:  # the norms only normalise now
        assert torch.equal(block.ln1.w, torch.ones_like(block.ln1.w))
    if ours.cfg.normalization == "layernorm":  # centred writing weights, centred unembedding
        assert ours.W_E.mean(-1).abs().max() < 1e-6 and ours.W_O.mean(-1).abs().max() < 1e-6
    assert ours.W_U.mean(-1).abs().max() < 1e-6
    if raw.cfg.tie_embeddings:
        assert not ours.cfg.tie_embeddings  # folding ln_final into W_U unties it
    # The same on a loaded model, in place; and a processed model saves and loads as it is.
    again = interp.from_hf(hf, tokenizer=tokenizer()).process_weights_()
    close(again(TEXT), ours(TEXT), 1e-5)


def test_processed_model_saves_and_loads(tmp_path):
    hf = build_hf("gpt2")
    ours = interp.from_hf(hf, tokenizer=tokenizer(), **PROCESSED)
    ours.save(tmp_path / "processed")
    back = interp.load(tmp_path / "processed", tokenizer=tokenizer())
    assert back.cfg == ours.cfg and not back.cfg.tie_embeddings and back.cfg.unembed_bias
    close(back(TEXT), ours(TEXT), 1e-6)


def test_each_processing_step_keeps_log_probs():
    """Each step alone (and the refactoring) leaves log-probs; the ones that should, move logits."""
    hf = build_hf("gpt2")
    raw = interp.from_hf(hf, tokenizer=tokenizer())
    ref = raw(TEXT).log_softmax(-1)
    for step in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices"):
        model = interp.from_hf(hf, tokenizer=tokenizer(), **{step: True})
        close(model(TEXT).log_softmax(-1), ref, 1e-5)
    centred = interp.from_hf(hf, tokenizer=tokenizer(), center_unembed=True)
    assert (centred(TEXT) - raw(TEXT)).abs().max() > 1e-3  # logits shift by a constant per position


def test_refactored_attention_matches_the_bridge():
    """refactor_factored_attn_matrices: same logits, patterns, residual stream and z norms as the
    bridge's; the factors themselves match up to the sign of each singular vector."""
    hf = build_hf("gpt2")
    ours = interp.from_hf(hf, tokenizer=tokenizer(), **PROCESSED, refactor_factored_attn_matrices=True)
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True, refactor_factored_attn_matrices=True)
    close(ours(TEXT), bridge(TEXT))
    _, ca = ours.run_with_cache(TEXT)
    _, cb = bridge.run_with_cache(TEXT)
    for k in ("pattern", "resid_post", "attn_out"):
        for l in range(2):
            close(ca[k, l], cb[k, l])
    for k in ("q", "k", "v"):
        close(ca[k, 1].abs(), cb[k, 1].abs())
    close(ours.W_Q.abs(), bridge.W_Q.abs())
    close(ours.W_O.abs(), bridge.W_O.abs())


def test_processing_errors_name_the_fix():
    for name, pattern in (("llama-gqa", "rotary positions"), ("gpt2", None)):
        hf = build_hf(name)
        if pattern is None:
            continue
        with pytest.raises(ValueError, match=rf"{pattern}.*refactor_factored_attn_matrices=False"):
            interp.from_hf(hf, refactor_factored_attn_matrices=True)
    gqa = interp.ModelConfig(n_layers=1, d_model=16, n_heads=4, n_kv_heads=2, d_vocab=11, n_ctx=8, d_mlp=32)
    with pytest.raises(ValueError, match="share key/value heads"):
        interp.HookedTransformer(gqa).process_weights_(refactor_factored_attn_matrices=True)
    # Steps with nothing to act on are skipped, as TransformerLens skips them.
    bare = interp.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, normalization=None)
    model = interp.HookedTransformer(bare)
    before = model(torch.tensor([[1, 2, 3]])).log_softmax(-1)
    close(model.process_weights_()(torch.tensor([[1, 2, 3]])).log_softmax(-1), before, 1e-5)


@pytest.mark.slow
def test_smollm2_processed_matches_the_bridge_on_the_gguf():
    """The real model: SmolLM2-135M from its GGUF (ours) against TransformerLens's bridge over
    transformers' own GGUF loading, both processed with TransformerLens's defaults and both
    prepending BOS: same tokens, logits within 1e-4, activations within 1e-4 of their scale,
    TransformerLens's detect_head scores equal; log-probs equal the unprocessed model's."""
    import pydoc_data.topics

    hf, hf_tok = smollm2_hf()
    bridge = bridge_from_hf(hf, tokenizer=hf_tok, copy_model=False)
    bridge.enable_compatibility_mode(disable_warnings=True)
    ours = interp.load("smollm2-135m", **PROCESSED)
    text = pydoc_data.topics.topics["if"][:400]
    assert ours.cfg.default_prepend_bos and bridge.cfg.default_prepend_bos
    assert torch.equal(ours.to_tokens(text), bridge.to_tokens(text))
    with torch.no_grad():
        logits = ours(text)
        close(logits, bridge(text))
        raw = interp.load("smollm2-135m")
        close(logits.log_softmax(-1), raw(text).log_softmax(-1))
        names = lambda n: n.endswith(("resid_post", "hook_z", "hook_pattern", "hook_mlp_out"))  # noqa: E731
        _, ca = ours.run_with_cache(text, names_filter=names)
        _, cb = bridge.run_with_cache(text, names_filter=names)
        assert compare_caches(ca, cb) == 4 * 30
    close(detect_head(ours, text, "previous_token_head"), detect_head(bridge, text, "previous_token_head"))


@pytest.mark.parametrize("name", CASES)
def test_direct_path_patching_matches_the_bridge(name):
    """TransformerLens 4's `get_act_patch_direct_path` (path patching through the split q/k/v inputs,
    which it switches on and off itself) gives the bridge's numbers on ours."""
    ours, bridge = pair(name)
    clean, corrupted = ours.to_tokens(CLEAN), ours.to_tokens(CORRUPTED)
    components = ["q"] if ours.cfg.kv_heads < ours.cfg.n_heads else ["q", "k", "v"]
    with torch.no_grad():
        _, clean_a = ours.run_with_cache(clean)
        _, corr_a = ours.run_with_cache(corrupted)
        _, clean_b = bridge.run_with_cache(clean)
        _, corr_b = bridge.run_with_cache(corrupted)
        moved = 0.0
        for component in components:
            kw = dict(src_layer=0, src_head=1, component=component, verbose=False)
            a = patching.get_act_patch_direct_path(ours, corrupted, clean_a, corr_a, metric, **kw)
            b = patching.get_act_patch_direct_path(bridge, corrupted, clean_b, corr_b, metric, **kw)
            close(a, b, 1e-6)  # tight: on random GPT-2 weights a path moves the metric by ~1e-5
            moved = max(moved, (a[1] - metric(ours(corrupted))).abs().max().item())
        assert moved > 5e-6  # the paths do move the metric
    assert not ours.cfg.use_split_qkv_input  # restored


