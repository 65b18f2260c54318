"""GGUF files of the newer native families (Qwen 3, Qwen 3 MoE, Gemma 2, Phi-3, Falcon, BLOOM, GPT-2; and
Qwen 2's row order), against transformers' own GGUF loading.

Each file is written here from a tiny random transformers model as llama.cpp's converter writes that
architecture: its metadata keys, its tensor names (the `gguf` package's own name map, not interp's),
and what it changes in the tensors (Gemma's 1 + w norms, Falcon's and BLOOM's fused QKV rows as
[q | k | v], GPT-2's Conv1D weights transposed, Qwen 3 MoE's experts stacked). The oracle is
`transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`; where transformers' GGUF
loading ignores a key the file states (Gemma 2's soft caps, Phi-3's partial rotary and LongRoPE,
Falcon-40B's grouped QKV), the file is checked against the transformers model it was written from.

Not here, because transformers 5.24 cannot load them from GGUF (so there is no oracle): OLMo 2, MPT,
Mixtral (llama.cpp writes it as "llama" with experts; transformers drops them) and GPT-OSS's file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import interp
from interp.errors import CheckpointError
from interp.models.formats import gguf as gguf_format

from hf_cases import VOCAB, build_hf_from

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

N = 12


def _write(path: Path, arch: str, keys: dict, tensors: dict[str, np.ndarray], edit=None) -> Path:
    """A GGUF file of `arch` (F32 tensors) with the metadata `keys` (under `{arch}.`) and a vocabulary
    (its size is the model's, and a padding id, as in llama.cpp's files; no tokenizer model, so none is
    built). `edit(tensors)` may change the tensors first (a damaged or foreign file)."""
    if edit is not None:
        tensors = edit(dict(tensors))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_pad_token_id(0)  # transformers' configs would otherwise pad with their own default id (Phi-3's 32000)
    for key, value in keys.items():
        key = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_tensors(hf, arch: str, change=None, skip=()) -> dict[str, np.ndarray]:
    """hf's tensors under llama.cpp's names for `arch` (the `gguf` package's map), each passed through
    `change(hf_name, array)` where the converter changes it; a tied lm_head is not written."""
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(kind, hf.config.num_hidden_layers)
    out = {}
    for name, t in hf.state_dict().items():
        if name in skip or (name == "lm_head.weight" and hf.config.tie_word_embeddings):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:  # BLOOM's converter maps its names without the `transformer.` prefix
            target = names.get_name(name.removeprefix("transformer."), try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        array = t.detach().float().numpy()
        out[target] = array if change is None else change(name, array)
    return out


# ---- what llama.cpp's converter writes, per architecture -------------------------------------------------------
def _rms_keys(c, **extra) -> dict:
    """The keys llama.cpp's base converter writes for an RMSNorm model."""
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps)}
    return keys | extra


def qwen3_file(path, hf, extra=None, edit=None):
    c = hf.config
    keys = _rms_keys(c, **{"rope.freq_base": float(c.rope_parameters["rope_theta"]),
                           "attention.key_length": c.head_dim, "attention.value_length": c.head_dim})
    return _write(path, "qwen3", keys | (extra or {}), _llama_cpp_tensors(hf, "qwen3"), edit)


def qwen2_file(path, hf, extra=None, edit=None):
    c = hf.config
    keys = _rms_keys(c, **{"rope.freq_base": float(c.rope_parameters["rope_theta"])})
    return _write(path, "qwen2", keys | (extra or {}), _llama_cpp_tensors(hf, "qwen2"), edit)


