"""`ByteTokenizer`: UTF-8 bytes as tokens, with one extra id for beginning-of-sequence.

The zoo models are trained on raw bytes, so their tokenizer needs no vocabulary file and no
`transformers`/`tokenizers` install: ids 0..255 are the bytes, id 256 is `<bos>` (also the document
separator in training data and the padding id; padding is masked, so sharing the id is harmless, as
GPT-2 does with `<|endoftext|>`). `d_vocab` is 257.

Saved beside a checkpoint as `tokenizer.json`:

    {"type": "bytes", "version": 1, "bos_token_id": 256, "pad_token_id": 256, "vocab_size": 257}

`load_tokenizer(dir)` reads that file back (and returns None for any other tokenizer.json, so the
caller can fall back to Hugging Face's AutoTokenizer). A tokenizer set to pad on the left also writes
`"padding_side": "left"` (right, the default, writes nothing, so older files read as they always did).

`padding_side` ("right" or "left") is where a model's `to_tokens` pads texts of different lengths by
default, as a Hugging Face tokenizer's is (TransformerLens code sets and reads `model.tokenizer.padding_side`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

TOKENIZER_FILE = "tokenizer.json"
_FORMAT = "bytes"
_VERSION = 1


class ByteTokenizer:
    """Bytes in, bytes out. `encode(text) -> list[int]`, `decode(ids) -> str` (invalid UTF-8, e.g. a
    lone continuation byte from `to_str_tokens`, decodes to U+FFFD; special ids decode to "")."""

    n_bytes = 256

    def __init__(self, bos_token_id: int = 256, pad_token_id: int | None = None, padding_side: str = "right") -> None:
        if bos_token_id < self.n_bytes:
            raise ValueError(f"bos_token_id must be >= 256 (ids 0..255 are the bytes), got {bos_token_id}")
        self.bos_token_id = bos_token_id
        self.eos_token_id = bos_token_id
        self.pad_token_id = bos_token_id if pad_token_id is None else pad_token_id
        self.vocab_size = max(self.bos_token_id, self.pad_token_id) + 1
        self.padding_side = padding_side

    @property
    def padding_side(self) -> str:
        """Where texts of different lengths are padded: "right" (the default) or "left"."""
        return self._padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        if side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {side!r}")
        self._padding_side = side

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of `text`; with add_special_tokens, `<bos>` first."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of the byte ids; special ids are dropped (or shown as `<bos>`/`<pad>`)."""
        out, chunk = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < self.n_bytes:
                chunk.append(i)
                continue
            if i >= self.vocab_size or i < 0:
                raise ValueError(f"token id {i} is outside this tokenizer's vocabulary [0, {self.vocab_size})")
            if not skip_special_tokens:
                out.append(chunk.decode("utf-8", errors="replace"))
                chunk = bytearray()
                out.append("<bos>" if i == self.bos_token_id else "<pad>")
        out.append(chunk.decode("utf-8", errors="replace"))
        return "".join(out)

    def to_dict(self) -> dict:
        out = {"type": _FORMAT, "version": _VERSION, "bos_token_id": self.bos_token_id,
               "pad_token_id": self.pad_token_id, "vocab_size": self.vocab_size}
        return out if self.padding_side == "right" else {**out, "padding_side": self.padding_side}

    def save_pretrained(self, path) -> Path:
        """Write `tokenizer.json` into the directory `path` (created if missing)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / TOKENIZER_FILE).write_text(json.dumps(self.to_dict(), indent=2))
        return path / TOKENIZER_FILE

    @classmethod
    def from_dict(cls, data: dict) -> "ByteTokenizer":
        if data.get("type") != _FORMAT:
            raise ValueError(f"not a byte tokenizer: type={data.get('type')!r}")
        if data.get("version", _VERSION) > _VERSION:
            raise ValueError(f"byte tokenizer format version {data['version']} is newer than this interp ({_VERSION})")
        return cls(bos_token_id=data["bos_token_id"], pad_token_id=data.get("pad_token_id"),
                   padding_side=data.get("padding_side", "right"))

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id})"


def load_tokenizer(path) -> ByteTokenizer | None:
    """Our tokenizer saved in directory `path`, or None when `path` holds none (or another kind)."""
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("type") != _FORMAT:
        return None
    return ByteTokenizer.from_dict(data)


__all__ = ["ByteTokenizer", "load_tokenizer"]
