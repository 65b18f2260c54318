"""The recipes of the shipped zoo runs: frozen data, reproduced by `interp train NAME`.

Both models read UTF-8 bytes (`interp.models.formats.tokenizer.ByteTokenizer`, d_vocab 257 = 256 bytes + `<bos>`)
of the Python standard library's sources; see `interp.models.zoo.training` for the data and the loop.
"""

from __future__ import annotations

import dataclasses

from interp.models.config import ModelConfig
from interp.models.zoo.training import Recipe

VOCAB = 257  # 256 bytes + <bos>

ATTN_ONLY_2L = Recipe(
    name="attn-only-2l",
    description=(
        "Attention-only, 2 layers, for the induction-head phase change (Olsson et al. 2022): previous-token "
        "heads in layer 0, induction heads in layer 1, the in-context-learning score dropping with them."
    ),
    model=ModelConfig(
        n_layers=2, d_model=128, n_heads=4, d_vocab=VOCAB, n_ctx=256, d_mlp=None,
        normalization="layernorm", positional="learned", model_type="interp-zoo",
        prepend_bos=True,  # every training window starts with <bos> (models/src/zoo/training.py)
    ),
    steps=2000,
    # roughly log-spaced from 0, every 50 steps where the phase change happens (seed 0: ~1000-1400).
    # The learning rate is constant after warm-up, so a longer run passes through the same checkpoints.
    checkpoints=(0, 10, 30, 50, 100, 200, 400, 600, 800, 900, 1000, 1100, 1150, 1200, 1250, 1300, 1350, 1400,
                 1500, 1700, 2000),
    batch_size=32, lr=3e-3, warmup_steps=100, schedule="constant",
    betas=(0.9, 0.95), weight_decay=0.05, copy_prob=0.5, copy_span=(16, 96), random_span_prob=0.5,
)

ROPE_GQA_4L = Recipe(
    name="rope-gqa-4l",
    description=(
        "A small modern decoder (RoPE, GQA 4 query / 2 key-value heads, RMSNorm, SwiGLU, no biases), 4 layers: "
        "today's architecture for the analyses, deep enough to grow attention sinks."
    ),
    model=ModelConfig(
        n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_head=32, d_mlp=256, d_vocab=VOCAB, n_ctx=256,
        act_fn="silu", gated_mlp=True, normalization="rmsnorm", positional="rotary",
        qkv_bias=False, attn_out_bias=False, mlp_bias=False, model_type="interp-zoo",
        prepend_bos=True,  # every training window starts with <bos> (models/src/zoo/training.py)
    ),
    steps=1000,
    checkpoints=(0, 100, 500, 1000),
    batch_size=16, lr=3e-3, warmup_steps=50, schedule="cosine", min_lr_ratio=0.1,
    betas=(0.9, 0.95), weight_decay=0.05, copy_prob=0.5, copy_span=(16, 96), random_span_prob=0.5,
)

ALIBI_GQA_4L = dataclasses.replace(
    ROPE_GQA_4L,
    name="alibi-gqa-4l",
    description=(
        "rope-gqa-4l's twin with ALiBi (Press et al. 2022) in place of RoPE: the same data, seed, initial weights "
        "(neither scheme has parameters) and steps, so the two differ only in how they see positions; read together "
        "past their trained 256 tokens by `interp extrapolate` (the controlled case: ALiBi is said to hold its loss at "
        "several times the trained length, RoPE to fail soon past it)."
    ),
    model=dataclasses.replace(ROPE_GQA_4L.model, positional="alibi"),
)