def qwen3moe_file(path, hf, extra=None, edit=None):
    """Qwen 3 MoE: the experts' gate, up and down projections stacked per layer (ffn_*_exps); transformers
    holds gate and up fused (gate_up_proj [experts, 2 d_mlp, d_model], gate rows first)."""
    c = hf.config
    keys = _rms_keys(c, **{"rope.freq_base": float(c.rope_parameters["rope_theta"]), "attention.key_length": c.head_dim,
                           "attention.value_length": c.head_dim, "expert_count": c.num_experts,
                           "expert_used_count": c.num_experts_per_tok,
                           "expert_feed_forward_length": c.moe_intermediate_size})
    sd = hf.state_dict()
    experts = {k for k in sd if ".mlp.experts." in k or k.endswith(".mlp.gate.weight")}
    tensors = _llama_cpp_tensors(hf, "qwen3moe", skip=experts)
    for l in range(c.num_hidden_layers):
        p = f"model.layers.{l}.mlp."
        gate, up = sd[p + "experts.gate_up_proj"].chunk(2, dim=1)
        tensors |= {f"blk.{l}.ffn_gate_inp.weight": sd[p + "gate.weight"].numpy(),
                    f"blk.{l}.ffn_gate_exps.weight": gate.numpy(), f"blk.{l}.ffn_up_exps.weight": up.numpy(),
                    f"blk.{l}.ffn_down_exps.weight": sd[p + "experts.down_proj"].numpy()}
    return _write(path, "qwen3moe", keys | (extra or {}), tensors, edit)


def gemma2_file(path, hf, extra=None, edit=None):
    """Gemma 2: every norm weight stored as 1 + w; head width, soft caps and window in the metadata."""
    c = hf.config
    keys = _rms_keys(c, **{"attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
                           "attn_logit_softcapping": float(c.attn_logit_softcapping),
                           "final_logit_softcapping": float(c.final_logit_softcapping),
                           "attention.sliding_window": c.sliding_window})
    shift = lambda name, a: a + 1.0 if name.endswith("norm.weight") else a  # noqa: E731
    return _write(path, "gemma2", keys | (extra or {}), _llama_cpp_tensors(hf, "gemma2", shift), edit)


