"""`ModelConfig`: every architectural choice of the transformer, as one frozen, JSON-serialisable dataclass.

Axis names used across the package (and in einops patterns):

    batch  : sequences in a batch
    pos    : token positions (query positions `q`, key positions `k` when they differ)
    d_model: residual stream width
    head   : attention heads; kv_head: key/value heads (== head for MHA, 1 for MQA, else GQA)
    d_head : width of one head
    d_mlp  : MLP hidden width
    vocab  : vocabulary

The config is pure data: choices are made once, when the model is built (see `models/src/native/transformer.py`),
never by branching on strings inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from interp.errors import check_int

Activation = Literal["gelu", "gelu_new", "gelu_fast", "relu", "silu"]
Normalization = Literal["layernorm", "rmsnorm"]
Positional = Literal["learned", "sinusoidal", "rotary", "alibi"]
LayerType = Literal["full", "sliding"]
QKNormOver = Literal["head", "projection"]
RopeKind = Literal["linear", "dynamic", "ntk", "yarn", "llama3", "longrope"]


FACTOR_RANGE = (1e-4, 1e4)  # a rope scaling factor outside it is a typo or a damaged file, never a model


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling, as Hugging Face configs express it (`rope_scaling` / `rope_parameters`).

    kind:
      - "linear": positions are divided by `factor` (position interpolation, Chen et al. 2023).
      - "dynamic": NTK-aware; once the sequence is longer than `original_max_position`, the base is
        raised to base * ((factor * seq / orig) - (factor - 1)) ** (rot / (rot - 2)).
      - "ntk": static NTK-aware scaling: base * factor ** (rot / (rot - 2)).
      - "yarn": YaRN (Peng et al. 2023): per-frequency interpolation between the original and the
        `factor`-interpolated frequencies with ramp (beta_fast, beta_slow), and an attention
        temperature `attention_factor` (default 0.1 * ln(factor) + 1) applied to cos/sin.
      - "llama3": Llama-3.1's piecewise frequency scaling (low_freq_factor, high_freq_factor).
      - "longrope": LongRoPE (Ding et al. 2024; Phi-3): frequency i is divided by `short_factor[i]`
        while the sequence fits `original_max_position`, by `long_factor[i]` once it is longer (chosen
        per call from the longest position, as Hugging Face does); cos/sin scaled by `attention_factor`
        (default sqrt(1 + ln(factor) / ln(original_max_position)), 1 when factor <= 1).
    """

    kind: RopeKind
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # longrope's per-frequency divisors ([rotary_dim / 2] each); tuples, so the config stays hashable
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # yarn: whether the correction range (from beta_fast, beta_slow) is rounded out to whole dimensions;
    # gpt-oss sets False (Hugging Face's `truncate`)
    truncate: bool = True


_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
                  "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  # architectures A
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt_neo": "GPTNeoForCausalLM",
                  "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM", "mpt": "MptForCausalLM",
                  "xglm": "XGLMForCausalLM",
                  # architectures B
                  "gemma2": "Gemma2ForCausalLM", "gptj": "GPTJForCausalLM", "bloom": "BloomForCausalLM",
                  "olmo2": "Olmo2ForCausalLM",
                  # architectures C
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  }


# TransformerLens's switches that code sets by assigning to `model.cfg` (`model.cfg.use_split_qkv_input =
# True`, as EAP-IG does): the assignment calls the model's `set_<name>` and reading follows the model.
SWITCHES = ("use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "use_attn_result",
            "ungroup_grouped_query_attention")


