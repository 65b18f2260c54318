"""Generation: its settings (`Sampling`, TransformerLens's names), the prompt it continues (`Prompt`),
choosing each next token (`sample_next`), and interp's own loop through the KV cache (`generate`:
prefill once, then one token per step). A wrapped model takes the same settings and runs transformers'
own `generate` (`interp.models.wrapped`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp.errors import BadValue, check_int, check_real
from .text import _is_text

if TYPE_CHECKING:
    from .kv.cache import KVCache

    from .base import HookedModel
    from .native.transformer import HookedTransformer


@dataclass(frozen=True)
class Sampling:
    """How `generate` chooses each next token, where a row stops, and how text goes in and comes out:
    TransformerLens's `generate` settings, by its names. Each is also a keyword of `generate`
    (`model.generate(tokens, 20, do_sample=True, temperature=0.7)`), folded into this; `Sampling.of` says
    in one line which keyword is none of them."""

    do_sample: bool = False  # greedy unless True (TransformerLens samples by default; interp does not)
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None  # keep the k likeliest tokens (None or 0: no top-k filter)
    top_p: float | None = None  # nucleus: the smallest set with this mass, in (0, 1] (None or 1: no filter)
    repetition_penalty: float = 1.0  # Hugging Face's (greedy too): a seen token's logit / it if > 0, * it if < 0
    freq_penalty: float = 0.0  # TransformerLens's (sampling only): minus it * count, after the temperature
    seed: int | None = None  # sampling reproducibly
    stop_tokens: int | Iterable[int] | None = None  # a row stops at any of these
    stop_at_eos: bool = True  # ... and at the end-of-sequence token (no tokenizer and no eos_token_id: no EOS stop)
    eos_token_id: int | Iterable[int] | None = None  # default: the tokenizer's
    pad_token_id: int | None = None  # after a row stops; default the (first) EOS, else the first stop token
    prepend_bos: bool | None = None  # text input: BOS first (default: the model's)
    padding_side: Literal["left"] | None = None  # generation continues each row at its end: left only
    return_type: Literal["input", "str", "tokens"] = "input"  # "input": text for text in, ids for ids
    use_past_kv_cache: bool = True  # False: recompute the whole sequence each step (slow; a check on the cache)
    verbose: bool = False  # a progress bar

    def __post_init__(self) -> None:
        if self.return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type must be 'input', 'str' or 'tokens', got {self.return_type!r}")
        check_real("temperature", self.temperature, minimum=0)  # 0: greedy
        if self.top_k is not None:
            check_int("top_k", self.top_k, minimum=0)  # 0: no top-k filter
        if self.top_p is not None and check_real("top_p", self.top_p, minimum=0, strict=True) > 1:
            raise BadValue(f"top_p must lie in (0, 1] (1 or None: no nucleus filter), got {self.top_p}")
        if self.freq_penalty < 0:
            raise ValueError(f"freq_penalty must be >= 0 (0 turns it off), got {self.freq_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 turns it off), got {self.repetition_penalty}")
        if self.padding_side not in (None, "left"):
            raise ValueError("generation continues every row at its end, so it pads on the left; got "
                             f"padding_side={self.padding_side!r}")

    @classmethod
    def of(cls, sampling: "Sampling | None", settings: dict[str, Any]) -> "Sampling":
        """`sampling` (default: greedy) with the keywords `settings` folded in; an unknown one in one line."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}: its settings are "
                            f"Sampling's fields ({', '.join(fields)}), policy=, attention_mask=, capture_queries=, "
                            "return_kv_cache=")
        return dataclasses.replace(sampling or cls(), **settings)

    def eos(self, model: "HookedModel") -> list[int]:
        """The EOS ids a row stops at: `eos_token_id`, else the tokenizer's; none unless `stop_at_eos`."""
        if not self.stop_at_eos:
            return []
        eos = self.eos_token_id if self.eos_token_id is not None else getattr(model.tokenizer, "eos_token_id", None)
        return _ids(eos)

    def stops(self, model: "HookedModel") -> tuple[list[int], int]:
        """(every id a row stops at, sorted; the id a stopped row is padded with: `pad_token_id`, else the
        first EOS as TransformerLens pads, else the first stop token, else 0)."""
        eos = self.eos(model)
        stops = sorted(set(_ids(self.stop_tokens) + eos))
        pad = self.pad_token_id if self.pad_token_id is not None else eos[0] if eos else (stops[0] if stops else 0)
        return stops, pad