# ---- the sink twins (issue 58, part 4): one recipe, data, seed and step-0 weights, three kinds of attention ----
SINKS_SOFTMAX_4L = Recipe(
    name="sinks-softmax-4l",
    description=(
        "rope-gqa-4l's architecture with 8 query / 4 key-value heads of 16 dims and 128-token windows, a constant "
        "learning rate and weight decay 0.1 (Gu et al. 2024: sinks grow with training and weight decay), checkpointed "
        "densely to see attention sinks form (`interp sinks RUN --over-checkpoints`); the softmax twin of "
        "sinks-learned-4l and sinks-gated-4l. Short (400 steps) to train three twins on a shared 2-core CPU."
    ),
    model=dataclasses.replace(ROPE_GQA_4L.model, n_heads=8, n_kv_heads=4, d_head=16, n_ctx=128),
    steps=400,
    # constant after warm-up, so a longer run passes through the same checkpoints
    checkpoints=(0, 25, 50, 75, 100, 150, 200, 250, 300, 400),
    batch_size=16, lr=3e-3, warmup_steps=25, schedule="constant",
    betas=(0.9, 0.95), weight_decay=0.1, copy_prob=0.5, copy_span=(16, 48), random_span_prob=0.5,
    eval_windows=128, probe_len=50,
)

def _sink_twin(name: str, change: str, **model_fields) -> Recipe:
    """sinks-softmax-4l with only its attention changed (`model_fields`): the same data, seed and step-0
    weights for every shared parameter (`init_like`)."""
    return dataclasses.replace(
        SINKS_SOFTMAX_4L, name=name,
        description=(f"sinks-softmax-4l's twin with {change}: the same data, seed and step-0 weights for every "
                     "shared parameter (`init_like`)."),
        model=dataclasses.replace(SINKS_SOFTMAX_4L.model, **model_fields), init_like=SINKS_SOFTMAX_4L.model)


SINKS_LEARNED_4L = _sink_twin("sinks-learned-4l", "a learned sink logit per head in every softmax denominator "
                              "(gpt-oss style, `learned_sinks`)", learned_sinks=True)
SINKS_GATED_4L = _sink_twin("sinks-gated-4l", "a sigmoid gate on each head's output before W_O (gated attention, "
                            "Qiu et al. 2025, `attn_output_gate`)", attn_output_gate=True)
SINK_TWINS = (SINKS_SOFTMAX_4L, SINKS_LEARNED_4L, SINKS_GATED_4L)

# attn-only-2l grows a sink head with its induction head (~step 1350: the induction head parks on <bos> where the
# text repeats nothing); its twins differ only in attention, as above, or (no-prenorm) only in the norm before
# attention: removed, so each head reads the raw residual stream (the final norm stays; Sun et al. 2026 ask whether
# sinks and massive activations decouple without pre-norm). Not shipped: ~9 minutes each on an idle core.
ATTN_ONLY_2L_TWINS = tuple(
    dataclasses.replace(
        ATTN_ONLY_2L, name=f"attn-only-2l-{kind}", model=dataclasses.replace(ATTN_ONLY_2L.model, **change),
        init_like=ATTN_ONLY_2L.model,
        description=f"attn-only-2l's twin with {what}: the same data, seed and step-0 weights for every shared parameter.",
    )
    for kind, change, what in (
        ("learned", {"learned_sinks": True}, "a learned sink logit per head (gpt-oss style)"),
        ("gated", {"attn_output_gate": True}, "a sigmoid gate on each head's output (Qiu et al. 2025)"),
        ("no-prenorm", {"pre_norms": False}, "no norm before attention (the final norm kept; Sun et al. 2026)"),
    )
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (ATTN_ONLY_2L, ROPE_GQA_4L, ALIBI_GQA_4L, *SINK_TWINS, *ATTN_ONLY_2L_TWINS)}


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`, or a KeyError listing the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"no zoo recipe {name!r}; known recipes: {sorted(RECIPES)}") from None


__all__ = ["ALIBI_GQA_4L", "ATTN_ONLY_2L", "ATTN_ONLY_2L_TWINS", "RECIPES", "ROPE_GQA_4L", "SINKS_GATED_4L", "SINKS_LEARNED_4L",
           "SINKS_SOFTMAX_4L", "SINK_TWINS", "get_recipe"]
