"""Reading a GGUF file's metadata into a Hugging Face config, for any architecture a family declares
(`gguf.py` reads the file and loads it).

Each family says how llama.cpp wrote it, in its own file (`families/*.py`: a `GGUFLayout` per GGUF
architecture in its registration; the type and what layouts share: `families/gguf_layout.py`): its Hugging
Face model_type, the metadata keys llama.cpp's converter writes for it (`known_keys`: any other `{arch}.`
key raises, naming it) and how they become a Hugging Face config, its tensor names (llama.cpp's -> Hugging
Face's), and what the converter changed that loading undoes. This module holds what they share: the
metadata read with checks (`Metadata`, which checks every size and real number), the keys every RMSNorm
architecture writes alike (llama's names, `_common_config`), and `hf_config`, which finds the layout of a
file's architecture among the registered families (`layouts`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np

from interp.errors import CheckpointError
from ..families import FAMILIES
from ..families.gguf_layout import GGUFLayout
from .gguf_file import GGUFFile, dequantize


def layouts() -> dict[str, GGUFLayout]:
    """Every GGUF architecture a registered family declares, with its layout (read when asked, so a family
    registered later, even outside the package, is found)."""
    return {arch: layout for family in FAMILIES.values() for arch, layout in family.gguf.items()}


class _Architectures(Mapping):
    """GGUF architecture -> Hugging Face model_type, over the registered families' layouts."""

    def __getitem__(self, arch: str) -> str:
        return layouts()[arch].model_type

    def __iter__(self) -> Iterator[str]:
        return iter(layouts())

    def __len__(self) -> int:
        return len(layouts())


ARCHITECTURES: Mapping[str, str] = _Architectures()


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value


class Metadata:
    """The `{arch}.*` metadata of one file, read with checks: a missing required key, a size that is not
    an integer >= 1, or a real that is not finite and > 0 raises, naming the key. A family's GGUF config
    function (`GGUFLayout.config`) reads the file through it."""

    def __init__(self, reader, arch: str, source: str) -> None:
        self.reader, self.arch, self.source = reader, arch, source

    def get(self, key: str, default=None):
        return _field(self.reader, f"{self.arch}.{key}", default)

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.reader.fields

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.source}: the GGUF metadata has no {self.arch}.{key}; is the file complete?")
        return value

    def count(self, key: str, default=None) -> int:
        """A size: an integer >= 1 (a 0 would divide by zero below, a negative build nothing sensible);
        `default` when absent (None: required)."""
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, list):
            raise NotImplementedError(f"{self.source}: per-layer values of {self.arch}.{key} are not supported")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise CheckpointError(f"{self.source}: the GGUF metadata {self.arch}.{key} = {value!r} is not a size "
                                  "(an integer >= 1); the file is corrupt")
        return int(value)

    def real(self, key: str, default=None) -> float:
        """A real number (a norm epsilon, a RoPE base): finite and > 0."""
        value = self.need(key) if default is None else self.get(key, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if not math.isfinite(number) or number <= 0:
            raise CheckpointError(f"{self.source}: the GGUF metadata {self.arch}.{key} = {value!r} is not a finite "
                                  "number > 0; the file is corrupt")
        return number

    def vocab_size(self) -> int:
        """`{arch}.vocab_size`, else the number of the tokenizer's tokens."""
        if self.get("vocab_size") is not None:
            return self.count("vocab_size")
        if "tokenizer.ggml.tokens" in self.reader.fields:
            return len(self.reader.fields["tokenizer.ggml.tokens"])
        raise CheckpointError(f"{self.source}: the GGUF metadata has neither {self.arch}.vocab_size nor "
                              "tokenizer.ggml.tokens")

    def small_tensor(self, name: str) -> list[float]:
        """A small tensor's values (LongRoPE's factors, Llama 3's RoPE divisors), read while making the config."""
        tensor = next(t for t in self.reader.tensors if t.name == name)
        try:
            return [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)]
        except (NotImplementedError, ValueError, IndexError) as e:
            raise CheckpointError(f"{self.source}: tensor {name!r} could not be read ({e})") from e


def hf_config(reader, source: str) -> dict:
    """A Hugging Face config dict from the metadata; raises on what the family cannot represent."""
    arch = _field(reader, "general.architecture")
    known = layouts()
    if arch not in known:
        raise NotImplementedError(
            f"{source}: GGUF architecture {arch!r} is not supported; interp reads {sorted(ARCHITECTURES)} GGUF files"
        )
    layout, meta = known[arch], Metadata(reader, arch, source)
    if layout.known_keys is not None:
        prefix = f"{arch}."
        unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix):] not in layout.known_keys)
        if unknown:
            raise NotImplementedError(f"{source}: the GGUF metadata key {unknown[0]} = {_field(reader, unknown[0])!r} "
                                      f"is not one interp can represent for {arch}; nothing was loaded")
    names = {t.name for t in reader.tensors}
    config = _common_config(meta, layout, names) if layout.common else {"model_type": layout.model_type}
    return config | layout.config(meta, config, names)


def _common_config(meta: Metadata, layout: GGUFLayout, names: set[str]) -> dict:
    """The keys every RMSNorm architecture here writes alike (llama's names)."""
    source, arch = meta.source, meta.arch
    n_heads = meta.count("attention.head_count")
    d_model = meta.count("embedding_length")
    if meta.get("attention.key_length") is not None:
        head_dim = meta.count("attention.key_length")
    elif d_model % n_heads:
        raise CheckpointError(f"{source}: embedding_length {d_model} is not a multiple of head_count {n_heads} "
                              "and no attention.key_length is given; the file is corrupt")
    else:
        head_dim = d_model // n_heads
    if meta.count("attention.value_length", head_dim) != head_dim:
        raise NotImplementedError(f"{source}: {arch}.attention.value_length differs from key_length; interp's heads "
                                  "have one width for keys and values")
    rope_dim = meta.count("rope.dimension_count", head_dim)
    partial = {}
    if rope_dim != head_dim:
        if not layout.partial_rotary or rope_dim > head_dim or rope_dim % 2:
            raise NotImplementedError(f"{source}: partial rotary ({arch}.rope.dimension_count = {rope_dim} of "
                                      f"{head_dim} dims) is not supported for GGUF {arch}")
        partial = {"partial_rotary_factor": rope_dim / head_dim}
    return {
        "model_type": layout.model_type,
        "num_hidden_layers": meta.count("block_count"),
        "hidden_size": d_model,
        "intermediate_size": meta.count("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.count("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "vocab_size": meta.vocab_size(),
        "max_position_embeddings": meta.count("context_length", 2048),
        "rms_norm_eps": meta.real("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in names,
        **partial,
    }


__all__ = ["ARCHITECTURES", "Metadata", "hf_config", "layouts"]