def phi3_file(path, hf, extra=None, edit=None):
    """Phi-3: fused qkv_proj and gate_up_proj as they are; the rotated width as rope.dimension_count; for
    LongRoPE, the factors as two tensors beside the original context and attention factor."""
    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
    keys = _rms_keys(c, **{"rope.dimension_count": rope_dims, "rope.freq_base": float(rope["rope_theta"]),
                           "rope.scaling.original_context_length": c.original_max_position_embeddings,
                           "attention.sliding_window": c.sliding_window or 0})
    tensors = _llama_cpp_tensors(hf, "phi3")
    if rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        orig = c.original_max_position_embeddings
        keys["rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(orig)))
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    assert head_dim >= rope_dims
    return _write(path, "phi3", keys | (extra or {}), tensors, edit)


def falcon_file(path, hf, extra=None, edit=None):
    """Falcon: the fused QKV's rows regrouped from Falcon's [per KV head: its queries, k, v] to [q | k | v]
    (tensor_data_layout "jploski"); context 2048 and a 4 d_model MLP, as llama.cpp's converter fixes them."""
    c = hf.config
    h, dh = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    kv = c.num_kv_heads if c.new_decoder_architecture else 1

    def jploski(name, a):
        if "query_key_value" not in name:
            return a
        groups = a.reshape(kv, h // kv + 2, dh, *a.shape[1:])
        q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
        return np.concatenate([q.reshape(h * dh, *a.shape[1:]), k.reshape(kv * dh, *a.shape[1:]),
                               v.reshape(kv * dh, *a.shape[1:])])

    keys = {"context_length": 2048, "tensor_data_layout": "jploski", "embedding_length": c.hidden_size,
            "feed_forward_length": 4 * c.hidden_size, "block_count": c.num_hidden_layers,
            "attention.head_count": h, "attention.head_count_kv": kv,
            "attention.layer_norm_epsilon": float(c.layer_norm_epsilon)}
    return _write(path, "falcon", keys | (extra or {}), _llama_cpp_tensors(hf, "falcon", jploski), edit)


def bloom_file(path, hf, extra=None, edit=None):
    """BLOOM: the fused QKV's per-head [q, k, v] rows as [q | k | v]; the embedding written again as
    output.weight (BLOOM ties them)."""
    c = hf.config
    h, d = c.n_head, c.hidden_size

    def split_heads(name, a):
        if "query_key_value" not in name:
            return a
        return a.reshape(h, 3, d // h, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)

    keys = {"context_length": 2048, "embedding_length": d, "feed_forward_length": 4 * d, "block_count": c.n_layer,
            "attention.head_count": h, "attention.head_count_kv": h,
            "attention.layer_norm_epsilon": float(c.layer_norm_epsilon)}
    tensors = _llama_cpp_tensors(hf, "bloom", split_heads)
    tensors["output.weight"] = tensors["token_embd.weight"]
    return _write(path, "bloom", keys | (extra or {}), tensors, edit)


def gpt2_file(path, hf, extra=None, edit=None):
    """GPT-2: Conv1D weights transposed to [out, in]; the embedding written again as output.weight."""
    c = hf.config
    conv = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
    keys = {"block_count": c.n_layer, "context_length": c.n_positions, "embedding_length": c.n_embd,
            "feed_forward_length": 4 * c.n_embd, "attention.head_count": c.n_head,
            "attention.layer_norm_epsilon": float(c.layer_norm_epsilon)}
    tensors = _llama_cpp_tensors(hf, "gpt2", lambda name, a: a.T if name.endswith(conv) else a)
    tensors["output.weight"] = tensors["token_embd.weight"]
    return _write(path, "gpt2", keys | (extra or {}), tensors, edit)


# name -> (file writer, transformers config class, model class, config kwargs). Sizes where transformers'
# GGUF loading would otherwise read a default the file does not state: Qwen 3's head_dim (128; the
# file's key_length is not read), Qwen 3 MoE's moe_intermediate_size (768), Gemma 2's query scale
# (256 ** -0.5: heads of 256 make llama.cpp's d_head ** -0.5 the same), GPT-2's 1024 positions.
CASES = {
    "qwen3": (qwen3_file, "Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=128,
        intermediate_size=72, max_position_embeddings=64, tie_word_embeddings=True)),
    "qwen2-biases": (qwen2_file, "Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72,
        max_position_embeddings=64)),
    "qwen3moe": (qwen3moe_file, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
        intermediate_size=72, moe_intermediate_size=768, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=64)),
    "gemma2": (gemma2_file, "Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        intermediate_size=72, sliding_window=5, max_position_embeddings=64, initializer_range=0.2)),
    "phi3": (phi3_file, "Phi3Config", "Phi3ForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=72,
        max_position_embeddings=64, original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    "falcon-7b-style": (falcon_file, "FalconConfig", "FalconForCausalLM", dict(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, multi_query=True, parallel_attn=True, bias=False,
        bos_token_id=0, eos_token_id=0)),
    "bloom": (bloom_file, "BloomConfig", "BloomForCausalLM", dict(n_layer=2, hidden_size=40, n_head=5,
                                                                   bos_token_id=0, eos_token_id=0)),
    "gpt2": (gpt2_file, "GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=40, n_head=5, n_positions=1024,
                                                              bos_token_id=0, eos_token_id=0)),
}


def _case(name: str, tmp_path: Path, seed: int = 0, extra=None, edit=None, **changes):
    writer, cfg_cls, model_cls, kwargs = CASES[name]
    hf = build_hf_from(cfg_cls, model_cls, seed, **{**kwargs, **changes})
    return hf, writer(tmp_path / f"tiny-{name}.gguf", hf, extra, edit)


def _tokens(batch: int = 2, n: int = N, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _check(ours, ref_logits, toks):
    with torch.no_grad():
        _close(ours(toks), ref_logits)
        with ours.attention("instrumented"):
            _close(ours(toks), ref_logits)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_gguf_file_equals_transformers_gguf_loading(name, tmp_path):
    hf, path = _case(name, tmp_path)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    toks = _tokens()
    with torch.no_grad():
        ref = oracle.eval()(toks).logits
        _close(ref, hf(toks).logits)  # the file holds hf's weights
    ours = interp.load(path)
    assert ours.cfg.model_type == hf.config.model_type
    assert gguf_format.config(path) == ours.cfg  # from the metadata alone, as memory checks read it
    _check(ours, ref, toks)


# ---- what transformers' GGUF loading does not read: checked against the model the file was written from -------
@pytest.mark.parametrize("name, changes", [
    # Gemma 2's soft caps small enough to bite, heads of 20 (llama.cpp's query scale d_head ** -0.5: the
    # transformers model is built with query_pre_attn_scalar = head_dim to mean the same), window 5 < 12
    ("gemma2", dict(head_dim=20, num_attention_heads=4, num_key_value_heads=2, query_pre_attn_scalar=20,
                    attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    ("qwen3", dict(head_dim=10, num_attention_heads=6, num_key_value_heads=2)),  # key_length, not 128
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
    # LongRoPE over a partial rotary: original context 2 < every length here, so the long factors are used
    ("phi3", dict(max_position_embeddings=32, original_max_position_embeddings=2,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "short_factor": [1.0, 1.3], "long_factor": [1.1, 2.3]})),
    ("falcon-7b-style", dict(num_kv_heads=2, new_decoder_architecture=True, multi_query=False, bias=True,
                             num_ln_in_parallel_attn=2)),  # Falcon-40B: grouped KV heads, two norms
    ("falcon-7b-style", dict(num_kv_heads=3, new_decoder_architecture=True, multi_query=False,
                             num_ln_in_parallel_attn=1)),  # Falcon-11B: grouped KV heads, one shared norm
], ids=["gemma2-caps", "qwen3-head-width", "phi3-partial", "phi3-longrope", "falcon-40b-style", "falcon-11b-style"])
def test_a_gguf_file_equals_the_model_it_was_written_from(name, changes, tmp_path):
    hf, path = _case(name, tmp_path, seed=1, **changes)
    toks = _tokens(seed=4)
    with torch.no_grad():
        ref = hf(toks).logits
    ours = interp.load(path)
    assert gguf_format.config(path) == ours.cfg
    _check(ours, ref, toks)


def test_gemma2_soft_caps_are_read_from_the_file(tmp_path):
    """The caps the file states are the ones applied (3 and 4 here, not Gemma 2's default 50 and 30)."""
    hf, path = _case("gemma2", tmp_path, head_dim=20, query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                     final_logit_softcapping=4.0)
    cfg = interp.load(path).cfg
    assert (cfg.attn_scores_soft_cap, cfg.output_logits_soft_cap) == (3.0, 4.0)
    assert cfg.layer_types == ("sliding", "full", "sliding") and cfg.sliding_window == 5
    assert cfg.attn_scale == pytest.approx(20 ** -0.5)


def test_a_phi3_window_is_not_applied_as_llama_cpp_and_transformers_do_not(tmp_path):
    """Phi-3 files state a window (Phi-3-mini's 2047); llama.cpp turns Phi's window off and transformers'
    GGUF loading ignores it, so a window of 5 < 12 tokens changes nothing here either."""
    hf, path = _case("phi3", tmp_path, extra={"attention.sliding_window": 5})
    oracle = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = interp.load(path)
    assert ours.cfg.sliding_window is None
    toks = _tokens()
    with torch.no_grad():
        _check(ours, oracle.eval()(toks).logits, toks)


# ---- what a layout cannot represent: one line naming the key -------------------------------------------------
@pytest.mark.parametrize("name, extra, error, message", [
    ("qwen3", {"rope.scaling.type": "longrope"}, NotImplementedError, r"RoPE scaling 'longrope'"),
    ("qwen3", {"pooling_type": 1}, NotImplementedError, r"qwen3\.pooling_type = 1"),
    ("qwen3", {"attention.value_length": 12}, NotImplementedError, r"qwen3\.attention\.value_length differs"),
    ("qwen3moe", {"expert_shared_feed_forward_length": 40}, NotImplementedError,
     r"qwen3moe\.expert_shared_feed_forward_length = 40"),
    ("gemma2", {"rope.scaling.type": "linear"}, NotImplementedError, r"gemma2\.rope\.scaling\.type = 'linear'"),
    ("gemma2", {"attn_logit_softcapping": 0.0}, CheckpointError, r"gemma2\.attn_logit_softcapping = 0\.0"),
    ("phi3", {"rope.scaling.type": "yarn"}, NotImplementedError, r"phi3\.rope\.scaling\.type = 'yarn'"),
    ("phi3", {"rope.dimension_count": 10}, NotImplementedError, r"phi3\.rope\.dimension_count = 10"),
    ("falcon-7b-style", {"tensor_data_layout": "Meta AI original pth"}, NotImplementedError,
     r"falcon\.tensor_data_layout = 'Meta AI original pth'"),
    ("falcon-7b-style", {"rope.dimension_count": 4}, NotImplementedError, r"falcon\.rope\.dimension_count = 4"),
    ("bloom", {"feed_forward_length": 100}, NotImplementedError, r"bloom\.feed_forward_length = 100"),
    ("bloom", {"attention.head_count_kv": 1}, NotImplementedError, r"bloom\.attention\.head_count_kv = 1"),
    ("gpt2", {"rope.freq_base": 10000.0}, NotImplementedError, r"gpt2\.rope\.freq_base = 10000\.0"),
    ("gpt2", {"attention.head_count_kv": 1}, NotImplementedError, r"gpt2\.attention\.head_count_kv = 1"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_gguf_metadata_a_layout_cannot_represent_raises_naming_the_key(name, extra, error, message, tmp_path):
    _, path = _case(name, tmp_path, extra=extra)
    with pytest.raises(error, match=message) as raised:
        interp.load(path)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name, edit, message", [
    # Qwen 3 files carry no RoPE-frequency tensor (llama 3's rope_freqs): one that does is refused, not ignored
    ("qwen3", lambda t: t | {"rope_freqs.weight": np.ones(5, np.float32)},
     r"tensor 'rope_freqs\.weight' has no place in a qwen3 model"),
    # Qwen 3 MoE with a dense layer (mlp_only_layers), which the family does not hold
    ("qwen3moe", lambda t: t | {"blk.1.ffn_gate.weight": np.ones((72, 48), np.float32)},
     r"tensor 'blk\.1\.ffn_gate\.weight' has no place in a qwen3_moe model"),
    ("qwen3moe", lambda t: {k: v for k, v in t.items() if k != "blk.1.ffn_up_exps.weight"},
     r"tensor 'blk\.1\.ffn_up_exps\.weight' is missing"),
    ("bloom", lambda t: t | {"blk.0.attn_q_norm.weight": np.ones(8, np.float32)},
     r"tensor 'blk\.0\.attn_q_norm\.weight' has no place in a bloom model"),
], ids=["qwen3-rope-freqs", "qwen3moe-dense-layer", "qwen3moe-half-experts", "bloom-qk-norm"])
def test_a_tensor_a_layout_has_no_place_for_raises_naming_it(name, edit, message, tmp_path):
    _, path = _case(name, tmp_path, edit=edit)
    with pytest.raises(CheckpointError, match=message) as raised:
        interp.load(path)
    assert "\n" not in str(raised.value)


def llama_file(path, hf, extra=None, edit=None):
    """llama.cpp's converter for Llama: Q and K rows permuted for its RoPE layout (each head's halves
    interleaved), and Llama 3's rope scaling written only as `rope_freqs.weight`, each frequency's divisor:
    plain over scaled, the scaled ones transformers' own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = hf.config
    theta, d = float(c.rope_parameters["rope_theta"]), c.head_dim

    def permute(name, a):
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
        if heads is None:
            return a
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    tensors = _llama_cpp_tensors(hf, "llama", permute)
    if c.rope_parameters.get("rope_type") == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        plain = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        tensors["rope_freqs.weight"] = (plain / scaled.double()).float().numpy()
    keys = _rms_keys(c, **{"rope.freq_base": theta})
    return _write(path, "llama", keys | (extra or {}), tensors, edit)


LLAMA3 = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=72, max_position_embeddings=128, initializer_range=0.2,
              rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


@pytest.mark.parametrize("params", [
    LLAMA3["rope_parameters"],
    # another (original, low, high) on the same line gives the same frequencies: read as low 1
    {**LLAMA3["rope_parameters"], "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "default", "rope_theta": 1000.0},  # no scaling: no tensor, plain RoPE
], ids=["llama3", "llama3-same-line", "plain"])
def test_a_llama3_file_reads_its_rope_freqs_as_the_scaling(params, tmp_path):
    """Llama 3.1 and later files carry their RoPE scaling only as `rope_freqs.weight`; read as Llama 3's
    scaling, the file gives the logits of the transformers model it was written from, past the original
    length (transformers' own GGUF loading drops the tensor, so it is no oracle here)."""
    hf = build_hf_from("LlamaConfig", "LlamaForCausalLM", seed=5, **{**LLAMA3, "rope_parameters": params})
    path = llama_file(tmp_path / "llama3.gguf", hf)
    toks = _tokens(n=96, seed=6)
    with torch.no_grad():
        ref = hf(toks).logits
    ours = interp.load(path)
    scaling = ours.cfg.rope_scaling
    if params["rope_type"] == "llama3":
        assert scaling.kind == "llama3" and scaling.factor == pytest.approx(8.0)
        assert scaling.low_freq_factor == 1.0 and scaling.original_max_position == 32
        assert scaling.high_freq_factor == pytest.approx(4.0, rel=1e-4)
    else:
        assert scaling is None
    assert gguf_format.config(path) == ours.cfg
    _check(ours, ref, toks)


@pytest.mark.parametrize("params, keys", [
    ({"rope_type": "linear", "factor": 2.0}, {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
     {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32}),
], ids=["linear", "yarn"])
def test_a_scaling_stated_in_llama_metadata_is_read(params, keys, tmp_path):
    """llama.cpp's converters state linear and YaRN scaling in rope.scaling.*: read, the file gives the logits of
    the transformers model it was written from past the original length; a replacement at load is taken."""
    hf = build_hf_from("LlamaConfig", "LlamaForCausalLM", seed=5, **{**LLAMA3, "rope_parameters": {"rope_theta": 1000.0, **params}})
    path = llama_file(tmp_path / "scaled.gguf", hf, extra=keys)
    toks = _tokens(n=96, seed=6)
    with torch.no_grad():
        ref = hf(toks).logits
    ours = interp.load(path)
    assert ours.cfg.rope_scaling.kind == params["rope_type"] and ours.cfg.rope_scaling.factor == params["factor"]
    _check(ours, ref, toks)
    assert interp.load(path, rope_scaling="default").cfg.rope_scaling is None


def test_a_qwen3_file_with_yarn_gives_the_model_it_was_written_from(tmp_path):
    """Qwen 3's long-context releases run YaRN (x4 from 32k); llama.cpp's converter states it in rope.scaling.*."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    hf, path = _case("qwen3", tmp_path, seed=1, head_dim=10, num_attention_heads=6, num_key_value_heads=2,
                     rope_parameters=params, extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                                    "rope.scaling.original_context_length": 16})
    toks = _tokens(n=48, seed=4)
    with torch.no_grad():
        ref = hf(toks).logits
    ours = interp.load(path)
    assert ours.cfg.rope_scaling.kind == "yarn" and ours.cfg.rope_scaling.original_max_position == 16
    _check(ours, ref, toks)


@pytest.mark.parametrize("keys, message", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 2.0}, "RoPE scaling 'longrope' in GGUF metadata"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32,
      "rope.scaling.attn_factor": 0.5}, "rope.scaling.attn_factor = 0.5 is not supported"),
    ({"rope.scaling.type": "linear"}, "has no llama.rope.scaling.factor"),
    # issue 56: factors no model has are one line naming the file, not a model whose every logit is off
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 0.5, "rope.scaling.original_context_length": 32},
     "does not describe a model interp can build: invalid ModelConfig: rope_scaling.factor of yarn stretches the "
     "context and must be >= 1, got 0.5"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 3e38, "rope.scaling.original_context_length": 32},
     r"rope_scaling.factor must be a finite number from 0.0001 to 10000, got 3\.\d+e\+38"),
])
def test_a_scaling_llama_metadata_cannot_say_is_refused(keys, message, tmp_path):
    hf = build_hf_from("LlamaConfig", "LlamaForCausalLM", seed=5, **{**LLAMA3, "rope_parameters": {"rope_theta": 1000.0}})
    path = llama_file(tmp_path / "odd.gguf", hf, extra=keys)
    with pytest.raises((NotImplementedError, CheckpointError), match=message) as raised:
        interp.load(path)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("values, message", [
    (lambda f: f[:-1], "holds 15 values; the rotary pairs are 16"),
    (lambda f: np.where(np.arange(len(f)) % 2 == 0, 1.0, 3.0).astype(np.float32), "does not follow Llama 3's"),
    (lambda f: f * 0.5, "divisors below 1"),
])
def test_rope_freqs_that_are_not_llama3s_are_refused(values, message, tmp_path):
    hf = build_hf_from("LlamaConfig", "LlamaForCausalLM", seed=5, **LLAMA3)

    def edit(tensors):
        return tensors | {"rope_freqs.weight": values(tensors["rope_freqs.weight"])}

    path = llama_file(tmp_path / "bad.gguf", hf, edit=edit)
    with pytest.raises(CheckpointError, match=message) as raised:
        interp.load(path)
    assert "\n" not in str(raised.value)


def test_a_llama_file_with_experts_is_refused_not_loaded_dense(tmp_path):
    """llama.cpp writes Mixtral as a "llama" file with experts; transformers' GGUF loading drops them (no
    oracle), interp refuses the file."""
    hf = build_hf_from("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=1, hidden_size=48, num_attention_heads=6,
             num_key_value_heads=2, intermediate_size=72, max_position_embeddings=64)
    experts = {"blk.0.ffn_gate_inp.weight": np.ones((4, 48), np.float32),
               "blk.0.ffn_gate_exps.weight": np.ones((4, 72, 48), np.float32)}
    keys = _rms_keys(hf.config, expert_count=4, expert_used_count=2)
    path = _write(tmp_path / "mixtral.gguf", "llama", keys, _llama_cpp_tensors(hf, "llama") | experts)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_gate_inp\.weight' has no place in a llama model"):
        interp.load(path)


# ---- tokenizers: the ids transformers' GGUF loading gives ----------------------------------------------------
_TEXTS = ["Hello world, it's 1234567 o'clock, IT'S", "  two spaces\n\nand lines\tTAB", "naïve café 😀 ok",
          "<think>he said</think> <|endoftext|> bye", "hello  hello hello"]


def _tokenizer_file(path: Path, arch: str, model: str, tokens: list[str], types: list[int], *, scores=None,
                    merges=None, pre=None, **ids) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in ids.items():
        getattr(w, f"add_{key}_token_id")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_level_vocab():
    """A byte-level vocabulary: the 256 byte characters, some merges, a control token, a user-defined one,
    and a token stored with a real space (read in the byte alphabet)."""
    from interp.models.formats.gguf_tokenizer import _byte_alphabet

    alphabet = list(_byte_alphabet().values())
    merges = ["3 4", "Ġ t", "h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "1 2", "12 3", "Ġ h", "Ġh e",
              "i t", "Ġ Ġ", "a n", "Ġ an", "' S"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = alphabet + merged + ["<|endoftext|>", "<think>", "</think>", " spaces"]
    types = [1] * (len(tokens) - 4) + [3, 4, 4, 1]
    return tokens, types, merges


def _same_ids(ours, theirs):
    for text in _TEXTS:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids), text


@pytest.mark.parametrize("arch, pre", [("qwen3", "qwen2"), ("llama", "llama-bpe"), ("gpt2", "gpt-2"),
                                       ("falcon", "falcon"), ("bloom", "bloom")])
def test_a_byte_level_gguf_tokenizer_gives_transformers_ids(arch, pre, tmp_path):
    from interp.models.formats.gguf import _reader, gguf_tokenizer

    tokens, types, merges = _byte_level_vocab()
    path = _tokenizer_file(tmp_path / "tok.gguf", arch, "gpt2", tokens, types, merges=merges, pre=pre,
                           eos=len(tokens) - 4, bos=len(tokens) - 4)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = gguf_tokenizer(_reader(path), str(path))
    _same_ids(ours, theirs)
    think = ours.encode("<think>", add_special_tokens=False)
    assert think == [tokens.index("<think>")]  # user-defined: whole


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_a_sentencepiece_gguf_tokenizer_gives_transformers_ids(arch, tmp_path):
    """Phi-3's (merges from the scores, a prefix "\u2581" from a normalizer) and Gemma 2's (merges from the
    file's order) SentencePiece BPE, over one vocabulary whose scores disagree with its order."""
    from interp.models.formats.gguf import _reader, gguf_tokenizer

    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "a", "i", "t", "he", "ll", "llo", "hello", "\u2581h",
              "\u2581he", "\u2581hello", "or", "\u2581w", "\u2581wor", "ld", "\u2581world", "it", "\u2581it", "an",
              "\u2581\u2581", "  "]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    rng = np.random.default_rng(0)
    scores = [0.0] * (3 + 256) + [float(-x) for x in rng.permutation(len(pieces))] + [0.0]
    path = _tokenizer_file(tmp_path / "tok.gguf", arch, "llama", tokens, types, scores=scores, pre="default",
                           unk=0, bos=1, eos=2)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = gguf_tokenizer(_reader(path), str(path))
    _same_ids(ours, theirs)
