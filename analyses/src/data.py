"""`DataSpec`: which tokens a sweep feeds every checkpoint, reproducible from a few fields.

A sweep compares checkpoints, so every checkpoint must see exactly the same tokens. The spec is
small, frozen and JSON-serialisable; `settings.json` records it, and `build_tokens` rebuilds the
identical tensor in any process (local workers, Ray workers on other machines) from it alone.

kinds:
  auto             "corpus" when every checkpoint of the sweep is a byte-level zoo model, "text"
                   when every checkpoint has a real (subword) tokenizer, else "repeated_random";
                   settled (`resolve_kind`) before settings.json is written.
  text             real English prose: by default the Python Language Reference as interp ships it
                   (`interp.analyses.evaldata`, "python-language-reference": CPython 3.11.7's
                   `pydoc_data.topics`, ~466 KB, every topic sorted by name, joined by blank lines;
                   the same bytes whatever Python runs), or the UTF-8 file at `path` (`--text-file`).
                   Cut into consecutive `seq_len`-token windows of the model's tokenizer (BOS first when the
                   tokenizer has one); `n_seqs` of the first `TEXT_POOL * n_seqs` windows are drawn
                   with `seed`. The text is read and tokenized only as far as those windows reach
                   (in line-aligned pieces), so a 50 MB file costs what 128 tokens of it cost (and
                   one streamed sha256 of its bytes, which names it: `data_source`).
  repeated_random  `n_seqs` rows of `seq_len` tokens: a random half (uniform over the vocabulary,
                   from `seed`) followed by the same half again. Previous-token, duplicate-token
                   and induction behaviour all show on it (Olsson et al. 2022), and it needs no
                   corpus, so it suits any model.
  corpus           held-out windows (`<bos>` + bytes) of the zoo's training corpus, the Python
                   standard library's sources (`interp.models.zoo.training.eval_windows`, files never
                   trained on), drawn with `seed`: natural text, so losses, ablations and ICL
                   scores mean something. Byte-level (ByteTokenizer) models only. The files are the
                   90 held-out files interp ships ("python-stdlib-heldout", taken from CPython
                   3.11.7, the zoo's training Python), never the running Python's.
  file             token ids saved at `path` (`.pt` tensor or `.npy` array, [n_seqs, seq_len] or
                   flat); the first `n_seqs` rows of `seq_len` are used.

Every kind but repeated_random reads a data source, named by sha256 (`data_source`): the shipped file's
pinned hash, or the hash of the user's file. settings.json and the report record it, and a sweep folder
holding results of another source is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from . import evaldata
from interp.errors import BadValue, check_int
from interp.models.zoo.probes import repeated_random_tokens
from interp.models.formats.tokenizer import ByteTokenizer, load_tokenizer
from interp.models.zoo.training import eval_windows

DataKind = Literal["auto", "repeated_random", "corpus", "file", "text"]
DATA_KINDS = ("auto", "repeated_random", "corpus", "file", "text")


@dataclass(frozen=True)
class DataSpec:
    kind: DataKind = "auto"
    n_seqs: int = 16
    seq_len: int = 256  # the zoo's context; a model with a shorter one is refused by build_tokens
    seed: int = 0
    path: str | None = None  # token file (kind="file"), or a UTF-8 text file (kind="text"; None: the shipped Language Reference)

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(f"unknown data kind {self.kind!r}; choose one of {DATA_KINDS}")
        check_int("n_seqs", self.n_seqs, minimum=1)
        check_int("seq_len", self.seq_len, minimum=4)
        check_int("seed", self.seed, minimum=0, maximum=2**32 - 1, hint="seeds are numpy's: 0 .. 2**32 - 1")
        if self.kind == "file" and self.path is None:
            raise ValueError("kind='file' needs path=... (token ids in .pt or .npy)")
        if self.kind not in ("file", "text") and self.path is not None:
            raise ValueError(f"kind={self.kind!r} takes no path; a path goes with kind 'file' (token ids) or 'text'")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataSpec":
        return cls(**d)

    def describe(self) -> str:
        what = {
            "repeated_random": "random tokens repeated once (first half uniform over the vocabulary, second half a copy)",
            "corpus": "held-out windows of the zoo training corpus",
            "file": f"token ids from {self.path}",
            "text": f"consecutive windows of {self.path or 'the Python Language Reference (shipped)'}",
            "auto": "chosen per sweep",
        }[self.kind]
        source = data_source(self) if self.kind != "auto" else None
        named = f" ({source['name']}, sha256 {source['sha256'][:12]})" if source else ""
        return f"{self.n_seqs} sequences x {self.seq_len} tokens, {what}, seed {self.seed}{named}"


def resolve_kind(kind: str, checkpoint_paths: list[str]) -> str:
    """`kind`, with "auto" settled: "corpus" if every checkpoint has the zoo's byte tokenizer,
    "text" if every one has a real tokenizer (a Hugging Face tokenizer file or a GGUF's)."""
    if kind != "auto":
        return kind

    def is_bytes(path: str) -> bool:
        try:
            return load_tokenizer(Path(path)) is not None
        except Exception:  # noqa: BLE001 - a broken tokenizer file just means "not the zoo's"
            return False

    def has_tokenizer(path: str) -> bool:
        p = Path(path)
        return p.suffix == ".gguf" or (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists()

    if checkpoint_paths and all(is_bytes(p) for p in checkpoint_paths):
        return "corpus"
    if checkpoint_paths and all(has_tokenizer(p) for p in checkpoint_paths):
        return "text"
    return "repeated_random"


TEXT_POOL = 4  # kind "text" draws its n_seqs windows from the first TEXT_POOL * n_seqs of the text
_PIECE_CHARS = 1 << 16  # the text is read and tokenized in pieces of about this many characters


def data_source(spec: DataSpec) -> dict | None:
    """The data `spec` reads, named by sha256: {name, sha256} (plus licence and source for the shipped
    files); None for repeated_random, which reads nothing. A user's file is hashed whole, in pieces."""
    if spec.kind == "auto":
        raise ValueError("settle data kind 'auto' with resolve_kind() first")
    if spec.kind == "repeated_random":
        return None
    if spec.path is None:
        return evaldata.source(evaldata.HELDOUT if spec.kind == "corpus" else evaldata.LANGUAGE_REFERENCE)
    try:  # hashed on every call, never cached: a file rewritten in place between two calls is other data
        return {"name": str(spec.path), "sha256": evaldata.sha256_file(spec.path)}
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {spec.path} does not exist") from None


def source_line(source: dict | None) -> str:
    """One sentence naming a `data_source`: what a report says its numbers were computed on."""
    if source is None:
        return "Data source: none read (tokens generated from the seed)."
    licence = f"; licence: {source['licence']}" if source.get("licence") else ""
    return f"Data source: {source['name']}, sha256 {source['sha256']}{licence}."


def data_clash(recorded: dict, source: dict | None) -> str | None:
    """Why results recorded with `recorded` (an old settings.json) cannot sit beside results computed on
    `source` (`data_source`), in words naming both hashes; None when they are the same data. A folder
    from before data was named by hash counts as other data, unless neither reads any (repeated_random)."""
    was = recorded.get("data_source", "unrecorded")
    was_sha = was.get("sha256") if isinstance(was, dict) else was
    now_sha = source["sha256"] if source else None
    if was_sha == now_sha or (was_sha == "unrecorded" and now_sha is None):
        return None
    name = lambda s: f" ({s['name']})" if isinstance(s, dict) else ""  # noqa: E731
    return (f"holds results computed on data sha256 {was_sha}{name(was)}, and this run's data is sha256 "
            f"{now_sha}{name(source)}")


def read_text(path: str | None = None) -> str:
    """The whole text of kind "text": the file at `path`, or the Python Language Reference (shipped).
    The sweep itself reads only what it uses (`_text_pieces`)."""
    return "".join(_text_pieces(path))


def _text_pieces(path: str | None = None, limit: int | None = None):
    """The text in pieces of about `_PIECE_CHARS` characters, each ending at a line end where there is
    one (so a piece boundary never splits a word), until `limit` characters have been given (None: all)."""
    if path is None:
        source = iter([evaldata.language_reference()])
    else:
        source = _file_chunks(path)
    given, carry = 0, ""
    for chunk in source:
        carry += chunk
        while len(carry) >= _PIECE_CHARS:
            cut = carry.rfind("\n", 0, _PIECE_CHARS * 2)
            cut = len(carry) if cut < 0 else cut + 1
            piece, carry = carry[:cut], carry[cut:]
            yield piece
            given += len(piece)
            if limit is not None and given >= limit:
                return
    if carry:
        yield carry


def _file_chunks(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(_PIECE_CHARS):
                if "\x00" in chunk:  # valid UTF-8, but no text holds NUL: a binary file (an image, a tensor ...)
                    raise ValueError(f"--text-file {path} holds NUL bytes: a binary file, not UTF-8 text")
                yield chunk
    except FileNotFoundError:
        raise FileNotFoundError(f"--text-file {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--text-file {path} is not UTF-8 text ({e.reason} near byte {e.start} of a piece)") from None


def check_data(spec: DataSpec) -> None:
    """Cheap checks before any model is loaded: the data file exists and (for text) is long enough
    that the windows can possibly fit (a token is at least one character: only that many are read)."""
    if spec.path is not None and not Path(spec.path).is_file():
        raise FileNotFoundError(f"data file {spec.path} does not exist")
    if spec.kind != "auto":
        data_source(spec)  # a shipped file that fails its sha256 (a broken install): said now, in one line
    if spec.kind == "file":
        prebuild_tokens(spec)  # reads it (once: cached): wrong dtype, shape or length fail here, before any model
    if spec.kind == "text":
        need = spec.n_seqs * spec.seq_len
        n = sum(len(piece) for piece in _text_pieces(spec.path, limit=need))
        if n < need:
            raise ValueError(f"the text ({n} characters) is too short for {spec.n_seqs} sequences of {spec.seq_len} "
                             "tokens; use a longer --text-file or fewer/shorter sequences (--n-seqs, --seq-len)")


def prebuild_tokens(spec: DataSpec) -> Tensor | None:
    """The tokens of a model-independent kind (corpus, file), built once by the sweep's driver and
    shipped with each task, so every worker, on any machine, gets the very same tensor (and the
    corpus is read once, not per worker). None for kinds that depend on the model's vocabulary."""
    if spec.kind == "auto":
        raise ValueError("settle data kind 'auto' with resolve_kind() first")
    return _cached(spec, None, _bytes_key(spec)) if spec.kind in ("corpus", "file") else None


def build_tokens(spec: DataSpec, model, prebuilt: Tensor | None = None) -> Tensor:
    """The [n_seqs, seq_len] token ids `spec` names for `model` (`prebuilt`: from `prebuild_tokens`),
    identical on every call and in every process; checked against the model's vocabulary and context."""
    if spec.kind == "auto":
        raise ValueError("settle data kind 'auto' with resolve_kind() first")
    cfg = model.cfg
    if cfg.positional in ("learned", "sinusoidal") and spec.seq_len > cfg.n_ctx:
        raise ValueError(f"the data's sequences ({spec.seq_len} tokens) are longer than this model's context "
                         f"(n_ctx={cfg.n_ctx}); pass --seq-len {cfg.n_ctx} (or less)")
    tokens = prebuilt if prebuilt is not None else (
        _text(spec, model) if spec.kind == "text" else _cached(spec, cfg.d_vocab, _bytes_key(spec)))
    if int(tokens.max()) >= cfg.d_vocab or int(tokens.min()) < 0:
        raise ValueError(f"the data ({spec.kind}) holds token ids outside this model's vocabulary [0, {cfg.d_vocab})")
    if spec.kind == "corpus" and not isinstance(model.tokenizer, ByteTokenizer):
        raise ValueError("data kind 'corpus' is byte-level text for the zoo's ByteTokenizer models; this model has "
                         f"{type(model.tokenizer).__name__}: use --data repeated_random or --data file")
    return tokens


def _bytes_key(spec: DataSpec) -> str | None:
    """What the token caches below are keyed by besides the spec: the sha256 of the user's file, so a file
    rewritten in place is read again (the shipped files and generated tokens never change)."""
    return data_source(spec)["sha256"] if spec.path is not None else None


@functools.lru_cache(maxsize=4)
def _cached(spec: DataSpec, d_vocab: int | None, key: str | None = None) -> Tensor:
    return _BUILDERS[spec.kind](spec, d_vocab)


def _repeated_random(spec: DataSpec, d_vocab: int) -> Tensor:
    return repeated_random_tokens(spec.n_seqs, (spec.seq_len + 1) // 2, d_vocab, seed=spec.seed, total=spec.seq_len)


def _corpus(spec: DataSpec, d_vocab: int | None) -> Tensor:
    return eval_windows(evaldata.heldout_docs(), spec.seq_len, spec.n_seqs, seed=spec.seed)


def read_token_file(path) -> Tensor:
    """Integer token ids from a .npy or .pt file, as saved: [n_seqs, seq_len] or flat (int64).
    A missing or unreadable file, non-integer values or more than two dimensions: a clear error."""
    path = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        raw = np.load(path) if path.endswith(".npy") else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        # never torch's own advice: it suggests weights_only=False, which runs whatever the file's pickle says
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = "" if not first or "weights_only" in str(e) else f": {first[:200]}"
        raise ValueError(f"cannot read token ids from {path} ({type(e).__name__}{why}); it is not a tensor saved with "
                         "torch.save (.pt) or numpy.save (.npy): save the token ids that way") from None
    raw = torch.as_tensor(raw)
    if raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool:
        raise ValueError(f"{path} holds {raw.dtype} values; token ids must be integers (e.g. int64)")
    if raw.dim() > 2:
        raise ValueError(f"{path} has shape {tuple(raw.shape)}; token ids must be [n_seqs, seq_len] or flat")
    if raw.numel() and int(raw.min()) < 0:
        raise BadValue(f"{path} holds the negative token id {int(raw.min())}; token ids are >= 0")
    return raw.to(torch.long)


def _file(spec: DataSpec, d_vocab: int | None) -> Tensor:
    path = spec.path
    tokens = read_token_file(path).reshape(-1)
    need = spec.n_seqs * spec.seq_len
    if tokens.numel() < need:
        raise ValueError(f"{path} holds {tokens.numel()} tokens; the data spec needs {spec.n_seqs} x {spec.seq_len} = {need}")
    return tokens[:need].reshape(spec.n_seqs, spec.seq_len)


def _text(spec: DataSpec, model) -> Tensor:
    if model.tokenizer is None:
        raise ValueError("data kind 'text' needs the model's tokenizer, and this model has none: use --data "
                         "repeated_random or --data file")
    return _text_windows(spec, model.tokenizer, _bytes_key(spec))


@functools.lru_cache(maxsize=4)
def _text_windows(spec: DataSpec, tokenizer, key: str | None = None) -> Tensor:
    bos = getattr(tokenizer, "bos_token_id", None)
    body = spec.seq_len - (bos is not None)
    pool = TEXT_POOL * spec.n_seqs
    ids: list[int] = []
    for piece in _text_pieces(spec.path):  # tokenized only as far as the pool of windows reaches
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if len(ids) >= pool * body:
            break
    n_windows = min(len(ids) // body, pool)
    if n_windows < spec.n_seqs:
        raise ValueError(f"the text holds {len(ids)} tokens: {n_windows} windows of {spec.seq_len}, fewer than the "
                         f"{spec.n_seqs} asked for; use a longer --text-file or fewer/shorter sequences")
    chosen = torch.randperm(n_windows, generator=torch.Generator().manual_seed(spec.seed))[: spec.n_seqs].sort().values
    windows = torch.tensor(ids[: n_windows * body], dtype=torch.long).view(n_windows, body)[chosen]
    if bos is not None:
        windows = torch.cat([torch.full((spec.n_seqs, 1), bos, dtype=torch.long), windows], dim=1)
    return windows


_BUILDERS = {"repeated_random": _repeated_random, "corpus": _corpus, "file": _file}