@dataclass(frozen=True)
class TLView:
    """What TransformerLens reads off `model.cfg` that describes the model holding the config rather
    than its shape: where it is, its text defaults, its hook switches. Built by `model.runtime.view`
    (`interp.models.runtime`); never stored, compared or serialised.

    `owner` is a weak reference to that model: the switches are read from it as they are now (a config
    kept from before a `set_use_*` call reads as TransformerLens's shared config does), and assigning one
    calls the model's `set_<name>`. A copy or pickle drops it (the copy belongs to no model)."""

    device: str
    dtype: Any
    model_name: str | None = None
    tokenizer_name: str | None = None
    default_prepend_bos: bool = False
    default_padding_side: str = "right"
    use_split_qkv_input: bool = False
    use_attn_in: bool = False
    use_hook_mlp_in: bool = False
    ungroup_grouped_query_attention: bool = False
    processed_fold_ln: bool = False
    owner: Any = dataclasses.field(default=None, compare=False, repr=False)

    def model(self):
        """The model holding this view, or None (none given, gone, or this view copied)."""
        return self.owner() if self.owner is not None else None

    def flag(self, name: str) -> bool:
        """The switch `name` (`HOOK_FLAGS` of `interp.models.runtime`) as the model has it now."""
        model = self.model()
        return bool(model.runtime.hook_flags.get(name, False)) if model is not None else getattr(self, name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "owner": None}  # a weak reference neither pickles nor belongs to a copy


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one transformer. All fields are plain data; `to_json`/`from_json` round-trip.

    Derived sizes (`n_params`, `kv_cache_bytes_per_token`, `flops_per_token`) are methods, so the
    dataclass holds no derivable state.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int
    d_head: int | None = None  # None: d_model // n_heads
    n_kv_heads: int | None = None  # None: n_heads (MHA); 1 is MQA; anything dividing n_heads is GQA
    d_mlp: int | None = None  # None: attention-only (no MLP in the blocks)
    act_fn: Activation = "gelu_new"
    gated_mlp: bool = False  # SwiGLU / GeGLU: act(x W_gate) * (x W_in)
    normalization: Normalization | None = "layernorm"
    norm_eps: float = 1e-5
    positional: Positional | None = "learned"
    rotary_dim: int | None = None  # None: the whole head (partial rotary for GPT-NeoX/Pythia)
    rotary_base: float = 10000.0
    # Which dimensions rotate together: False, the two halves of the rotary dims (GPT-NeoX, Llama: "rotate
    # half"); True, adjacent pairs (2i, 2i + 1) ("rotate every two": GPT-J, CodeGen). TransformerLens's name.
    rotary_adjacent_pairs: bool = False
    rope_scaling: RopeScaling | None = None
    # The RoPE base of the sliding-window layers when it differs from the full layers' (Gemma 3: 1e4 on
    # local layers, 1e6 on global ones), unscaled; None: every layer uses rotary_base (and rope_scaling).
    # TransformerLens's name. Read per layer as `cfg.rope_base(layer)`.
    rotary_base_local: float | None = None
    sliding_window: int | None = None  # a query sees keys p - window < j <= p (Hugging Face's rule)
    layer_types: tuple[LayerType, ...] | None = None  # per layer; None: every layer "sliding" if a window is set
    parallel_attn_mlp: bool = False  # GPT-NeoX / GPT-J: x + attn(ln1(x)) + mlp(ln2(x))
    # RMSNorm of the queries and keys, before RoPE (Gemma 3, OLMo 2; `attn.q_norm`, `attn.k_norm`).
    qk_norm: bool = False
    # What QK-norm normalises over: "head", each head's d_head (Gemma 3); "projection", the whole query
    # projection (n_heads * d_head) and the whole key projection (kv_heads * d_head), as OLMo 2.
    qk_norm_over: QKNormOver = "head"
    # "Sandwich" norms (Gemma 2 / 3): the attention and MLP outputs are normalised again (`ln1_post`,
    # `ln2_post`) before they join the residual stream: x + ln1_post(attn(ln1(x))), then the same for the MLP.
    sandwich_norms: bool = False
    # Whether attention and MLP read the stream through a norm (`ln1`, `ln2`). False: they read it as it is,
    # and with sandwich_norms only the norms after them remain (OLMo 2: x + ln1_post(attn(x)), then the MLP's).
    pre_norms: bool = True
    # A norm of `normalization`'s kind on the token embeddings before the first block (`embed_ln`; Bloom's
    # word_embeddings_layernorm); `hook_embed` reads its output, as TransformerLens's. TransformerLens's name.
    post_embedding_ln: bool = False
    # Soft-capping (Gemma 2): attention scores, after the query scale and before masking (and ALiBi), become
    # cap * tanh(scores / cap); the final logits become cap * tanh(logits / cap). None: no cap.
    # TransformerLens's names (it writes -1.0 for none).
    attn_scores_soft_cap: float | None = None
    output_logits_soft_cap: float | None = None
    qkv_bias: bool = True
    attn_out_bias: bool = True
    mlp_bias: bool = True  # with experts: each expert's biases (gpt-oss)
    # Mixture of experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; `interp.models.native.moe`): with
    # num_experts set, every block's MLP is num_experts experts (each an MLP of width d_mlp, gated or not
    # as gated_mlp) and a linear router (`mlp.W_gate` [d_model, num_experts], TransformerLens's name) that
    # sends each token to its experts_per_token best experts, weighted by the router's softmax over all
    # experts, renormalised over the chosen ones when norm_topk_prob. None: a dense MLP. TransformerLens's
    # names (its HookedTransformer's MoE).
    num_experts: int | None = None
    experts_per_token: int | None = None
    norm_topk_prob: bool = True  # Mixtral, gpt-oss; Qwen-MoE and OLMoE configs say False
    router_bias: bool = False  # the router adds a bias (`mlp.b_gate`; gpt-oss)
    # Qwen2-MoE's shared expert: one more gated MLP of this width that every token goes through, its output
    # scaled by sigmoid(x W_shared_gate) (`mlp.shared_expert`, `mlp.W_shared_gate` [d_model, 1]). None: none.
    d_mlp_shared: int | None = None
    # gpt-oss's clamped SwiGLU experts: the gate clamped to <= swiglu_limit and the linear branch to
    # [-limit, limit], then gate * sigmoid(swiglu_alpha * gate) * (linear + 1). None (both): act_fn's GLU.
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    # Learned attention-sink logits (gpt-oss): one per head (`attn.sinks` [n_heads]) that joins each query's
    # softmax denominator and takes mass without giving a value: P_ij = exp(s_ij) / (exp(sink_h) + sum_j
    # exp(s_ij)), so a row of hook_pattern sums to less than 1 (as Hugging Face's eager attention shows
    # it). Not StreamingLLM's sink keys (a KV cache's n_sink), which are real tokens kept past a window.
    learned_sinks: bool = False
    # Gated attention (Qiu et al., NeurIPS 2025): each head's output is multiplied elementwise by
    # sigmoid(x W_gate_attn) before W_O, x the attention's (normalised) input, `attn.W_gate_attn`
    # [d_model, n_heads * d_head], the gate at `attn.hook_attn_gate` [batch, pos, head, d_head]; hook_z holds the
    # gated output (what W_O reads). No shipped architecture has it; the zoo's sink twins do. False: no gate.
    attn_output_gate: bool = False
    unembed_bias: bool = False
    tie_embeddings: bool = False
    # Token embeddings are multiplied by this (Gemma: sqrt(d_model)), rounded to the embedding's dtype first
    # as Hugging Face's Gemma does; W_E itself (and a tied unembedding) stays unscaled. None: no scaling.
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: 1 / sqrt(d_head); Gemma: query_pre_attn_scalar ** -0.5
    init_range: float = 0.02
    model_type: str = "interp"  # provenance only (e.g. "gpt2", "llama"); never branched on in forward
    # Whether text gets a BOS token first by default (`to_tokens`, `model("...")`, analyzers).
    # None follows TransformerLens: True when the tokenizer has a BOS token. The families
    # TransformerLens marks BOS-free (GPT-NeoX/Pythia, Qwen2) set False; the zoo sets True (every
    # training window starts with <bos>). Read it resolved as `model.cfg.default_prepend_bos`.
    prepend_bos: bool | None = None
    # The view of the model holding this config (`model.cfg`), for TransformerLens; not part of the
    # config's meaning: excluded from equality, hashing, repr and `to_dict`.
    view: TLView | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        sizes = dict(n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads, d_vocab=self.d_vocab, n_ctx=self.n_ctx)
        sizes |= {k: v for k, v in dict(d_head=self.d_head, n_kv_heads=self.n_kv_heads, d_mlp=self.d_mlp).items() if v is not None}
        bad = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:  # nothing below is meaningful (or even computable) with these
            raise ValueError(f"invalid ModelConfig: sizes must be positive integers, got {', '.join(bad)} (d_mlp=None means attention-only)")
        for field, value, choices in (
            ("act_fn", self.act_fn, get_args(Activation)),
            ("normalization", self.normalization, (*get_args(Normalization), None)),
            ("positional", self.positional, (*get_args(Positional), None)),
        ):
            if value not in choices:
                problems.append(f"{field}={value!r} is not one of {list(choices)}")
        if self.layer_types is not None and set(self.layer_types) - set(get_args(LayerType)):
            problems.append(f"layer_types must hold {list(get_args(LayerType))}, got {sorted(set(self.layer_types))}")
        if self.rope_scaling is not None:
            problems += self._rope_problems(self.rope_scaling)
        if self.d_head is None and self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set d_head")
        if self.n_heads % self.kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")
        if self.positional == "rotary" and self.rot_dim % 2:
            problems.append(f"rotary_dim={self.rot_dim} must be even")
        if self.positional == "rotary" and self.rot_dim > self.head_dim:
            problems.append(f"rotary_dim={self.rot_dim} exceeds d_head={self.head_dim}")
        if self.rotary_base_local is not None and self.positional != "rotary":
            problems.append(f"rotary_base_local is set but positional={self.positional!r}; it needs positional='rotary'")
        if self.sandwich_norms and self.normalization is None:
            problems.append("sandwich_norms needs a normalization (the post-attention and post-MLP norms are of that kind)")
        if self.post_embedding_ln and self.normalization is None:
            problems.append("post_embedding_ln needs a normalization (the embedding norm is of that kind)")
        if self.qk_norm_over not in get_args(QKNormOver):
            problems.append(f"qk_norm_over={self.qk_norm_over!r} is not one of {list(get_args(QKNormOver))}")
        if self.rotary_adjacent_pairs and self.positional != "rotary":
            problems.append(f"rotary_adjacent_pairs is set but positional={self.positional!r}; it needs positional='rotary'")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            problems.append(f"sliding_window must be >= 1 (an integer), got {self.sliding_window!r}")
        problems += self._expert_and_sink_problems()
        # Every real number the forward divides by or exponentiates: a NaN or a negative here gives NaN
        # or wrong logits silently, so it is refused wherever the config came from (ours, HF, GGUF).
        reals = dict(norm_eps=self.norm_eps, rotary_base=self.rotary_base)
        for name in ("attn_scale", "rotary_base_local", "embed_scale", "attn_scores_soft_cap", "output_logits_soft_cap"):
            if getattr(self, name) is not None:
                reals[name] = getattr(self, name)
        for name, value in reals.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                problems.append(f"{name} must be a finite number > 0, got {value!r}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))
        if self.d_head is None:  # resolved once, so `cfg.d_head` (read by TransformerLens code) is never None
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)

    def _rope_problems(self, s: RopeScaling) -> list[str]:
        """What is wrong with a rope scaling, wherever it came from (a config.json, GGUF metadata,
        `interp.load(rope_scaling=)`): every number finite and in its range, so that a NaN attention
        factor is refused here, in one line, instead of turning every logit into NaN."""
        problems = []
        if self.positional != "rotary":
            problems.append(f"rope_scaling is set but positional={self.positional!r}; it needs positional='rotary'")
        if s.kind not in get_args(RopeKind):
            problems.append(f"rope_scaling.kind={s.kind!r} is not one of {list(get_args(RopeKind))}")
        if _finite(s.factor) and s.factor <= 0:
            problems.append(f"rope_scaling.factor must be > 0, got {s.factor!r}")
        elif not _finite(s.factor) or not FACTOR_RANGE[0] <= s.factor <= FACTOR_RANGE[1]:
            problems.append(f"rope_scaling.factor must be a finite number from {FACTOR_RANGE[0]:g} to {FACTOR_RANGE[1]:g}, "
                            f"got {s.factor!r}")
        elif s.kind in ("dynamic", "yarn", "llama3") and s.factor < 1:
            problems.append(f"rope_scaling.factor of {s.kind} stretches the context and must be >= 1, got {s.factor!r}")
        positive = {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor}
        if s.attention_factor is not None:
            positive["attention_factor"] = s.attention_factor
        for name in ("short_factor", "long_factor"):
            for i, v in enumerate(getattr(s, name) or ()):
                positive[f"{name}[{i}]"] = v
        problems += [f"rope_scaling.{k} must be a finite number > 0, got {v!r}" for k, v in positive.items()
                     if not _finite(v) or v <= 0]
        if s.kind == "llama3" and _finite(s.low_freq_factor) and _finite(s.high_freq_factor) \
                and s.high_freq_factor <= s.low_freq_factor:
            problems.append(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {s.high_freq_factor!r} "
                            f"and {s.low_freq_factor!r}")
        if s.original_max_position is not None and (not isinstance(s.original_max_position, int)
                                                    or isinstance(s.original_max_position, bool)
                                                    or s.original_max_position < 1):
            problems.append(f"rope_scaling.original_max_position must be a whole number >= 1, got {s.original_max_position!r}")
        if s.kind in ("llama3", "longrope") and s.original_max_position is None:
            problems.append(f"{s.kind} rope scaling needs original_max_position (HF: original_max_position_embeddings)")
        if s.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                f = getattr(s, name)
                if not isinstance(f, tuple) or len(f) != self.rot_dim // 2:
                    problems.append(f"longrope {name} must be a tuple of rotary_dim / 2 = {self.rot_dim // 2} numbers, got {f!r}")
        return problems

    def _expert_and_sink_problems(self) -> list[str]:
        """What is wrong with the mixture-of-experts fields (num_experts and what goes with it) and with
        learned_sinks."""
        problems = []
        if self.learned_sinks and self.attn_scores_soft_cap is not None:
            problems.append("learned_sinks with attn_scores_soft_cap is not supported (no architecture has both)")
        e, k = self.num_experts, self.experts_per_token
        if (e is None) != (k is None):
            return problems + ["num_experts and experts_per_token go together: set both (a mixture of experts) or neither"]
        if e is None:
            extras = [n for n in ("router_bias", "d_mlp_shared", "swiglu_limit", "swiglu_alpha") if getattr(self, n)]
            return problems + ([f"{', '.join(extras)} describe experts, but num_experts is None"] if extras else [])
        for name, value in (("num_experts", e), ("experts_per_token", k), ("d_mlp_shared", self.d_mlp_shared)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and k > e:
            problems.append(f"experts_per_token={k} exceeds num_experts={e}")
        if self.d_mlp is None:
            problems.append("num_experts is set but d_mlp is None: experts are MLPs of width d_mlp")
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            problems.append("swiglu_limit and swiglu_alpha go together (gpt-oss's clamped SwiGLU): set both or neither")
        elif self.swiglu_limit is not None:
            if not self.gated_mlp:
                problems.append("swiglu_limit / swiglu_alpha describe gated experts: set gated_mlp=True")
            for name in ("swiglu_limit", "swiglu_alpha"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                    problems.append(f"{name} must be a finite number > 0, got {value!r}")
        return problems

    # ---- resolved sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def attn_only(self) -> bool:
        return self.d_mlp is None

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    def windows(self) -> list[int | None]:
        """`window(layer)` of every layer, in order."""
        return [self.window(l) for l in range(self.n_layers)]

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with `rotary_base_local` (a sliding-window layer of a model that has one)."""
        return self.rotary_base_local is not None and self.window(layer) is not None

    def rope_base(self, layer: int) -> float | None:
        """The RoPE base of `layer` (Gemma 3: 1e4 on sliding layers, 1e6 on full ones); None without rotary."""
        if self.positional != "rotary":
            return None
        return self.rotary_base_local if self.local_rope(layer) else self.rotary_base

    # ---- TransformerLens names (read-only) --------------------------------------------------
    # TransformerLens's utilities (`patching`, `head_detector`, its `ActivationCache`) read these
    # off `model.cfg`. They are derived, never stored or serialised, and describe how the model
    # holding this config behaves (see `attached`): `default_prepend_bos` is `prepend_bos` resolved
    # against the model's tokenizer; the `use_*` flags are the model's `set_use_*` switches.
    # `use_attn_result` is always True: `hook_result` fires whenever it is hooked.
    tokenizer_prepends_bos = False  # our to_tokens never lets the tokenizer add special tokens
    use_attn_result = True
    use_hook_tokens = False
    n_devices = 1

    @property
    def default_padding_side(self) -> str:
        """Where `to_tokens` pads texts of different lengths by default: the tokenizer's side (as it is now),
        else right."""
        model = self.view.model() if self.view is not None else None
        if model is not None:
            return model.runtime.padding_side()
        return self.view.default_padding_side if self.view is not None else "right"

    attention_dir = "causal"
    seed = None
    checkpoint_index = None

    @property
    def use_local_attn(self) -> bool:
        return self.sliding_window is not None

    @property
    def window_size(self) -> int | None:
        """`sliding_window`, under TransformerLens's name."""
        return self.sliding_window

    @property
    def attn_types(self) -> list[str] | None:
        """Per layer "local" (a sliding window) or "global", as TransformerLens lists them; None without windows."""
        if self.sliding_window is None:
            return None
        return ["local" if w is not None else "global" for w in self.windows()]

    @property
    def use_qk_norm(self) -> bool:
        return self.qk_norm

    @property
    def use_normalization_before_and_after(self) -> bool:
        return self.sandwich_norms

    @property
    def original_architecture(self) -> str | None:
        """The Hugging Face architecture class this family loads as (None for our own models)."""
        return _ARCHITECTURES.get(self.model_type)

    @property
    def model_name(self) -> str:
        """What the model was loaded as (`interp.load`'s name or path, the HF model's name_or_path),
        else its `model_type`."""
        return (self.view.model_name if self.view is not None else None) or self.model_type

    @property
    def tokenizer_name(self) -> str | None:
        """The tokenizer's `name_or_path`, if it has one."""
        return self.view.tokenizer_name if self.view is not None else None

    @property
    def default_prepend_bos(self) -> bool:
        """Whether text gets BOS first by default: `prepend_bos` resolved against the model's tokenizer."""
        return self.view.default_prepend_bos if self.view is not None else bool(self.prepend_bos)

    # The switches (`SWITCHES`): settable as TransformerLens's, `model.cfg.use_split_qkv_input = True`
    # calling `model.set_use_split_qkv_input(True)` (see `_assign` below the class).
    @property
    def use_split_qkv_input(self) -> bool:
        return self.view.flag("use_split_qkv_input") if self.view is not None else False

    @property
    def use_attn_in(self) -> bool:
        return self.view.flag("use_attn_in") if self.view is not None else False

    @property
    def use_hook_mlp_in(self) -> bool:
        return self.view.flag("use_hook_mlp_in") if self.view is not None else False

    @property
    def ungroup_grouped_query_attention(self) -> bool:
        """Under GQA, whether k / v and their inputs are given per query head (`set_ungroup_grouped_query_attention`)."""
        return self.view.flag("ungroup_grouped_query_attention") if self.view is not None else False

    @property
    def n_key_value_heads(self) -> int | None:
        """`n_kv_heads` (None: one per query head)."""
        return self.n_kv_heads

    @property
    def normalization_type(self) -> str | None:
        """"LN", "RMS" or None; "LNPre" / "RMSPre" once the model's norms are folded (`process_weights_`)."""
        kind = {"layernorm": "LN", "rmsnorm": "RMS", None: None}[self.normalization]
        folded = self.view.processed_fold_ln if self.view is not None else False
        return f"{kind}Pre" if kind and folded else kind

    @property
    def final_rms(self) -> bool:
        return self.normalization == "rmsnorm"

    @property
    def positional_embedding_type(self) -> str:
        """"standard" (learned), "sinusoidal", "rotary", "alibi" or "none"."""
        return {"learned": "standard", None: "none"}.get(self.positional, self.positional)

    @property
    def eps(self) -> float:
        return self.norm_eps

    @property
    def d_vocab_out(self) -> int:
        return self.d_vocab

    @property
    def device(self) -> str:
        """The device of the model holding this config (`model.cfg`); see `view`."""
        if self.view is None:
            raise AttributeError("device: this config is not held by a model; read model.cfg.device")
        return self.view.device

    @property
    def dtype(self):
        """The dtype of the model holding this config (`model.cfg`); see `view`."""
        if self.view is None:
            raise AttributeError("dtype: this config is not held by a model; read model.cfg.dtype")
        return self.view.dtype

    def with_view(self, view: TLView | None) -> "ModelConfig":
        """An equal copy that presents `view` (the model holding it) to TransformerLens code."""
        return dataclasses.replace(self, view=view)

    # ---- accounting -----------------------------------------------------------------------
    def n_params(self) -> int:
        """Number of parameters.

        embed  = vocab * d_model  (+ n_ctx * d_model if learned positions)
        attn   = d_model * (n_heads + 2 * kv_heads) * d_head + n_heads * d_head * d_model
                 (+ (n_heads + 2 * kv_heads) * d_head qkv bias, + d_model out bias)
        mlp    = (3 if gated else 2) * d_model * d_mlp (+ d_mlp * (2 if gated else 1) + d_model biases); with
                 experts, num_experts of those + the router d_model * num_experts (+ num_experts bias) + the
                 shared expert (an MLP of d_mlp_shared) and its gate (d_model)
        sinks  = n_heads per block with learned_sinks
        gate   = d_model * n_heads * d_head per block with attn_output_gate
        norm   = 2 * d_model for LayerNorm, d_model for RMSNorm; two per block (one if attn-only), one final;
                 twice that per block with sandwich norms, none before attention / MLP without pre_norms;
                 + 2 * d_head per block with QK-norm per head, (n_heads + kv_heads) * d_head over the projections;
                 + one more with post_embedding_ln
        unembed= d_model * vocab unless tied (+ vocab bias)
        """
        d, h, kv, dh = self.d_model, self.n_heads, self.kv_heads, self.head_dim
        norm = {"layernorm": 2 * d, "rmsnorm": d, None: 0}[self.normalization]
        attn = d * (h + 2 * kv) * dh + h * dh * d
        attn += (h + 2 * kv) * dh * self.qkv_bias + d * self.attn_out_bias
        norms = int(self.pre_norms) + int(self.sandwich_norms)
        qk = 2 * dh if self.qk_norm_over == "head" else (h + kv) * dh
        block = attn + norms * norm + qk * self.qk_norm
        block += h * self.learned_sinks + d * h * dh * self.attn_output_gate
        if not self.attn_only:
            n_in = 2 if self.gated_mlp else 1
            mlp = lambda width: (n_in + 1) * d * width + (n_in * width + d) * self.mlp_bias  # noqa: E731
            block += mlp(self.d_mlp) * (self.num_experts or 1) + norms * norm
            if self.num_experts:  # the router (+ its bias), and the shared expert with its gate
                block += (d + self.router_bias) * self.num_experts
                block += (mlp(self.d_mlp_shared) + d) if self.d_mlp_shared else 0
        total = self.d_vocab * d + self.n_layers * block + norm * (1 + self.post_embedding_ln)
        total += self.n_ctx * d * (self.positional == "learned")
        total += d * self.d_vocab * (not self.tie_embeddings) + self.d_vocab * self.unembed_bias
        return total

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes one token adds to a KV cache: 2 (K and V) * n_layers * kv_heads * d_head * dtype_bytes.

        Keys are stored after RoPE and only for the kv-heads (GQA/MQA share them across heads).
        """
        return 2 * self.n_layers * self.kv_heads * self.head_dim * dtype_bytes

    def flops_per_token(self, context: int) -> dict[str, int]:
        """Forward FLOPs (multiply-add = 2) to process one token that attends to `context` keys.

        attention (per layer) = 2 * d_model * (n_heads + 2 * kv_heads) * d_head    (q, k, v projections)
                              + 2 * n_heads * d_head * d_model                     (output projection)
                              + 2 * d_model * n_heads * d_head                     (output gate, if any)
                              + 2 * 2 * n_heads * d_head * context                 (q k^T and pattern @ v)
        mlp (per layer)       = 2 * (3 if gated else 2) * d_model * d_mlp, times experts_per_token with
                                experts, + 2 * d_model * num_experts (router) + the shared expert's
        unembed               = 2 * d_model * vocab
        Norms, softmax, activations and biases are not counted (they are O(d) per token).
        """
        check_int("context", context, minimum=1)
        d, h, kv, dh = self.d_model, self.n_heads, self.kv_heads, self.head_dim
        attn = 2 * d * (h + 2 * kv) * dh + 2 * h * dh * d + 4 * h * dh * context
        attn += 2 * d * h * dh * self.attn_output_gate  # x W_gate_attn (`attn_output_gate`)
        mlp = 0 if self.attn_only else 2 * (3 if self.gated_mlp else 2) * d * self.d_mlp
        if self.num_experts and not self.attn_only:  # the chosen experts, the router, the shared expert
            mlp = mlp * self.experts_per_token + 2 * d * self.num_experts
            mlp += 2 * (3 if self.gated_mlp else 2) * d * self.d_mlp_shared + 2 * d if self.d_mlp_shared else 0
        out = {"attention": self.n_layers * attn, "mlp": self.n_layers * mlp, "unembed": 2 * d * self.d_vocab}
        out["total"] = sum(out.values())
        return out

    # ---- serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "view"}
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"view"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        data = dict(data)
        if data.get("rope_scaling") is not None and not isinstance(data["rope_scaling"], RopeScaling):
            scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in data["rope_scaling"].items()}  # JSON lists
            data["rope_scaling"] = RopeScaling(**scaling)
        if data.get("layer_types") is not None:
            data["layer_types"] = tuple(data["layer_types"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with `changes`: a new shape, so without the view of the model that held this one."""
        return dataclasses.replace(self, **{"view": None, **changes})


_frozen_setattr = ModelConfig.__setattr__  # the dataclass's: "cannot assign to field 'n_layers'"


def _assign(self: ModelConfig, name: str, value: Any) -> None:
    """`model.cfg.<switch> = value` is `model.set_<switch>(value)`, as assigning TransformerLens's config
    switches it; every other field stays frozen."""
    if name not in SWITCHES:
        return _frozen_setattr(self, name, value)
    model = self.view.model() if self.view is not None else None
    if model is None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: this config is not held by a model "
                                              f"(a copy, or made alone); call model.set_{name}({value!r})")
    getattr(model, f"set_{name}")(value)


ModelConfig.__setattr__ = _assign  # after the class: a frozen dataclass may not define its own

__all__ = ["ModelConfig", "RopeScaling", "TLView", "SWITCHES"]
