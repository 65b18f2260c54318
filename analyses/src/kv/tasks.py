"""Long-context retrieval prompts: passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention")
and a needle in real text. Pure prompt building: the prompts, where the key sits in their tokens, and
how an answer is scored; running a model over them (cache policies, decoding) is the caller's.

A prompt is five lines (an empty one is left out):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.
    <filler before the needle>
    The pass key is 48213. Remember it. 48213 is the pass key.
    <filler after the needle>
    What is the pass key? The pass key is

variants:
  passkey  the filler is "The grass is green. The sky is blue. The sun is yellow. Here we go. There and
           back again." repeated, counted in sentences (a unit is one sentence, ~5 tokens).
  needle   the filler is real English prose: the Python Language Reference that ships with the
           standard library (`pydoc_data.topics`, as `data.read_text` gives it), from its start,
           counted in lines (a unit is one line, ~10 tokens, at most ~40); past its end (~110k tokens
           of a subword tokenizer) it starts over.

length   the requested size in tokens of the model's tokenizer, BOS included when the model puts one
         first (`model.to_tokens`). The whole text is tokenized at once (never pieces joined: their
         boundaries would tokenize differently), and the prompt holds the most filler units whose
         tokens fit: `n_tokens <= length`, a unit or so short of it.
depth    the fraction of the filler before the needle, 0 (right after the instruction) .. 1 (right
         before the question), in characters, at the unit boundary nearest to it. In tokens the key's
         position is then within about a unit of instruction + depth * filler (for the needle variant
         also up to how unevenly characters map to tokens: prose vs indented code).
key      5 digits (10000 .. 99999). `retrieval_prompts` draws each (length, depth) cell's keys from
         its own `random.Random` seeded by (seed, length, depth), never the global generator: a cell's
         prompts are the same whatever other cells are asked for, and the two variants get the same
         keys (they differ only in the filler).
key_span the token indices [start, end) of the needle's first key (the "48213" of "The pass key is
         48213."): the fewest tokens whose text covers its characters, found from the tokenizer's
         character offsets (Hugging Face fast tokenizers) or else by decoding prefixes of the prompt.
         When the tokenizer splits digits from the space before them (the zoo's bytes, SmolLM2: one
         token per digit), decoding the span gives exactly the key; a tokenizer that merges the space
         into the first digit's token (GPT-2) gives " 48213".

Scoring: greedy-decode a few tokens after the prompt; `is_correct(text, key)` is true when the key
appears in the continuation as a whole number (not inside a longer run of digits). Accuracy is always
reported with its count: `accuracy_label(8, 10) == "8 of 10"`.

    from interp.analyses.kv.tasks import retrieval_prompts, is_correct, accuracy_label

    prompts = retrieval_prompts(model, lengths=[1024, 2048], depths=[0.1, 0.4, 0.7], n_per_cell=10, seed=0)
    p = prompts[0]
    p.n_tokens, p.key, model.to_string(p.tokens[0, p.key_span[0]:p.key_span[1]])  # SmolLM2: 1024, '18248', '18248'
    out = model.generate(p.tokens, max_new_tokens=8, do_sample=False)
    ok = is_correct(model.to_string(out[0, p.n_tokens:]), p.key)  # ' 18248.\n': True

Bad input (an unknown variant, a depth outside [0, 1], a length too short for the instruction, needle
and question or above the model's context `cfg.n_ctx` (or the `max_length` a study passes to read past
it: `interp extrapolate`), n_per_cell < 1, a model without a tokenizer) raises `BadValue` before any
prompt is built.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from torch import Tensor

from interp.errors import BadValue, check_int, check_real

from interp.analyses.data import read_text

Variant = Literal["passkey", "needle"]
VARIANTS = ("passkey", "needle")

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
               "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
KEY_LEAD = "The pass key is "  # the needle's text right before its first key
QUESTION = "What is the pass key? The pass key is"
KEY_RANGE = (10000, 99999)  # drawn keys: 5 digits, no leading zero


def needle(key: str) -> str:
    return f"{KEY_LEAD}{key}. Remember it. {key} is the pass key."


@dataclass(frozen=True, eq=False)  # eq=False: `tokens` is a tensor; compare prompts field by field
class RetrievalPrompt:
    variant: str  # "passkey" or "needle"
    length: int  # requested tokens
    depth: float  # fraction of the filler before the needle
    seed: int | None  # the seed its key was drawn with (None: the key was given)
    key: str  # "48213"
    text: str  # the prompt's text (without BOS)
    tokens: Tensor  # [1, n_tokens] long, on the model's device, BOS first when the model puts one
    key_span: tuple[int, int]  # [start, end) token indices of the needle's first key

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[-1])


# ---- checks ------------------------------------------------------------------------------------
def _check_variant(variant) -> str:
    if variant not in VARIANTS:
        raise BadValue(f"unknown retrieval variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return variant


def _check_depth(depth) -> float:
    depth = check_real("depth", depth)
    if not 0.0 <= depth <= 1.0:
        raise BadValue(f"depth must be between 0 and 1 (the fraction of the filler before the needle), got {depth}")
    return depth


def _check_key(key) -> str:
    if not isinstance(key, str) or not key or not all(c in "0123456789" for c in key):
        raise BadValue(f"key must be a string of digits such as '48213', got {key!r}")
    return key


def _check_model(model) -> None:
    if getattr(model, "tokenizer", None) is None:
        raise BadValue("this model has no tokenizer, and retrieval prompts are text; attach one "
                       "(model.tokenizer = tok) or load a model that has one")


def _check_length(model, length, max_length: int | None = None) -> int:
    n_ctx = model.cfg.n_ctx
    check_int("length", length, minimum=1)
    if max_length is not None:  # a study that reads past the trained context on purpose (interp extrapolate)
        if length > max_length:
            raise BadValue(f"length {length} is above max_length={max_length}")
    elif length > n_ctx:
        raise BadValue(f"length {length} is above this model's context (n_ctx={n_ctx}); ask for at most {n_ctx} tokens")
    return length


def _check_room(model, variant: str, length: int, keys: Sequence[str]) -> None:
    """The instruction, needle and question fit in `length` tokens for every key (one short text each)."""
    need = max(_shortest(model, variant, key) for key in set(keys))
    if length < need:
        raise BadValue(f"length {length} is too short for a {variant} prompt: its instruction, needle and question "
                       f"alone take {need} tokens of this model's tokenizer; ask for at least {need} (and more, to "
                       "leave filler to hide the needle in)")


def _shortest(model, variant: str, key: str) -> int:
    """Tokens of the prompt with no filler at all."""
    return _count(model, _compose(variant, 0, 0.0, key)[0])


# ---- building ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _haystack_lines() -> tuple[str, ...]:
    return tuple(read_text().split("\n"))


def _units(variant: str, n: int) -> list[str]:
    """The first n filler units of `variant` (cycling through its source)."""
    source = FILLER if variant == "passkey" else _haystack_lines()
    return [source[i % len(source)] for i in range(n)]


_JOIN = {"passkey": " ", "needle": "\n"}  # sentences run on; lines stay lines


def _compose(variant: str, n_units: int, depth: float, key: str) -> tuple[str, int]:
    """The prompt text with `n_units` filler units, and the character index of its needle's first key."""
    units = _units(variant, n_units)
    ends = list(itertools.accumulate(len(u) + 1 for u in units))  # characters up to each unit boundary
    k = min(range(n_units + 1), key=lambda i: abs((ends[i - 1] if i else 0) - depth * (ends[-1] if units else 0)))
    join = _JOIN[variant]
    before = [p for p in (INSTRUCTION, join.join(units[:k])) if p]
    after = [p for p in (join.join(units[k:]), QUESTION) if p]
    head = "\n".join(before) + "\n"
    return head + "\n".join([needle(key), *after]), len(head) + len(KEY_LEAD)


