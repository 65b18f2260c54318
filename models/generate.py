"""Generation through the KV cache: prefill once, then one token per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp.errors import BadValue, check_int, check_real
from .text import _is_text

if TYPE_CHECKING:
    from .kv.cache import KVCache

    from .transformer import HookedTransformer


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


@torch.no_grad()
def generate(
    model: "HookedTransformer",
    tokens,
    max_new_tokens: int = 20,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    freq_penalty: float = 0.0,
    seed: int | None = None,
    stop_tokens: int | Iterable[int] | None = None,
    stop_at_eos: bool = True,
    eos_token_id: int | Iterable[int] | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    capture_queries: bool = False,
    return_kv_cache: bool = False,
    kv_precision=None,
    kv_policy=None,
    prepend_bos: bool | None = None,
    padding_side: str | None = None,
    return_type: str = "input",
    use_past_kv_cache: bool = True,
    verbose: bool = False,
) -> Tensor | tuple[Tensor, "KVCache"]:
    """Continue `tokens` ([batch, pos]; rows of different lengths left-padded with `attention_mask`),
    or text: a string or a list of strings (BOS per `prepend_bos`, default the model's; a list is
    left-padded and masked).

    Greedy by default; `do_sample=True` samples with temperature / top_k / top_p, reproducibly for a
    `seed`. A row stops at any of `stop_tokens` and, as in TransformerLens, at the end-of-sequence
    token when `stop_at_eos` (`eos_token_id`, default the tokenizer's; no tokenizer, no EOS stop); it
    is padded with `pad_token_id` (default: the EOS, else the first stop token) afterwards;
    generation ends when every row has stopped. Returns [batch, pos + new]
    (and the KV cache with `return_kv_cache=True`, e.g. to read queries/keys back for analysis).
    `kv_precision`: decode through a quantized cache ("int8", "fp8", "int4", ... or a
    {(layer, kv_head): name} map; see `model.new_kv_cache`). `kv_policy`: decode through a cache
    whose heads keep what a policy says ("streaming(4,128)", "kivi4", "h2o(256)", a map; see
    `interp.models.kv.policies`).
    return_type: "input" (TransformerLens's default: text for text input, token ids for ids), "str"
    or "tokens". `repetition_penalty` / `freq_penalty`: as TransformerLens's (see `sample_next`),
    counting the real tokens of each row (prompt and continuation, not padding).
    `use_past_kv_cache=False` recomputes the whole sequence at every step (slow; a check on the
    cache); `verbose=True` shows a progress bar. Unlike TransformerLens, decoding is greedy unless
    `do_sample=True`.
    """
    if return_type not in ("input", "str", "tokens"):
        raise ValueError(f"return_type must be 'input', 'str' or 'tokens', got {return_type!r}")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_real("temperature", temperature, minimum=0)  # 0: greedy
    if top_k is not None:
        check_int("top_k", top_k, minimum=0)  # 0: no top-k filter
    if top_p is not None and check_real("top_p", top_p, minimum=0, strict=True) > 1:
        raise BadValue(f"top_p must lie in (0, 1] (1 or None: no nucleus filter), got {top_p}")
    if freq_penalty < 0:
        raise ValueError(f"freq_penalty must be >= 0 (0 turns it off), got {freq_penalty}")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0 turns it off), got {repetition_penalty}")
    if padding_side not in (None, "left"):
        raise ValueError(f"generation continues every row at its end, so it pads on the left; got padding_side={padding_side!r}")
    if not use_past_kv_cache and (return_kv_cache or capture_queries or kv_precision is not None
                                  or kv_policy is not None):
        raise ValueError("return_kv_cache / capture_queries / kv_precision / kv_policy need the KV cache: drop "
                         "use_past_kv_cache=False")
    single, text_in = isinstance(tokens, str), _is_text(tokens)
    prepared = model.prepare(tokens, attention_mask, prepend_bos=prepend_bos, padding_side="left")
    tokens, attention_mask = prepared.tokens, prepared.attention_mask
    batch, n = tokens.shape
    # Which prompt positions are real tokens (not padding): read by the penalties and the text decode.
    real = attention_mask.to(model.device).bool() if attention_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
    if not real[:, -1].all():
        raise ValueError("generation needs left padding: the last position of every row must be a real token")
    _check_room(model, int(real.sum(1).max()), max_new_tokens)
    as_list = lambda t: [int(t)] if isinstance(t, int) else [int(x) for x in (t or ())]
    eos = as_list(eos_token_id if eos_token_id is not None else getattr(model.tokenizer, "eos_token_id", None)) if stop_at_eos else []
    stops = torch.tensor(sorted(set(as_list(stop_tokens) + eos)), device=model.device, dtype=torch.long)
    # Finished rows are padded as TransformerLens pads them: with the (first) EOS.
    pad = pad_token_id if pad_token_id is not None else eos[0] if eos else (int(stops[0]) if len(stops) else 0)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)

    cache = None
    if use_past_kv_cache:
        if (kv_policy is None and kv_precision is None and not return_kv_cache and not capture_queries
                and model.cfg.positional != "alibi" and model.window_policy(n + max_new_tokens)):
            kv_policy = "window"  # sliding-window layers keep only their window (Gemma's local layers)
        cache = model.new_kv_cache(batch, n + max_new_tokens, capture_queries=capture_queries, precision=kv_precision,
                                   policy=kv_policy)
        # Prefill through the blocks, then unembed the last position only (as HF's logits_to_keep=1):
        # the other n - 1 rows of [n, vocab] logits are never read, and for a small model the
        # unembedding of a whole prompt costs several decoding steps.
        resid = model(tokens, attention_mask=attention_mask, kv_cache=cache, stop_at_layer=model.cfg.n_layers)
        logits = model(resid[:, -1:], start_at_layer=model.cfg.n_layers)[:, -1]
    else:
        logits = model(tokens, attention_mask=attention_mask)[:, -1]
    counts = None
    if repetition_penalty != 1.0 or freq_penalty > 0:
        counts = torch.zeros(batch, logits.shape[-1], device=model.device)
        counts.scatter_add_(1, tokens.clamp(0, logits.shape[-1] - 1), real.float())
    out = [tokens]
    done = torch.zeros(batch, dtype=torch.bool, device=model.device)
    steps = range(max_new_tokens)
    if verbose:
        steps = tqdm(steps, desc="generate", unit="tok")
    for step in steps:
        nxt = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator, counts=counts, repetition_penalty=repetition_penalty,
                          freq_penalty=freq_penalty)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt[:, None])
        if counts is not None:
            counts.scatter_add_(1, nxt[:, None], (~done).float()[:, None])
        if len(stops):
            done |= torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if cache is not None and not _rope_switches(model, cache):
            logits = model(nxt[:, None], kv_cache=cache)[:, -1]
        else:
            seq = torch.cat(out, dim=1)
            mask = None if attention_mask is None else torch.cat(
                [attention_mask.to(model.device), torch.ones_like(seq[:, n:])], dim=1)
            if cache is not None:  # rebuilt from the whole sequence (see _rope_switches)
                cache = model.new_kv_cache(batch, n + max_new_tokens, capture_queries=capture_queries,
                                           precision=kv_precision, policy=kv_policy)
            logits = model(seq, attention_mask=mask, kv_cache=cache)[:, -1]
    if verbose:
        steps.close()
    result = torch.cat(out, dim=1)
    if return_type == "str" or (return_type == "input" and text_in):
        # As TransformerLens: the prompt and its continuation, without the BOS and padding we added
        # and, as its decode, without special tokens (a chat template's markers, the EOS).
        keep = torch.cat([real, torch.ones_like(result[:, n:], dtype=torch.bool)], dim=1)
        bos = getattr(model.tokenizer, "bos_token_id", None)
        texts = []
        for row, k in zip(result, keep):
            ids = row[k].tolist()
            if model.bos_id(prepend_bos) is not None and ids and ids[0] == bos:
                ids = ids[1:]
            texts.append(model.tokenizer.decode(ids, skip_special_tokens=True))
        result = texts[0] if single else texts
    return (result, cache) if return_kv_cache else result
