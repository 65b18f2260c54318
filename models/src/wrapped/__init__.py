"""Any Hugging Face causal LM whose attention goes through transformers' attention interface, wrapped.

transformers' model files call whichever attention function the registry holds
(`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`). `WrappedModel` registers one of its own,
"interp", and points the model at it, so one function reaches every architecture that uses the
interface (Phi, Cohere, Granite, StarCoder2, GLM, Nemotron, ...) without a family file:

    fused         transformers' own SDPA call (exactly what the model runs by default), while nothing
                  asks for this layer's scores or pattern; soft-capped or sink-logit layers (which SDPA
                  cannot express) run the explicit computation in blocks of queries, never the whole
                  [q, k] pattern.
    instrumented  explicit scores -> hook_attn_scores -> softmax -> hook_pattern -> z, for the layers whose
                  scores or pattern are hooked or cached (or all, under `model.attention("instrumented")`).
                  It calls every hook point of the layer as a module, hooked or not (PyTorch module hooks
                  and nnsight read them: docs/interop.md); the fused path calls only the hooked ones.

On top sit TransformerLens's hook names, fired from the model's own modules:

    hook_embed                       the token embedding module's output
    blocks.{l}.hook_resid_pre        the decoder layer's input
    blocks.{l}.attn.hook_q / hook_k  [batch, pos, head | kv_head, d_head]: what attention receives, i.e.
                                     AFTER the model's RoPE and QK-norms (a native model's hook_q is before
                                     RoPE, its hook_rot_q after); editing them changes what attention sees
    blocks.{l}.attn.hook_v / hook_z  values, and each head's output before the output projection
    blocks.{l}.attn.hook_attn_scores / hook_pattern   [batch, head, q, k]
    blocks.{l}.hook_attn_out         the attention module's output (before a post-attention norm, where the
                                     model has one); blocks.{l}.hook_mlp_out: the MLP module's output
    blocks.{l}.hook_resid_post       the decoder layer's output

There is no `ln_final.hook_normalized`: TransformerLens's is the normalised stream before the norm's
weight, which a wrapped norm module does not expose (its output is after the weight), and a hook of the
same name with another meaning would be a silent error.

Everything that reads only hooks works on a wrapped model: `run_with_cache`, `run_with_hooks`, head
ablation through hook_z, `attention_stats` (the streaming kernel on the q/k attention received), the
views, `generate` (transformers' own). What needs interp's own implementation of the model (per-head
weights W_Q / W_O / ..., weight processing, GGUF, KV-cache policies, saving in our format) raises
`NativeOnly`, one line naming the native families.
"""

from ..base import NativeOnly, native_families, native_only  # noqa: F401 - their home before the base
from .architectures import (  # noqa: F401 - the package's names, as when it was one module
    LISTED,
    _ATTN_NAMES,
    _MLP_NAMES,
    _NORM_NAMES,
    Bypasses,
    _child,
    _decoder_layers,
    _first,
    _text_config,
    architecture,
    architecture_table,
    causal_lm_class,
    check_structure,
    check_wrappable,
    config_from_hf,
    config_windows,
    every_causal_lm,
    refusal,
    uses_interface,
    wrapped_config,
)
from .attention_function import INTERFACE, QUERY_BLOCK, WrappedAttention, register_interface  # noqa: F401
from .model import WrappedBlock, WrappedModel, generate_wrapped  # noqa: F401