def _count(model, text: str) -> int:
    return int(model.to_tokens(text, truncate=False).shape[-1])


def _most_units(fits: Callable[[int], bool], guess: int) -> int:
    """The largest n >= 0 with fits(n) (fits(0) holds), searched from `guess`: gallop to a bracket, then
    bisect. Token counts grow with n up to a token of boundary effects; n is always one that fits."""
    lo, hi = 0, None  # fits(lo); not fits(hi)
    guess, step = max(guess, 1), max(guess // 32, 1)
    if fits(guess):
        lo = guess
        while hi is None:
            if fits(lo + step):
                lo, step = lo + step, step * 2
            else:
                hi = lo + step
    else:
        hi = guess
        while lo == 0 and hi - step > 0:
            if fits(hi - step):
                lo = hi - step
            else:
                hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _build(model, variant: str, length: int, depth: float, key: str, seed: int | None) -> RetrievalPrompt:
    base = _shortest(model, variant, key)
    per_unit = _count(model, _JOIN[variant].join(_units(variant, 64))) / 64  # only where the search starts
    n = _most_units(lambda n: _count(model, _compose(variant, n, depth, key)[0]) <= length,
                    int((length - base) / per_unit))
    text, key_at = _compose(variant, n, depth, key)
    tokens = model.to_tokens(text, truncate=False)  # the prompt: tokenized once, whole
    span = _key_span(model.tokenizer, tokens[0].tolist(), text, key_at, key)
    return RetrievalPrompt(variant=variant, length=length, depth=depth, seed=seed, key=key, text=text,
                           tokens=tokens, key_span=span)


# ---- where the key is ----------------------------------------------------------------------------
def _key_span(tokenizer, ids: list[int], text: str, key_at: int, key: str) -> tuple[int, int]:
    if text.find(KEY_LEAD + key) != key_at - len(KEY_LEAD):  # the needle's key is the first such text
        raise AssertionError(f"the needle's key {key} is not the first 'pass key' text of the prompt")
    span = _span_from_offsets(tokenizer, ids, text, key_at, key_at + len(key))
    return span if span is not None else _span_by_decoding(tokenizer, ids, key)


def _span_from_offsets(tokenizer, ids: list[int], text: str, start: int, end: int) -> tuple[int, int] | None:
    """The tokens overlapping characters [start, end), from a fast tokenizer's offsets; None when the
    tokenizer gives none, or its ids (without special tokens) are not the prompt's after its BOS."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return None
    body, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    lead = len(ids) - len(body)  # the BOS put first, if any
    if lead < 0 or ids[lead:] != body:
        return None
    hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return (hit[0] + lead, hit[-1] + lead + 1) if hit else None


def _span_by_decoding(tokenizer, ids: list[int], key: str) -> tuple[int, int]:
    """The tokens of the first "The pass key is <key>", found by decoding prefixes: the key starts in the
    token that completes "The pass key is <first digit>" and ends with the one completing the key."""

    def first_prefix_with(s: str) -> int:  # smallest i with s in decode(ids[:i]); containment grows with i
        lo, hi = 0, len(ids)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if s in tokenizer.decode(ids[:mid]) else (mid, hi)
        return hi

    return first_prefix_with(KEY_LEAD + key[0]) - 1, first_prefix_with(KEY_LEAD + key)


# ---- the public surface --------------------------------------------------------------------------
def passkey_prompt(model, length: int, depth: float, key: str, *, variant: Variant = "passkey",
                   seed: int | None = None, max_length: int | None = None) -> RetrievalPrompt:
    """One retrieval prompt of at most `length` tokens with the needle holding `key` at `depth`
    (`seed`: only recorded, for a key drawn by the caller). `max_length`: the longest length allowed
    (default the model's context, n_ctx; past it only for a study of reading past it)."""
    variant, depth, key = _check_variant(variant), _check_depth(depth), _check_key(key)
    _check_model(model)
    length = _check_length(model, length, max_length)
    _check_room(model, variant, length, [key])
    return _build(model, variant, length, depth, key, seed)


def cell_keys(seed: int, length: int, depth: float, n: int) -> list[str]:
    """The `n` keys of cell (length, depth) for `seed`: 5-digit strings from that cell's own generator."""
    rng = random.Random(f"retrieval:{seed}:{length}:{float(depth)!r}")
    return [str(rng.randint(*KEY_RANGE)) for _ in range(n)]


def retrieval_prompts(model, lengths: Sequence[int], depths: Sequence[float], n_per_cell: int, seed: int,
                      variant: Variant = "passkey", *, max_length: int | None = None) -> list[RetrievalPrompt]:
    """`n_per_cell` prompts for every (length, depth), in that order (lengths outer, depths inner), keys
    from `cell_keys(seed, length, depth, n_per_cell)`: the same arguments give the same prompts.
    `max_length`: the longest length allowed (default n_ctx), as `passkey_prompt`."""
    variant = _check_variant(variant)
    _check_model(model)
    lengths, depths = _check_list("lengths", lengths, "[1024, 2048]"), _check_list("depths", depths, "[0.1, 0.5, 0.9]")
    lengths = [_check_length(model, length, max_length) for length in lengths]
    depths = [_check_depth(depth) for depth in depths]
    check_int("n_per_cell", n_per_cell, minimum=1)
    check_int("seed", seed, minimum=0)
    cells = [(length, depth, cell_keys(seed, length, depth, n_per_cell)) for length in lengths for depth in depths]
    for length in lengths:
        _check_room(model, variant, length, [k for cell_length, _, keys in cells if cell_length == length for k in keys])
    return [_build(model, variant, length, depth, key, seed) for length, depth, keys in cells for key in keys]


def _check_list(name: str, values, example: str) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise BadValue(f"{name} must be a non-empty list, e.g. {name}={example}; got {values!r}")
    values = list(values)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise BadValue(f"{name} repeat {repeated}: each value once (a repeated cell would repeat the same prompts)")
    return values


def is_correct(generated_text: str, key: str) -> bool:
    """True when `key` appears in the continuation as a whole number ("48213." yes, "482135" no)."""
    if not isinstance(generated_text, str):
        raise BadValue(f"generated_text must be the decoded continuation (a str), got {type(generated_text).__name__}")
    key = _check_key(key)
    return re.search(rf"(?<![0-9]){key}(?![0-9])", generated_text) is not None


def accuracy_label(k: int, n: int) -> str:
    """Accuracy with its count: "8 of 10" (never a bare rate)."""
    check_int("n", n, minimum=0)
    check_int("k", k, minimum=0, maximum=n, hint="k counts the correct ones among the n")
    return f"{k} of {n}"