def _ids(t) -> list[int]:
    return [int(t)] if isinstance(t, int) else [int(x) for x in (t or ())]


def cache_policy(policy, settings: dict[str, Any]) -> dict[str, Any]:
    """`new_kv_cache`'s policy= / precision= from generate's `policy` and the older keywords, taken out of
    `settings`: `kv_policy=` (the same as policy=) and `kv_precision=` (a quantized cache; a map's other
    heads in fp32). {} for the model's own cache."""
    older = settings.pop("kv_policy", None)
    if older is not None:
        if policy is not None:
            raise ValueError("give policy= or its older spelling kv_policy=, not both")
        policy = older
    out = {"policy": policy, "precision": settings.pop("kv_precision", None)}
    return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Prompt:
    """What generation continues: token ids [batch, pos], rows of different lengths left-padded, their
    mask (None: every position real), which positions are real, and how the caller gave it (text, one
    string) for the answer's form."""

    tokens: Tensor
    attention_mask: Tensor | None
    real: Tensor
    text_in: bool
    single: bool

    @classmethod
    def of(cls, model: "HookedModel", tokens, attention_mask: Tensor | None, sampling: Sampling) -> "Prompt":
        prepared = model.prepare(tokens, attention_mask, prepend_bos=sampling.prepend_bos, padding_side="left")
        mask = prepared.attention_mask
        real = mask.to(model.device).bool() if mask is not None else torch.ones_like(prepared.tokens, dtype=torch.bool)
        if not real[:, -1].all():
            raise ValueError("generation needs left padding: the last position of every row must be a real token")
        return cls(prepared.tokens, mask, real, _is_text(tokens), isinstance(tokens, str))

    def answer(self, model: "HookedModel", result: Tensor, sampling: Sampling):
        """[batch, pos + new] as the caller asked: ids, or (return_type "str", or "input" for text in) as
        TransformerLens decodes: the prompt and its continuation without the BOS and padding we added and
        without special tokens (a chat template's markers, the EOS); one string for one string in."""
        if not (sampling.return_type == "str" or (sampling.return_type == "input" and self.text_in)):
            return result
        keep = torch.cat([self.real, torch.ones_like(result[:, self.tokens.shape[1]:], dtype=torch.bool)], dim=1)
        bos = getattr(model.tokenizer, "bos_token_id", None)
        texts = []
        for row, k in zip(result, keep):
            ids = row[k].tolist()
            if model.bos_id(sampling.prepend_bos) is not None and ids and ids[0] == bos:
                ids = ids[1:]
            texts.append(model.tokenizer.decode(ids, skip_special_tokens=True))
        return texts[0] if self.single else texts


