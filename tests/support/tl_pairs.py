"""What the TransformerLens interop tests share (not a test module): the cases, the texts, one
tokenizer, and (ours, bridge) pairs on one set of weights (`pair`), with the tolerance they agree to.
The bridge is TransformerLens 4's `TransformerBridge` booted from the same `transformers` model
(`interp.interop.bridge_from_hf`: no download, no weight processing)."""

from __future__ import annotations

import functools

from hf_cases import VOCAB, build_hf

import interp
from interp.interop import bridge_from_hf

CASES = ["gpt2", "llama-gqa"]
TOL = 1e-4
TEXT = "w5 w7 w9 w11 w13 w5 w7 w9 w11 w13 w2 w5 w7"  # repeats: duplicate and induction targets
CLEAN = ["w5 w7 w9 w11 w5 w7 w9 w11", "w2 w3 w4 w6 w2 w3 w4 w6"]
CORRUPTED = ["w5 w7 w9 w12 w5 w7 w9 w11", "w2 w3 w8 w6 w2 w3 w4 w6"]


@functools.lru_cache(maxsize=None)
def tokenizer():
    """A word-level tokenizer over the test vocabulary ("<bos>" = 0, "w1".."w96"), saved and reloaded
    from a directory as a checkpoint's would be (the bridge re-reads it from `name_or_path`)."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<bos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fresh = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<bos>", pad_token="<bos>")
    path = tempfile.mkdtemp(prefix="interp-tl-tok-")
    fresh.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@functools.lru_cache(maxsize=None)
def pair(name: str):
    """(ours, bridge) on one set of weights, both with their default conventions."""
    hf = build_hf(name)
    ours = interp.from_hf(hf, tokenizer=tokenizer())
    bridge = bridge_from_hf(hf, tokenizer=tokenizer())
    return ours, bridge


def metric(logits):
    return (logits[:, -1, 9] - logits[:, -1, 3]).mean()


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.float() - b.float()).abs().max().item()
    assert err < tol, err
