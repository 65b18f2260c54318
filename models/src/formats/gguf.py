"""GGUF files (llama.cpp's format): the architectures below, dequantized, with their tokenizer.

A GGUF file holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors named
the llama.cpp way (`blk.3.attn_q.weight`), possibly quantized. `load_gguf` reads both with our
container reader (`gguf_file.py`), dequantizes every tensor to the requested dtype with the `gguf`
package's dequantizers (PyPI, published by llama.cpp), renames the tensors to Hugging Face's names,
undoes what llama.cpp's converter changed (the row permutation of Q and K for its RoPE layout in
llama files; the 1 it adds to every Gemma norm weight; Falcon's and BLOOM's fused QKV rows regrouped
as [q | k | v]; GPT-2's Conv1D weights transposed; Qwen 3 MoE's experts split into stacked gate and up
tensors), writes a Hugging Face config from the metadata, and hands both to the family of that
`model_type` (`families/`): the same converter as a Hugging Face folder.

Each architecture's family declares its layout in its own file (`families/*.py`, a `GGUFLayout`:
metadata keys, tensor names, what the converter changed; read through `gguf_layouts.py`); for every
architecture but llama, mistral and qwen2, a metadata key the layout does not know raises, naming the
key, instead of loading a silently different model, and so does a tensor it has no place for. What the metadata leaves out is llama.cpp's (and transformers') fixed choice for that
architecture: Gemma 3's global layer every 6th, RoPE base 1e4 on local layers; Gemma 2's even layers
local; the Gemmas' query scale d_head ** -0.5; Qwen 3 MoE's renormalised expert weights; Phi-3 without
its sliding window (llama.cpp turns it off).

The tokenizer is rebuilt from the file's `tokenizer.ggml.*` fields (`gguf_tokenizer.py`).

Supported: architectures llama (Llama 3.1 and later: `rope_freqs.weight` read as Llama 3's RoPE scaling),
mistral, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3 (partial rotary, LongRoPE), falcon (7B, 11B and 40B
layouts), bloom, gpt2 (their metadata prefixes); every tensor type the `gguf` package can dequantize (F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...).
Not read: llama-architecture files with experts (Mixtral), olmo2, mpt, gpt-oss.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .build import build_model, config_errors, convert_weights
from ..config import ModelConfig
from interp.errors import CheckpointError
from ..families import get_family
from .gguf_file import GGUFFile, dequantize
from ..families.gguf_layout import GGUFLayout
from .gguf_layouts import ARCHITECTURES, _field, hf_config, layouts
from .gguf_tokenizer import gguf_tokenizer
from ..native.transformer import HookedTransformer


def _reader(path: Path) -> GGUFFile:
    try:
        import gguf  # noqa: F401 - its tensor types and dequantizers
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFFile(path)
    except (ValueError, OSError, UnicodeDecodeError, struct.error) as e:
        raise CheckpointError(
            f"could not read the GGUF file {path} ({e}); it is truncated or not a GGUF file: download it again"
        ) from e




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
    fp32 weights instead of two or three times it. Norm weights lose what llama.cpp's converter added
    to them (Gemma's 1), in float32, before the cast to `dtype`; then what else it changed is undone
    (Q / K rows, fused QKV layouts, transposes) and split tensors are joined."""

    def __init__(self, reader, config: dict, layout: GGUFLayout, source: str, dtype: torch.dtype) -> None:
        self.source, self.dtype, self.layout = source, dtype, layout
        fixes = {k: functools.partial(f, config=config) for k, f in layout.transforms.items()}
        if layout.permuted_qk:
            for leaf, heads in (("attn_q.weight", config["num_attention_heads"]),
                                ("attn_k.weight", config["num_key_value_heads"])):
                fixes[leaf] = functools.partial(unpermute_rope_rows, n_heads=heads)
        layer_names = layout.layer_names(config) if callable(layout.layer_names) else layout.layer_names
        parts = {leaf: hf for hf, (leaves, _) in layout.merged.items() for leaf in leaves}
        self.by_name = {}  # HF name -> (GGUF tensors, what turns them into the HF tensor, or None)
        pending: dict[str, dict[str, object]] = {}  # HF name of a merged tensor -> {llama.cpp leaf: tensor}
        for tensor in reader.tensors:
            name = tensor.name
            if name in layout.ignored:
                continue
            layer, _, rest = name[4:].partition(".") if name.startswith("blk.") else ("", "", "")
            if layer.isdigit() and rest in layer_names:
                self.by_name[f"{layout.prefix}{layer}.{layer_names[rest]}"] = ((tensor,), fixes.get(rest))
            elif layer.isdigit() and rest in parts:
                pending.setdefault(f"{layout.prefix}{layer}.{parts[rest]}", {})[rest] = tensor
            elif not layer and name in layout.global_names:
                self.by_name[layout.global_names[name]] = ((tensor,), fixes.get(name))
            else:
                raise CheckpointError(f"{source}: tensor {name!r} has no place in a {layout.model_type} model "
                                      "(unsupported GGUF variant)")
        for hf, found in pending.items():
            leaves, join = layout.merged[hf[len(layout.prefix):].split(".", 1)[1]]
            missing = [leaf for leaf in leaves if leaf not in found]
            if missing:
                layer = hf[len(layout.prefix):].split(".", 1)[0]
                raise CheckpointError(f"{source}: tensor 'blk.{layer}.{missing[0]}' is missing (its pair is there); "
                                      "the file is incomplete")
            self.by_name[hf] = (tuple(found[leaf] for leaf in leaves), join)

    def __len__(self) -> int:
        return len(self.by_name)

    def __iter__(self):
        return iter(self.by_name)

    def __getitem__(self, key: str) -> Tensor:
        tensors, fix = self.by_name[key]
        read = [self._read(t) for t in tensors]
        return read[0] if fix is None else fix(*read)

    def _read(self, tensor) -> Tensor:
        name = tensor.name
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{self.source}: tensor {name!r} is stored as {tensor.tensor_type.name}, which the installed `gguf` "
                f"package cannot dequantize ({e}); upgrade it (pip install -U gguf) or re-quantize the model"
            ) from e
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{self.source}: tensor {name!r} is damaged ({e}); the file is truncated or corrupt") from e
        shape = tuple(reversed(tensor.shape))  # GGUF lists dims fastest-first
        array = np.asarray(array, dtype=np.float32)
        if self.layout.norm_shift and name.endswith("norm.weight"):
            array = array - np.float32(self.layout.norm_shift)  # a new array: the file map stays untouched
        elif not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        return torch.from_numpy(array).reshape(shape).to(self.dtype)