def sample_next(
    logits: Tensor,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    counts: Tensor | None = None,
    repetition_penalty: float = 1.0,
    freq_penalty: float = 0.0,
) -> Tensor:
    """logits [batch, vocab] -> token ids [batch]. Greedy unless do_sample (then temperature,
    top-k, then top-p / nucleus filtering, in that order, as Hugging Face applies them).

    `counts` [batch, vocab]: how often each token occurs in the sequence so far, for the penalties
    as TransformerLens applies them: `repetition_penalty` (Hugging Face's: a seen token's logit is
    divided by it if positive, multiplied if negative; greedy too), then, when sampling, after the
    temperature, `freq_penalty` * count is subtracted."""
    if repetition_penalty != 1.0 and counts is not None:
        seen = counts > 0
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty), logits)
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if freq_penalty > 0 and counts is not None:
        logits = logits - freq_penalty * counts
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check_room(model: "HookedTransformer", prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, before any decoding, a generation that would run past a learned (or sinusoidal) position
    table: the last new token is never fed back, so the model sees prompt_len + max_new_tokens - 1
    positions. Rotary, ALiBi and position-free models have no table and no such limit."""
    cfg = model.cfg
    if cfg.positional not in ("learned", "sinusoidal") or max_new_tokens == 0:
        return
    if prompt_len + max_new_tokens - 1 > cfg.n_ctx:
        room = cfg.n_ctx - prompt_len + 1
        fix = f"pass max_new_tokens={room} or less" if room > 0 else f"shorten the prompt to {cfg.n_ctx} tokens or fewer"
        raise BadValue(f"a {prompt_len}-token prompt plus max_new_tokens={max_new_tokens} runs past this model's "
                         f"{cfg.positional} position table (n_ctx={cfg.n_ctx}): {fix}")


def _rope_switches(model: "HookedTransformer", cache: "KVCache") -> bool:
    """Whether the next token is the first past a LongRoPE model's original context (Phi-3): from there
    its long factors rotate every position, so the keys cached with the short ones are recomputed from
    the whole sequence, as transformers' Phi-3 generation drops its cache at that step. (A forward with
    a cache keeps what it cached, as transformers' forward does.)"""
    after = getattr(model.rotary, "long_after", None)
    return after is not None and int(cache.n_seen.max()) == after


class _Decoder:
    """The model's forward during one generation: the prefill, then each step, through a KV cache (or,
    with use_past_kv_cache=False, the whole sequence every step)."""

    def __init__(self, model: "HookedTransformer", prompt: Prompt, max_len: int, cached: bool,
                 cache_args: dict[str, Any], capture_queries: bool, keep: bool) -> None:
        self.model, self.prompt = model, prompt
        if (cached and not cache_args and not keep and not capture_queries and model.cfg.positional != "alibi"
                and model.window_policy(max_len)):
            cache_args = {"policy": "window"}  # sliding-window layers keep only their window (Gemma's local layers)
        batch = prompt.tokens.shape[0]
        self.new_cache = lambda: model.new_kv_cache(batch, max_len, capture_queries=capture_queries, **cache_args)
        self.cache = self.new_cache() if cached else None

    def prefill(self) -> Tensor:
        """The logits [batch, vocab] after the prompt. Through the cache, the blocks run on the whole prompt
        and only the last position is unembedded (as HF's logits_to_keep=1): the other rows of
        [n, vocab] logits are never read, and for a small model the unembedding of a whole prompt costs
        several decoding steps."""
        model, p = self.model, self.prompt
        if self.cache is None:
            return model(p.tokens, attention_mask=p.attention_mask)[:, -1]
        resid = model(p.tokens, attention_mask=p.attention_mask, kv_cache=self.cache, stop_at_layer=model.cfg.n_layers)
        return model(resid[:, -1:], start_at_layer=model.cfg.n_layers)[:, -1]

    def step(self, out: list[Tensor]) -> Tensor:
        """The logits [batch, vocab] after the sequence so far (`out`: the prompt, then one column per step)."""
        model, p = self.model, self.prompt
        if self.cache is not None and not _rope_switches(model, self.cache):
            return model(out[-1], kv_cache=self.cache)[:, -1]
        seq = torch.cat(out, dim=1)
        mask = None if p.attention_mask is None else torch.cat(
            [p.attention_mask.to(model.device), torch.ones_like(seq[:, p.tokens.shape[1]:])], dim=1)
        if self.cache is not None:  # rebuilt from the whole sequence (see _rope_switches)
            self.cache = self.new_cache()
        return model(seq, attention_mask=mask, kv_cache=self.cache)[:, -1]


def _counts(prompt: Prompt, vocab: int, sampling: Sampling) -> Tensor | None:
    """How often each token occurs in each row's real tokens [batch, vocab], when a penalty reads it."""
    if sampling.repetition_penalty == 1.0 and sampling.freq_penalty <= 0:
        return None
    counts = torch.zeros(prompt.tokens.shape[0], vocab, device=prompt.tokens.device)
    return counts.scatter_add_(1, prompt.tokens.clamp(0, vocab - 1), prompt.real.float())


@torch.no_grad()
def generate(
    model: "HookedTransformer",
    tokens,
    max_new_tokens: int = 20,
    sampling: Sampling | None = None,
    *,
    policy=None,
    attention_mask: Tensor | None = None,
    capture_queries: bool = False,
    return_kv_cache: bool = False,
    **settings,
) -> Tensor | tuple[Tensor, "KVCache"]:
    """Continue `tokens` ([batch, pos]; rows of different lengths left-padded with `attention_mask`),
    or text: a string or a list of strings (BOS per `prepend_bos`, default the model's; a list is
    left-padded and masked), by `max_new_tokens` at most, through interp's KV cache.

    sampling         a `Sampling` (greedy by default); its fields are also keywords here
                     (`do_sample=True, temperature=0.7, top_p=0.9, seed=0, stop_tokens=..., return_type=...`).
                     A row stops at any of its `stop_tokens` and, as in TransformerLens, at the EOS, and is
                     padded after; generation ends when every row has stopped.
    policy           what each KV head keeps while decoding ("streaming(4,128)", "kivi4", "h2o(256)", a
                     precision such as "int8", a map; see `model.new_kv_cache` and `interp.models.kv.policies`;
                     older spellings: kv_policy=, and kv_precision= for a quantized cache).
    capture_queries  the cache keeps the queries too (`model.attention_stats(kv_cache=...)` reads them).
    return_kv_cache  return (tokens, cache), e.g. to read queries / keys back for analysis.

    Returns [batch, pos + new] token ids, or text (see `Sampling.return_type`)."""
    cache_args = cache_policy(policy, settings)
    s = Sampling.of(sampling, settings)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    if not s.use_past_kv_cache and (return_kv_cache or capture_queries or cache_args):
        raise ValueError("return_kv_cache / capture_queries / kv_precision / kv_policy need the KV cache: drop "
                         "use_past_kv_cache=False")
    prompt = Prompt.of(model, tokens, attention_mask, s)
    batch, n = prompt.tokens.shape
    _check_room(model, int(prompt.real.sum(1).max()), max_new_tokens)
    stop_ids, pad = s.stops(model)
    stops = torch.tensor(stop_ids, device=model.device, dtype=torch.long)
    generator = None if s.seed is None else torch.Generator(device=model.device).manual_seed(s.seed)
    decoder = _Decoder(model, prompt, n + max_new_tokens, s.use_past_kv_cache, cache_args, capture_queries,
                       return_kv_cache)
    logits = decoder.prefill()
    counts = _counts(prompt, logits.shape[-1], s)
    out = [prompt.tokens]
    done = torch.zeros(batch, dtype=torch.bool, device=model.device)
    steps = tqdm(range(max_new_tokens), desc="generate", unit="tok") if s.verbose else range(max_new_tokens)
    for step in steps:
        nxt = sample_next(logits, do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          generator=generator, counts=counts, repetition_penalty=s.repetition_penalty,
                          freq_penalty=s.freq_penalty)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt[:, None])
        if counts is not None:
            counts.scatter_add_(1, nxt[:, None], (~done).float()[:, None])
        if len(stops):
            done |= torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = decoder.step(out)
    if s.verbose:
        steps.close()
    result = prompt.answer(model, torch.cat(out, dim=1), s)
    return (result, decoder.cache) if return_kv_cache else result
