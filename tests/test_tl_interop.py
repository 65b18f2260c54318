"""TransformerLens interop: its own utilities give the same numbers on our model as on its bridge.

Every comparison runs TransformerLens 4's code unchanged (`head_detector.detect_head`, the
`patching` sweeps, its `ActivationCache` helpers) on two models holding one set of weights: a
random-init `transformers` model from `hf_cases.py` (GPT-2, and Llama with GQA: 6 query heads
sharing 2 kv-heads) converted with `interp.from_hf`, and the same model booted into a
`TransformerBridge` (`interp.interop.bridge_from_hf`: no download, no weight processing). Both
see the same tokens: the bridge prepends BOS by default and we do not, so the bridge's default is
switched off (and one test instead writes the BOS into our text).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

tl = pytest.importorskip("transformer_lens")
pytest.importorskip("transformers")

import interp  # noqa: E402
from hf_cases import VOCAB, build_hf  # noqa: E402
from interp.interop import bridge_from_hf, conforms, to_tl_cache  # noqa: E402
from transformer_lens import patching  # noqa: E402
from transformer_lens.head_detector import detect_head  # noqa: E402

CASES = ["gpt2", "llama-gqa"]
TOL = 1e-4
TEXT = "w5 w7 w9 w11 w13 w5 w7 w9 w11 w13 w2 w5 w7"  # repeats: duplicate and induction targets
CLEAN = ["w5 w7 w9 w11 w5 w7 w9 w11", "w2 w3 w4 w6 w2 w3 w4 w6"]
CORRUPTED = ["w5 w7 w9 w12 w5 w7 w9 w11", "w2 w3 w8 w6 w2 w3 w4 w6"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: extra intra-op threads only add synchronisation (and, on a shared
    machine, contention that makes the bridge-vs-ours sweeps slow and noisy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def tokenizer():
    """A word-level tokenizer over the test vocabulary ("<bos>" = 0, "w1".."w96"), saved and reloaded
    from a directory as a checkpoint's would be (the bridge re-reads it from `name_or_path`)."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<bos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fresh = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<bos>", pad_token="<bos>")
    path = tempfile.mkdtemp(prefix="interp-tl-tok-")
    fresh.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@functools.lru_cache(maxsize=None)
def pair(name: str):
    """(ours, bridge) on one set of weights; the bridge does not prepend BOS, like us."""
    hf = build_hf(name)
    ours = interp.from_hf(hf, tokenizer=tokenizer())
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    bridge.cfg.default_prepend_bos = False
    return ours, bridge


def metric(logits):
    return (logits[:, -1, 9] - logits[:, -1, 3]).mean()


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.float() - b.float()).abs().max().item()
    assert err < tol, err


# ---- the protocol --------------------------------------------------------------------------------
# What TransformerLens's utilities read from model.cfg (patching, head_detector, ActivationCache).
TL_CFG = [
    "n_layers", "n_heads", "d_model", "d_vocab", "d_vocab_out", "n_ctx", "d_mlp", "act_fn", "attn_only",
    "n_key_value_heads", "normalization_type", "final_rms", "positional_embedding_type", "parallel_attn_mlp",
    "eps", "device", "dtype", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "n_devices",
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
    assert ours.cfg.default_prepend_bos is False  # documented difference: we never add BOS unasked


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


@pytest.mark.parametrize("name", CASES)
def test_detect_head_with_bos_on_both_sides(name):
    """The bridge's default (prepend BOS) against ours with the BOS written into the text."""
    ours, _ = pair(name)
    bridge = bridge_from_hf(build_hf(name), tokenizer=tokenizer())
    assert bridge.cfg.default_prepend_bos
    assert torch.equal(ours.to_tokens("<bos> " + TEXT), bridge.to_tokens(TEXT))
    assert torch.equal(ours.to_tokens(TEXT, prepend_bos=True), bridge.to_tokens(TEXT))
    close(detect_head(ours, "<bos> " + TEXT, "induction_head"), detect_head(bridge, TEXT, "induction_head"))


def test_tokenizer_from_a_checkpoint_directory(tmp_path):
    """`interp.load` of a transformers directory brings its tokenizer: TransformerLens's to_tokens-based
    utilities work on the loaded model directly."""
    hf = build_hf("llama-gqa")
    hf.save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    loaded = interp.load(tmp_path)
    assert loaded.tokenizer is not None
    _, bridge = pair("llama-gqa")
    close(detect_head(loaded, TEXT, "duplicate_token_head"), detect_head(bridge, TEXT, "duplicate_token_head"))


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
@pytest.mark.parametrize("name", CASES)
def test_activation_cache_helpers_match_the_bridge(name):
    ours, bridge = pair(name)
    tokens = ours.to_tokens(CLEAN)
    _, a = ours.run_with_cache(tokens, cache_type="transformer_lens")
    _, b = bridge.run_with_cache(tokens)
    assert isinstance(a, tl.ActivationCache)
    calls = [
        ("stack_head_results", {}),
        ("stack_head_results", dict(layer=1, return_labels=True)),
        ("stack_head_results", dict(apply_ln=True, incl_remainder=True, pos_slice=-1)),
        ("decompose_resid", {}),
        ("decompose_resid", dict(apply_ln=True, return_labels=True)),
        ("decompose_resid", dict(layer=1, mlp_input=True, mode="attn")),
        ("accumulated_resid", dict(apply_ln=True)),
        ("accumulated_resid", dict(layer=1, incl_mid=True, apply_ln=True, return_labels=True)),
        ("get_full_resid_decomposition", dict(expand_neurons=False, apply_ln=True)),
        ("stack_activation", dict(activation_name="pattern")),
    ]
    for method, kw in calls:
        x, y = getattr(a, method)(**kw), getattr(b, method)(**kw)
        if kw.get("return_labels"):
            assert x[1] == y[1], method
            x, y = x[0], y[0]
        close(x, y)
    stack_a, stack_b = a.decompose_resid(), b.decompose_resid()
    tok, wrong = torch.tensor([9, 4]), torch.tensor([3, 5])
    close(a.logit_attrs(stack_a, tok, incorrect_tokens=wrong), b.logit_attrs(stack_b, tok, incorrect_tokens=wrong))
    close(a.logit_attrs(stack_a, "w9", incorrect_tokens="w3"), b.logit_attrs(stack_b, "w9", incorrect_tokens="w3"))
    # to_tl_cache gives the same cache, sharing our tensors.
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
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