def config(path: Path, raw=None) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (no tensor is read)."""
    hf = hf_config(_reader(Path(path)), str(path))
    with config_errors(path):
        return get_family(hf["model_type"]).config(hf)


def load(path: Path, raw=None, *, dtype, device, tokenizer, offload=None, device_map=None) -> HookedTransformer:
    """The loader's entry (`checkpoint.load_checkpoint`): `load_gguf`."""
    return load_gguf(path, dtype=dtype, device=device, tokenizer=tokenizer, offload=offload, device_map=device_map)


def load_gguf(path, *, dtype: torch.dtype = torch.float32, device=None, tokenizer=None,
              offload=None, device_map=None) -> HookedTransformer:
    """A GGUF file (llama, mistral, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, falcon, bloom, gpt2) as a
    HookedTransformer (weights dequantized to `dtype`), with the tokenizer rebuilt from the file unless
    `tokenizer` is given. `offload`: as `build_model`'s; a GGUF file's weights are quantized, so they are
    dequantized into host memory first (offload="disk" then saves device memory, not host memory)."""
    path = Path(path)
    source = str(path)
    reader = _reader(path)
    config = hf_config(reader, source)
    family = get_family(config["model_type"])
    with config_errors(source):
        cfg = family.config(config)
    tensors = _DequantizedOnRead(reader, config, layouts()[_field(reader, "general.architecture")], source, dtype)
    sd = convert_weights(family, cfg, tensors, source)
    del tensors
    model = build_model(cfg, sd, source, dtype, device, fresh=True, offload=offload,
                        device_map=device_map)
    model.tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(reader, source)
    return model


__all__ = ["ARCHITECTURES", "config", "hf_config", "load", "load_gguf", "unpermute_rope_rows"]
