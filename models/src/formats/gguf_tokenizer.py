"""The tokenizer of a GGUF file, rebuilt from its `tokenizer.ggml.*` fields with the `tokenizers` library.

A byte-level BPE ("gpt2": vocabulary, merges, special tokens, the pre-tokenizer `tokenizer.ggml.pre`
names), Gemma's SentencePiece BPE ("llama" in a Gemma file: byte fallback, merges rebuilt from the
vocabulary's order) or Phi-3's ("llama" in a Phi-3 file: merges rebuilt from the scores, a prefix
"\u2581" from a normalizer). transformers' own GGUF loading is the test oracle for its ids
(tests/models/formats/test_gguf_families.py, tests/models/runs/test_real_models.py).
"""

from __future__ import annotations

from interp.errors import CheckpointError

# tokenizer.ggml.pre names llama.cpp's pre-tokenizer regex. We follow transformers' GGUF loading (the
# oracle of our tests): Llama 3's and Qwen 2's own splits for the names that have them (the split
# llama.cpp runs too), GPT-2's regex for the others. For some of those llama.cpp runs its own regex:
# "smollm" also splits digits one by one (which differs only for whitespace right before a digit);
# "falcon" and "bloom" split punctuation and digits their own way.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_BYTE_LEVEL_PRE = ("gpt2", "gpt-2", "default", "smollm", "starcoder", "refact", "falcon", "bloom", *_SPLITS)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (printable Latin-1 bytes as
    themselves, the others as the characters from U+0100 on, in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}


def gguf_tokenizer(reader, source: str = "GGUF file"):
    """A `transformers.PreTrainedTokenizerFast` over a `tokenizers` BPE built from the file's
    `tokenizer.ggml.*` fields, or None when the file has none: byte-level BPE ("gpt2"), or Gemma's or
    Phi-3's SentencePiece BPE ("llama" in a gemma2 / gemma3 / phi3 file)."""
    model_kind = reader.fields.get("tokenizer.ggml.model")
    if model_kind is None:
        return None
    arch = reader.fields.get("general.architecture")
    builders = {"gpt2": _byte_level_bpe}
    if arch in ("gemma2", "gemma3"):
        builders["llama"] = _gemma_bpe
    elif arch == "phi3":
        builders["llama"] = _phi3_bpe
    if model_kind not in builders:
        raise NotImplementedError(
            f"{source}: GGUF tokenizer model {model_kind!r} is not supported for {arch!r} (byte-level BPE 'gpt2', "
            "and Gemma's and Phi-3's 'llama' SentencePiece BPE, are); pass tokenizer=... to interp.load"
        )
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokens = list(reader.fields.get("tokenizer.ggml.tokens"))
    types = list(reader.fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = builders[model_kind](reader, tokens, types, source)
    # Control tokens (type 3: <bos>, <|endoftext|>) stay whole and are special; in a byte-level vocabulary
    # only those spelled in its alphabet (another one is a mislabel, which transformers skips too).
    alphabet = set(_byte_alphabet().values()) if model_kind == "gpt2" else None
    bpe.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok, kind in zip(tokens, types)
                            if kind == 3 and (alphabet is None or set(tok) <= alphabet)])

    def tok_at(key: str):
        i = reader.fields.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=tok_at("tokenizer.ggml.bos_token_id"), eos_token=tok_at("tokenizer.ggml.eos_token_id"),
        unk_token=tok_at("tokenizer.ggml.unknown_token_id"), pad_token=tok_at("tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = reader.fields.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def _byte_level_bpe(reader, tokens: list[str], types: list[int], source: str):
    """GPT-2's byte-level BPE: the file's vocabulary (a token with a character outside the byte alphabet,
    e.g. a real space, respelled in it, as transformers reads it) and merges, split by the pre-tokenizer
    it names. User-defined tokens (type 4: Qwen 3's <think>) stay whole but are text, as llama.cpp and
    transformers treat them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [tuple(m.split(" ", 1)) for m in reader.fields.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = reader.fields.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE:
        raise NotImplementedError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported; pass tokenizer=... to interp.load")
    if pre in _SPLITS:
        bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=bool(reader.fields.get("tokenizer.ggml.add_space_prefix", False)), use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, kind in zip(tokens, types)
                    if kind == 4 and tok in vocab])
    return bpe


def _gemma_bpe(reader, tokens: list[str], types: list[int], source: str):
    """Gemma's SentencePiece BPE as `tokenizers` runs it (Hugging Face's GemmaTokenizer): spaces become
    "\u2581", no prefix space, unknown characters fall back to their UTF-8 bytes (<0x41>).

    A Gemma file lists no merges; they are rebuilt from the vocabulary: every split of a token into two
    tokens, ranked by the token's place in the file (Gemma's scores do not follow its merge order, the
    order does), longer left part first, as transformers' GGUF loading rebuilds them. A token of two or
    more blanks is stored with real spaces but looked up as "\u2581"s, so it is renamed first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    blank = "\u2581"
    spelled = [blank * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    merges = []
    for tok in sorted(vocab, key=vocab.__getitem__):
        merges += [(tok[:i], tok[i:]) for i in range(len(tok) - 1, 0, -1) if tok[:i] in vocab and tok[i:] in vocab]
    unk = reader.fields.get("tokenizer.ggml.unknown_token_id")
    if unk is None or not 0 <= unk < len(tokens):
        raise CheckpointError(f"{source}: a Gemma tokenizer needs tokenizer.ggml.unknown_token_id; the file has none")
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=tokens[unk], byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", blank)
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    bpe.decoder = decoders.Sequence([decoders.Replace(blank, " "), decoders.ByteFallback(), decoders.Fuse()])
    # User-defined tokens (type 4: <start_of_image>, [multimodal], ...) stay whole but are text, as
    # llama.cpp and transformers treat them.
    bpe.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, kind in zip(tokens, types)
                    if kind == 4 and tok in vocab])
    return bpe


def _phi3_bpe(reader, tokens: list[str], types: list[int], source: str):
    """Phi-3's SentencePiece BPE as transformers' GGUF loading rebuilds it: a "\u2581" prepended and every
    space made one (a normalizer, so a leading space gives two), unknown characters falling back to their
    UTF-8 bytes, the decoder dropping the first space. The file lists no merges; they are rebuilt from
    the scores: every split of a token into two tokens, ranked by the token's score (highest first),
    then by longer left part, then longer right part; a token's own splits in vocabulary order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    blank = "\u2581"
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if reader.fields.get("tokenizer.ggml.merges") is not None:
        merges = [tuple(m.split(" ", 1)) for m in reader.fields.get("tokenizer.ggml.merges")]
    else:
        scores = reader.fields.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{source}: a SentencePiece tokenizer needs tokenizer.ggml.scores, one per token")
        ranked = []
        for tok, score in dict(zip(tokens, scores)).items():
            splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab]
            ranked += [(left, right, score) for left, right in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
        ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep their order
        merges = [(left, right) for left, right, _ in ranked]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend(blank), normalizers.Replace(" ", blank)])
    bpe.decoder = decoders.Sequence([decoders.Replace(blank, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    bpe.add_tokens([AddedToken(tok, special=False, normalized=False) for tok, kind in zip(tokens, types)
                    if kind == 4 and tok in vocab])
    return bpe
