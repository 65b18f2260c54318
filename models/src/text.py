"""Text in and out of the model, with TransformerLens's conventions: BOS per `cfg.default_prepend_bos`,
padding with the tokenizer's pad id on its side, strings back from ids. A mixin of `HookedTransformer`."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .config import ModelConfig
from .runtime import Runtime


def _is_text(x) -> bool:
    return isinstance(x, str) or (isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], str))


def _describe(x) -> str:
    return f"{type(x).__name__} {x!r}"[:80]


class TextModel(Protocol):
    """What `TextMixin` needs from the model it is mixed into (`HookedTransformer`), and all it reads."""

    cfg: ModelConfig  # n_ctx (truncation); handed to runtime.default_prepend_bos
    runtime: Runtime  # the text defaults: default_prepend_bos(cfg), padding_side(): decided there
    tokenizer: Any  # None or a Hugging Face-like tokenizer (encode / decode, bos / eos / pad ids)
    device: torch.device  # where token ids and masks are made
    W_U: Tensor  # [d_model, d_vocab], for tokens_to_residual_directions (`WeightViews` gives it)


class TextMixin:
    """Text in and out, mixed into a `TextModel` (`HookedTransformer`): every method reads the host
    only through the `TextModel` attributes (cfg, runtime, tokenizer, device, W_U) and this mixin's
    own methods (tests/contract/test_layers.py checks it)."""

    # ---- tokenizer helpers --------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer; pass token ids, or attach one: model.tokenizer = tok "
                "(any Hugging Face tokenizer, or interp.from_hf(model, tokenizer=tok))"
            )
        return self.tokenizer

    def bos_id(self, prepend_bos: bool | None) -> int | None:
        """The BOS id to put first (None: no BOS), for a call's `prepend_bos` (None: the model's default)."""
        want = self.runtime.default_prepend_bos(self.cfg) if prepend_bos is None else bool(prepend_bos)
        if not want:
            return None
        bos = getattr(self._need_tokenizer(), "bos_token_id", None)
        if bos is None:
            where = "prepend_bos=True was passed" if prepend_bos else "this model's config sets prepend_bos=True"
            raise ValueError(
                f"{where}, but the tokenizer ({type(self.tokenizer).__name__}) has no BOS token: pass "
                "prepend_bos=False, load the model with default_prepend_bos=False, or give the tokenizer a "
                "bos_token"
            )
        return int(bos)

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):  # TransformerLens pads with EOS when there is no pad
            value = getattr(tok, attr, None)
            if value is not None:
                return int(value)
        raise ValueError(
            "these texts have different lengths and the tokenizer has no pad, EOS or BOS token to pad them with; "
            "set tokenizer.pad_token_id, or tokenize them one at a time"
        )

    def _encode(self, text, prepend_bos: bool | None = None, padding_side: str | None = None,
                truncate: bool = True) -> tuple[Tensor, Tensor]:
        """Text -> (token ids [batch, pos], real-token mask [batch, pos]), BOS and padding as `to_tokens`."""
        tok = self._need_tokenizer()
        if isinstance(text, str):
            texts = [text]
        elif isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
            texts = list(text)
        else:
            raise TypeError(f"text must be a string or a non-empty list of strings, got {_describe(text)}")
        side = padding_side if padding_side is not None else self.runtime.padding_side()
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        bos = self.bos_id(prepend_bos)
        ids = [list(tok.encode(t, add_special_tokens=False) if hasattr(tok, "encode") else tok(t)) for t in texts]
        ids = [([bos] if bos is not None else []) + i for i in ids]
        if truncate:  # as TransformerLens: at most n_ctx tokens
            ids = [i[: self.cfg.n_ctx] for i in ids]
        if not all(ids):
            raise ValueError("a text tokenized to no tokens at all: give non-empty text (or prepend_bos=True)")
        width = max(len(i) for i in ids)
        pad = self._pad_id() if any(len(i) < width for i in ids) else 0
        rows, valid = [], []
        for i in ids:
            fill = [pad] * (width - len(i))
            rows.append(i + fill if side == "right" else fill + i)
            real = [True] * len(i)
            valid.append(real + [False] * len(fill) if side == "right" else [False] * len(fill) + real)
        return (torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.tensor(valid, dtype=torch.bool, device=self.device))

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> Tensor:
        """Text -> token ids [batch, pos], as TransformerLens's `to_tokens`.

        prepend_bos   None: the model's default (`model.cfg.default_prepend_bos`: True when the tokenizer
                      has a BOS token, unless the model's config or `interp.load(..., default_prepend_bos=)`
                      says otherwise); True / False for this call.
        padding_side  for texts of different lengths: "right" or "left" (default: the tokenizer's, else
                      right). Padding is the tokenizer's pad id (its EOS when it has none). Passing the
                      texts themselves to the model (`model(texts)`) builds the attention mask too.
        truncate      keep at most n_ctx tokens."""
        return self._encode(input, prepend_bos, padding_side, truncate)[0]

    def to_text_mask(self, input: str | list[str], prepend_bos: bool | None = None,
                     padding_side: str | None = None) -> Tensor:
        """The attention mask [batch, pos] (1 for real tokens) of `to_tokens(input, ...)`: what
        TransformerLens's `utils.get_attention_mask` gives, from the true lengths rather than pad ids."""
        return self._encode(input, prepend_bos, padding_side)[1].long()

    def to_string(self, tokens) -> str | list[str]:
        tok = self._need_tokenizer()
        t = torch.as_tensor(tokens)
        if t.dim() <= 1:
            return tok.decode(t.tolist())
        return [tok.decode(row.tolist()) for row in t]

    def to_str_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None):
        """One string per token, as TransformerLens: text (BOS per `prepend_bos`, default the model's),
        token ids [pos] / [1, pos], or a list of texts / a [batch, pos] tensor (a list per row).
        Special tokens keep their names ("<bos>", "<|endoftext|>"): a position is never shown as ""."""
        tok = self._need_tokenizer()
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
            return [self.to_str_tokens(t, prepend_bos, padding_side) for t in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos, padding_side)[0]
        else:
            ids = torch.as_tensor(input)
            if ids.dim() == 2 and ids.shape[0] > 1:
                return [self.to_str_tokens(row) for row in ids]
            ids = ids.reshape(-1)
        return [tok.decode([i], skip_special_tokens=False) for i in ids.tolist()]

    def to_single_token(self, string: str) -> int:
        """The id of the one token `string` encodes to (raises if it is not exactly one token)."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {ids.tolist()}")
        return int(ids.item())

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id."""
        if not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes one int token id, got {_describe(int_token)}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def get_token_position(self, single_token, input, mode: str = "first", prepend_bos: bool | None = None,
                           padding_side: str | None = None) -> int:
        """Where `single_token` (a one-token string or an id) occurs in `input` (a text, or ids [pos] /
        [1, pos]): its first or last position (`mode`). Text gets BOS per `prepend_bos`, as in
        TransformerLens."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        ids = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"get_token_position takes one sequence, got a batch of {ids.shape[0]}")
            ids = ids[0]
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        where = (ids == token).nonzero()[:, 0]
        if where.numel() == 0:
            raise ValueError(f"token {token} ({self.to_single_str_token(token) if self.tokenizer else token!r}) "
                             "does not occur in the input")
        return int(where[0] if mode == "first" else where[-1])

    def tokens_to_residual_directions(self, tokens) -> Tensor:
        """The unembedding directions W_U[:, token]: [*tokens.shape, d_model], or [d_model] for a single
        token (a str, an int or any one-element tensor, as TransformerLens does)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        t = torch.as_tensor(tokens, device=self.device)
        if t.numel() == 1:
            return self.W_U[:, int(t.item())]
        return self.W_U[:, t].movedim(0, -1)
