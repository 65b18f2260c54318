"""The long-context retrieval prompts (`interp.analyses.kv.tasks`): seeded keys, lengths in the model's
tokens, the needle at its depth, the key's token span, scoring and bad input.

Tokenizers: the zoo's bytes (`attn-only-2l`, n_ctx 256, and the same tokenizer on a small model with a
4,096-token context), a byte-level BPE trained here on the Language Reference (a Hugging Face fast
tokenizer: the offsets path, and digits merged with the space before them), and SmolLM2's (slow)."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.analyses.kv import tasks
from interp.analyses.data import read_text
from interp.analyses.kv.tasks import (
    FILLER,
    QUESTION,
    accuracy_label,
    cell_keys,
    is_correct,
    needle,
    passkey_prompt,
    retrieval_prompts,
)
from interp.errors import BadValue
from interp.models.formats.tokenizer import ByteTokenizer

from core_models import build, small
from smol import needs_smol

LONGEST_SENTENCE = max(len(s) for s in FILLER) + 1  # a passkey unit in bytes, with its space
LONGEST_LINE = 150  # a needle unit (a line of the Language Reference) in bytes, with its newline: <= 147


@pytest.fixture(scope="module")
def zoo():
    return interp.load("attn-only-2l")  # bytes, n_ctx 256


@pytest.fixture(scope="module")
def long_bytes():
    model = build(small(n_ctx=4096, d_vocab=257))
    model.tokenizer = ByteTokenizer()
    return model


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE trained on the Language Reference and the filler, with " 0" .. " 9" merged
    (as GPT-2 does): the key's first token then carries the space before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<bos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([read_text()[:60_000], " ".join(FILLER) * 20, " 0 1 2 3 4 5 6 7 8 9" * 200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", clean_up_tokenization_spaces=False)
    model = build(small(n_ctx=4096, d_vocab=len(fast)))
    model.tokenizer = fast
    return model


def span_text(model, p) -> str:
    return model.to_string(p.tokens[0, p.key_span[0]:p.key_span[1]])


# ---- keys from the seed ----------------------------------------------------------------------------
def test_same_seed_same_prompts_other_seed_other_keys(long_bytes):
    args = dict(lengths=[600, 900], depths=[0.0, 0.5, 1.0], n_per_cell=3)
    a = retrieval_prompts(long_bytes, seed=7, **args)
    b = retrieval_prompts(long_bytes, seed=7, **args)
    c = retrieval_prompts(long_bytes, seed=8, **args)
    assert len(a) == 2 * 3 * 3
    assert [(p.length, p.depth) for p in a[:4]] == [(600, 0.0)] * 3 + [(600, 0.5)]  # lengths outer, depths inner
    assert [p.key for p in a] == [p.key for p in b]
    assert all(torch.equal(p.tokens, q.tokens) and p.key_span == q.key_span and p.text == q.text for p, q in zip(a, b))
    assert [p.key for p in a] != [p.key for p in c]
    assert len({p.key for p in a}) > 12  # keys differ between cells and within them
    assert all(len(p.key) == 5 and p.key.isdigit() and p.key[0] != "0" and p.seed == 7 for p in a)
    # a cell's prompts do not depend on which other cells are asked for; the needle variant shares the keys
    alone = retrieval_prompts(long_bytes, [900], [0.5], 3, seed=7)
    assert [p.key for p in alone] == [p.key for p in a if (p.length, p.depth) == (900, 0.5)] == cell_keys(7, 900, 0.5, 3)
    assert [p.key for p in retrieval_prompts(long_bytes, [900], [0.5], 3, seed=7, variant="needle")] == cell_keys(7, 900, 0.5, 3)


def test_keys_use_no_global_generator(long_bytes):
    import random

    random.seed(1)
    before = random.random()
    random.seed(1)
    retrieval_prompts(long_bytes, [600], [0.5], 2, seed=0)
    assert random.random() == before


# ---- length -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant, unit", [("passkey", LONGEST_SENTENCE), ("needle", LONGEST_LINE)])
@pytest.mark.parametrize("length", [300, 1000, 4096])
def test_length_is_filled_without_going_over(long_bytes, variant, unit, length):
    for depth in (0.0, 0.3, 1.0):
        p = passkey_prompt(long_bytes, length, depth, "48213", variant=variant)
        assert p.tokens.shape == (1, p.n_tokens) and p.tokens.dtype == torch.long
        assert length - unit <= p.n_tokens <= length, (variant, depth, p.n_tokens)
        assert int(p.tokens[0, 0]) == long_bytes.tokenizer.bos_token_id  # the model's BOS convention
        assert long_bytes.to_string(p.tokens[0, 1:]) == p.text  # one tokenization of the whole text


def test_length_with_a_subword_tokenizer(bpe):
    for variant in tasks.VARIANTS:
        for length in (500, 2000):
            p = passkey_prompt(bpe, length, 0.5, "48213", variant=variant)
            assert length - 40 <= p.n_tokens <= length
            assert torch.equal(p.tokens, bpe.to_tokens(p.text))


# ---- depth ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant, unit", [("passkey", LONGEST_SENTENCE), ("needle", LONGEST_LINE)])
def test_needle_sits_at_its_depth(long_bytes, variant, unit):
    def start(depth):
        return passkey_prompt(long_bytes, 4000, depth, "48213", variant=variant).key_span[0]

    first, last = start(0.0), start(1.0)  # right after the instruction; right before the question
    assert first == 1 + len(tasks.INSTRUCTION) + 1 + len(tasks.KEY_LEAD)
    for depth in (0.1, 0.25, 0.5, 0.75, 0.9):
        p = passkey_prompt(long_bytes, 4000, depth, "48213", variant=variant)
        assert abs(p.key_span[0] - (first + depth * (last - first))) <= unit, depth
        assert abs(p.key_span[0] / p.n_tokens - depth) < 0.06, depth  # instruction + question: ~5% of 4,000


# ---- the key's span ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["passkey", "needle"])
def test_key_span_decodes_to_the_key(zoo, long_bytes, variant):
    for model, length in ((zoo, 256), (long_bytes, 1500)):
        for p in retrieval_prompts(model, [length], [0.0, 0.4, 1.0], 2, seed=3, variant=variant):
            assert span_text(model, p) == p.key
            assert p.text.count(needle(p.key)) == 1
            assert p.text.endswith("\n" + QUESTION)


def test_key_span_with_merged_digits_offsets_and_decoding_agree(bpe):
    merged = 0
    for variant in tasks.VARIANTS:
        for p in retrieval_prompts(bpe, [800], [0.0, 0.5, 1.0], 3, seed=1, variant=variant):
            text = span_text(bpe, p)
            assert text.strip() == p.key and text.endswith(p.key)  # " 48213" when the space joins the first digit
            merged += text.startswith(" ")
            start, end = p.key_span
            assert p.key[0] not in bpe.to_string(p.tokens[0, start + 1:end])[:1]  # the fewest tokens
            assert not bpe.to_string(p.tokens[0, start:end - 1]).endswith(p.key)
            ids = p.tokens[0].tolist()
            assert tasks._span_from_offsets(bpe.tokenizer, ids, p.text, p.text.index(p.key), p.text.index(p.key) + 5) \
                == tasks._span_by_decoding(bpe.tokenizer, ids, p.key) == p.key_span
    assert merged > 0  # the case this tokenizer is here for


# ---- real text -------------------------------------------------------------------------------------------
def test_needle_variant_hides_the_needle_in_the_language_reference(long_bytes):
    reference = read_text()
    p = passkey_prompt(long_bytes, 3000, 0.5, "48213", variant="needle")
    before, after = p.text.split("\n" + needle("48213") + "\n")
    before, after = before.removeprefix(tasks.INSTRUCTION + "\n"), after.removesuffix("\n" + QUESTION)
    assert len(before) > 1000 and len(after) > 1000
    assert reference.startswith(before + "\n" + after)  # the reference from its start, cut at a line
    around = long_bytes.to_string(p.tokens[0, p.key_span[0] - 300:p.key_span[0] - 70])  # tokens, not just .text
    assert around.split("\n", 1)[1] in reference
    assert not any(s in p.text for s in FILLER)
    passkey = passkey_prompt(long_bytes, 3000, 0.5, "48213")
    assert " ".join(FILLER) in passkey.text and reference[:200] not in passkey.text


def test_prompt_at_the_shortest_length_has_no_filler(zoo):
    with pytest.raises(BadValue, match=r"at least (\d+)") as e:
        passkey_prompt(zoo, 50, 0.5, "48213")
    shortest = int(e.value.args[0].split("at least ")[1].split()[0])
    p = passkey_prompt(zoo, shortest, 0.5, "48213")
    assert p.n_tokens == shortest
    assert p.text == "\n".join([tasks.INSTRUCTION, needle("48213"), QUESTION])


# ---- scoring -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, right", [
    (" 48213. Remember it.", True), ("48213", True), (" The pass key is 48213", True), ("it is\n48213!", True),
    (" 482135", False), (" 148213", False), (" 4821", False), (" 48 213", False), ("", False),
    (" 12345 or 48213", True),
])
def test_is_correct(text, right):
    assert is_correct(text, "48213") is right


def test_accuracy_label():
    assert accuracy_label(8, 10) == "8 of 10"
    assert accuracy_label(0, 0) == "0 of 0"


# ---- bad input -----------------------------------------------------------------------------------------
def _no_tokenizer():
    return build(small())


BAD = [
    ("variant", lambda m: passkey_prompt(m, 256, 0.5, "48213", variant="haystack"), "unknown retrieval variant 'haystack'; choose one of passkey, needle"),
    ("depth above 1", lambda m: passkey_prompt(m, 256, 1.5, "48213"), r"depth must be between 0 and 1 .*got 1.5"),
    ("depth below 0", lambda m: retrieval_prompts(m, [256], [0.5, -0.1], 1, seed=0), r"depth must be between 0 and 1 .*got -0.1"),
    ("depth NaN", lambda m: passkey_prompt(m, 256, float("nan"), "48213"), "depth must be a finite number"),
    ("too short", lambda m: passkey_prompt(m, 100, 0.5, "48213"), r"length 100 is too short for a passkey prompt: .* take 246 tokens .* at least 246"),
    ("too short, needle", lambda m: retrieval_prompts(m, [256, 200], [0.5], 1, seed=0, variant="needle"), r"length 200 is too short for a needle prompt.*at least 246"),
    ("over n_ctx", lambda m: passkey_prompt(m, 300, 0.5, "48213"), r"length 300 is above this model's context \(n_ctx=256\); ask for at most 256"),
    ("over n_ctx, list", lambda m: retrieval_prompts(m, [256, 1024], [0.5], 1, seed=0), r"length 1024 is above .*n_ctx=256"),
    ("length not an int", lambda m: passkey_prompt(m, "256", 0.5, "48213"), "length must be an integer, got '256'"),
    ("n_per_cell 0", lambda m: retrieval_prompts(m, [256], [0.5], 0, seed=0), "n_per_cell must be >= 1, got 0"),
    ("seed", lambda m: retrieval_prompts(m, [256], [0.5], 1, seed=-1), "seed must be >= 0, got -1"),
    ("lengths an int", lambda m: retrieval_prompts(m, 256, [0.5], 1, seed=0), r"lengths must be a non-empty list, e.g. lengths=\[1024, 2048\]"),
    ("depths empty", lambda m: retrieval_prompts(m, [256], [], 1, seed=0), "depths must be a non-empty list"),
    ("depths repeat", lambda m: retrieval_prompts(m, [256], [0.5, 0.5], 1, seed=0), r"depths repeat \[0.5\]"),
    ("key", lambda m: passkey_prompt(m, 256, 0.5, "4821x"), "key must be a string of digits such as '48213', got '4821x'"),
    ("no tokenizer", lambda m: passkey_prompt(_no_tokenizer(), 32, 0.5, "48213"), "this model has no tokenizer"),
    ("no tokenizer, list", lambda m: retrieval_prompts(_no_tokenizer(), [32], [0.5], 1, seed=0), "this model has no tokenizer"),
    ("is_correct of ids", lambda m: is_correct([4, 8], "48"), "generated_text must be the decoded continuation"),
    ("is_correct key", lambda m: is_correct("48213", ""), "key must be a string of digits"),
    ("label k > n", lambda m: accuracy_label(11, 10), "k must be between 0 and 10, got 11"),
    ("label n < 0", lambda m: accuracy_label(0, -1), "n must be >= 0, got -1"),
]


@pytest.mark.parametrize("what, call, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_line_before_any_prompt_is_built(zoo, monkeypatch, what, call, message):
    def no_building(*args, **kwargs):
        raise AssertionError("a prompt was built before the input was checked")

    monkeypatch.setattr(tasks, "_build", no_building)
    with pytest.raises(BadValue, match=message) as e:
        call(zoo)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


# ---- SmolLM2 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2  # the suite's one SmolLM2 (tests/conftest.py)


@needs_smol
@pytest.mark.slow
def test_smollm2_prompts_one_token_per_digit(smol):
    bos = smol.tokenizer.bos_token_id
    for variant, short in (("passkey", 8), ("needle", 45)):  # a sentence is ~5 tokens, a line up to ~40
        for p in retrieval_prompts(smol, [1024, 2048], [0.1, 0.7], 2, seed=0, variant=variant):
            assert p.length - short <= p.n_tokens <= p.length and int(p.tokens[0, 0]) == bos
            start, end = p.key_span
            assert span_text(smol, p) == p.key and end - start == 5  # SmolLM2: one token per digit
            assert smol.to_str_tokens(p.tokens[0, start - 1:end]) == [" ", *p.key]  # the space is its own token
            ids = p.tokens[0].tolist()
            assert tasks._span_by_decoding(smol.tokenizer, ids, p.key) == p.key_span  # the offsets' answer
            assert abs(start / p.n_tokens - p.depth) < 0.1
