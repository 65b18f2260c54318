"""GGUF files (llama.cpp's format): llama-architecture models, dequantized, with their tokenizer.

A GGUF file holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors named
the llama.cpp way (`blk.3.attn_q.weight`), possibly quantized. `load_gguf` reads both with the
`gguf` package (PyPI, published by llama.cpp), dequantizes every tensor to the requested dtype,
renames the tensors to Hugging Face's llama names, undoes the row permutation llama.cpp's
converter applies to Q and K for its RoPE layout, writes a Hugging Face config from the metadata,
and hands both to the Llama-like family (`families/llamalike.py`): one converter for all.

The tokenizer is rebuilt from the file's `tokenizer.ggml.*` fields (a byte-level BPE: vocabulary,
merges, special tokens, and the pre-tokenizer `tokenizer.ggml.pre` names) with the `tokenizers`
library; transformers' own GGUF loading is the test oracle for its ids.

Supported: architectures llama, mistral, qwen2 (their metadata prefixes); every tensor type the
`gguf` package can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .build import build_model, convert_weights
from .config import ModelConfig
from .errors import CheckpointError
from .families import get_family
from .transformer import HookedTransformer

ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}  # GGUF architecture -> HF model_type

# llama.cpp tensor names -> Hugging Face llama names ({l} is the layer).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Tensors llama.cpp may add that carry no weights of the model (precomputed RoPE frequencies).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises several types on damaged files
        raise CheckpointError(
            f"could not read the GGUF file {path} ({type(e).__name__}: {e}); it is truncated or not a GGUF "
            "file: download it again"
        ) from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_config(reader, source: str) -> dict:
    """A Hugging Face config dict from the metadata; raises on what the llama converter cannot represent."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise NotImplementedError(
            f"{source}: GGUF architecture {arch!r} is not supported; interp reads {sorted(ARCHITECTURES)} GGUF files"
        )

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{source}: the GGUF metadata has no {arch}.{key}; is the file complete?")
        return value

    def count(key: str, default=None) -> int:
        """A size from the metadata: an integer >= 1 (a 0 would divide by zero below, a negative
        build nothing sensible); `default` when absent (None: required)."""
        value = need(key) if default is None else _field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):
            raise NotImplementedError(f"{source}: per-layer values of {arch}.{key} are not supported")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise CheckpointError(f"{source}: the GGUF metadata {arch}.{key} = {value!r} is not a size (an integer >= 1); "
                                  "the file is corrupt")
        return int(value)

    def real(key: str, default=None) -> float:
        """A real number from the metadata (a norm epsilon, a RoPE base): finite and > 0."""
        value = need(key) if default is None else _field(reader, f"{arch}.{key}", default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if not math.isfinite(number) or number <= 0:
            raise CheckpointError(f"{source}: the GGUF metadata {arch}.{key} = {value!r} is not a finite number > 0; "
                                  "the file is corrupt")
        return number

    n_heads = count("attention.head_count")
    d_model = count("embedding_length")
    n_kv = count("attention.head_count_kv", n_heads)
    if _field(reader, f"{arch}.attention.key_length") is not None:
        head_dim = count("attention.key_length")
    elif d_model % n_heads:
        raise CheckpointError(f"{source}: embedding_length {d_model} is not a multiple of head_count {n_heads} "
                              "and no attention.key_length is given; the file is corrupt")
    else:
        head_dim = d_model // n_heads
    rope_dim = count("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise NotImplementedError(f"{source}: partial rotary ({rope_dim} of {head_dim} dims) is not supported for GGUF")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise NotImplementedError(f"{source}: RoPE scaling {scaling!r} in GGUF metadata is not supported")
    names = {t.name for t in reader.tensors}
    if _field(reader, f"{arch}.vocab_size") is not None:
        vocab = count("vocab_size")
    elif "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    else:
        raise CheckpointError(f"{source}: the GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    config = {
        "model_type": ARCHITECTURES[arch],
        "num_hidden_layers": count("block_count"),
        "hidden_size": d_model,
        "intermediate_size": count("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": count("context_length", 2048),
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon"),
        "rope_theta": real("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    if config["model_type"] == "qwen2":  # q/k/v biases, no output bias: the family's defaults
        config.pop("attention_bias")
    if _field(reader, f"{arch}.attention.sliding_window"):
        config["sliding_window"] = count("attention.sliding_window")
    return config


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's converter permutation of Q / K rows ([n_heads * d_head, ...]).

    Hugging Face's llama rotates the two halves of each head (`rotate_half`); llama.cpp rotates
    adjacent pairs, so its converter reorders each head's rows from [x_0..x_{d/2-1}, y_0..] to
    interleaved [x_0, y_0, x_1, y_1, ...]. This puts them back."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _DequantizedOnRead(Mapping):
    """{Hugging Face name: tensor}, each dequantized when read: the conversion's transposes and
    concatenations then hold the only full-precision copy, so loading peaks near the size of the
    fp32 weights instead of two or three times it."""

    def __init__(self, reader, config: dict, source: str, dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype
        rope_heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
        self.by_name = {}  # HF name -> (GGUF tensor, heads whose rows llama.cpp permuted, or None)
        for tensor in reader.tensors:
            name = tensor.name
            if name in _IGNORED:
                continue
            if name.startswith("blk.") and name.split(".", 2)[2] in _LAYER_NAMES:
                _, layer, rest = name.split(".", 2)
                self.by_name[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = (tensor, rope_heads.get(rest))
            elif name in _GLOBAL_NAMES:
                self.by_name[_GLOBAL_NAMES[name]] = (tensor, None)
            else:
                raise CheckpointError(f"{source}: tensor {name!r} has no place in a llama model (unsupported GGUF variant)")

    def __len__(self) -> int:
        return len(self.by_name)

    def __iter__(self):
        return iter(self.by_name)

    def __getitem__(self, key: str) -> Tensor:
        import gguf

        tensor, rope_heads = self.by_name[key]
        name = tensor.name
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{self.source}: tensor {name!r} is stored as {tensor.tensor_type.name}, which the installed `gguf` "
                f"package cannot dequantize ({e}); upgrade it (pip install -U gguf) or re-quantize the model"
            ) from e
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{self.source}: tensor {name!r} is damaged ({e}); the file is truncated or corrupt") from e
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))  # GGUF lists dims fastest-first
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        t = torch.from_numpy(array).reshape(shape).to(self.dtype)
        return t if rope_heads is None else unpermute_rope_rows(t, rope_heads)


def config(path: Path, raw=None) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (no tensor is read)."""
    hf = hf_config(_reader(Path(path)), str(path))
    return get_family(hf["model_type"]).config(hf)


def load(path: Path, raw=None, *, dtype, device, tokenizer) -> HookedTransformer:
    """The loader's entry (`checkpoint.load_checkpoint`): `load_gguf`."""
    return load_gguf(path, dtype=dtype, device=device, tokenizer=tokenizer)


def load_gguf(path, *, dtype: torch.dtype = torch.float32, device=None, tokenizer=None) -> HookedTransformer:
    """A llama-architecture GGUF file as a HookedTransformer (weights dequantized to `dtype`),
    with the tokenizer rebuilt from the file unless `tokenizer` is given."""
    path = Path(path)
    source = str(path)
    reader = _reader(path)
    config = hf_config(reader, source)
    family = get_family(config["model_type"])
    cfg = family.config(config)
    tensors = _DequantizedOnRead(reader, config, source, dtype)
    sd = convert_weights(family, cfg, tensors, source)
    del tensors
    model = build_model(cfg, sd, source, dtype, device, fresh=True)
    model.tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(reader, source)
    return model


# ---- the tokenizer ----------------------------------------------------------------------------
# tokenizer.ggml.pre names llama.cpp's pre-tokenizer regex. We follow transformers' GGUF loading (the
# oracle of our tests), which splits byte-level BPE input with GPT-2's regex for all of these; note
# that llama.cpp's own "smollm" regex also splits digits one by one, which differs from it only for
# whitespace right before a digit.
_BYTE_LEVEL_PRE = ("gpt2", "default", "smollm", "starcoder", "refact", "smaug-bpe", "qwen2", "llama-bpe")


def gguf_tokenizer(reader, source: str = "GGUF file"):
    """A `transformers.PreTrainedTokenizerFast` over a `tokenizers` BPE built from the file's
    `tokenizer.ggml.*` fields (byte-level BPE, 'gpt2' model), or None when the file has none."""
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind is None:
        return None
    if model_kind != "gpt2":
        raise NotImplementedError(
            f"{source}: GGUF tokenizer model {model_kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "pass tokenizer=... to interp.load"
        )
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
                                          use_regex=True)
    if pre in _BYTE_LEVEL_PRE:
        bpe.pre_tokenizer = byte_level
    else:
        raise NotImplementedError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported; pass tokenizer=... to interp.load")
    bpe.decoder = decoders.ByteLevel()
    special = [AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types) if kind == 3]
    bpe.add_special_tokens(special)

    def tok_at(key: str):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=tok_at("tokenizer.ggml.bos_token_id"), eos_token=tok_at("tokenizer.ggml.eos_token_id"),
        unk_token=tok_at("tokenizer.ggml.unknown_token_id"), pad_token=tok_at("tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast
