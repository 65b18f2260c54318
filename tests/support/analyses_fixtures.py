"""Small models and data for the analyzer tests (tests/test_analyses_*.py). Random init, no downloads."""

from __future__ import annotations

import tempfile

import pytest
import torch

from interp import HookedTransformer, ModelConfig

VOCAB = 31

# Distinct sizes, and every attention geometry the analyzers must handle.
CONFIGS = {
    "learned": dict(n_layers=2, d_model=40, n_heads=5, d_vocab=VOCAB, n_ctx=64, d_mlp=72),
    "rotary-gqa": dict(n_layers=2, d_model=48, n_heads=6, n_kv_heads=2, d_vocab=VOCAB, n_ctx=64, d_mlp=72,
                       positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, qkv_bias=False),
    "alibi-window": dict(n_layers=2, d_model=36, n_heads=4, d_vocab=VOCAB, n_ctx=64, positional="alibi",
                         sliding_window=7),
    "attn-only-3l": dict(n_layers=3, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=64),
    "wide-head": dict(n_layers=2, d_model=48, n_heads=3, d_vocab=VOCAB, n_ctx=64, d_mlp=64),  # d_head 16
}


def build(name: str, seed: int = 0, sharpen: float = 8.0) -> HookedTransformer:
    """A random model; q/k weights scaled by `sharpen` so that patterns are far from uniform."""
    model = HookedTransformer(ModelConfig(**CONFIGS[name]), seed=seed).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_qkv.mul_(sharpen)
    return model


def tokens(batch: int, n: int, seed: int = 0, vocab: int = 8) -> torch.Tensor:
    """Tokens from a small vocabulary, so duplicates and induction targets are frequent."""
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def word_tokenizer(vocab: int):
    """A word-level tokenizer "t0 t1 ..." -> ids, built offline and saved/loaded from a temporary folder
    (TransformerLens re-loads tokenizers by name_or_path)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t0", eos_token="t0", unk_token="t1", pad_token="t0")
    folder = tempfile.mkdtemp(prefix="interp-tok-")
    tok.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def force_attention(model, layer: int, head: int, target) -> list:
    """Hooks on q and k (before RoPE is not an issue: learned/alibi models only) that make `head` attend
    from each query p to key target(p) only: one-hot codes q_p = c e_target(p), k_j = c e_j."""
    d = model.cfg.head_dim
    group = model.cfg.n_heads // model.cfg.kv_heads

    def set_q(q, hook):
        q = q.clone()
        n = q.shape[1]
        code = torch.zeros(n, d)
        for p in range(n):
            code[p, target(p) % d] = 30.0
        q[:, :, head] = code
        return q

    def set_k(k, hook):
        k = k.clone()
        n = k.shape[1]
        k[:, :, head // group] = 30.0 * torch.eye(d)[torch.arange(n) % d]
        return k

    a = f"blocks.{layer}.attn."
    return [(a + "hook_q", set_q), (a + "hook_k", set_k)]


def alternating_tokens(batch: int, n: int = 16, vocab: int = 16, seed: int = 0) -> torch.Tensor:
    """a b a b ...: after the first two tokens, token t + 1 is token t - 1 (a previous-token head solves it)."""
    ab = torch.randint(0, vocab, (batch, 2), generator=torch.Generator().manual_seed(seed))
    return ab.repeat(1, n // 2)


def trained_alternating_model(steps: int = 80) -> HookedTransformer:
    """A 2-layer, 4-head model trained (about a second) to predict a b a b ... sequences: a few heads
    carry the task, so ablating or pruning them costs loss and the rest barely matter."""
    model = HookedTransformer(ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=16, n_ctx=32, d_mlp=64), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and the machine is shared
    try:
        for step in range(steps):
            loss = model(alternating_tokens(32, seed=1000 + step), return_type="loss")
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()
