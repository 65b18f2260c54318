"""From tensors to a model, for every checkpoint format: the shape and finiteness checks, a family's
weight conversion (failing on any tensor it does not read), and the model built on the meta device
that adopts the tensors. The formats (`ours`, `hf`, `gguf`) call in here.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import torch
from torch import Tensor

from ..native.components import relayout_mlp_
from ..config import ModelConfig
from interp.errors import CheckpointError, UserError
from ..positions import Rotary, alibi_slopes, sinusoidal_table
from ..placement.offload import Offload
from ..placement import device_map as device_maps
from ..placement.tensor_files import Joined, release_pages
from ..native.transformer import HookedTransformer


@contextlib.contextmanager
def config_errors(source):
    """What building a config from a file's description raises (a ModelConfig that cannot be: zero heads, a
    string layer count, a NaN rope parameter), as one line naming the file, before any weight is read."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, TypeError, KeyError, ZeroDivisionError, OverflowError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{source} does not describe a model interp can build: {message}") from None


# ---- quantized checkpoints ----------------------------------------------------------------------------
# interp dequantizes GGUF files only (`gguf`); a folder or a transformers model whose weights are integers or
# float8 holds codes, not weights: cast to float they are meaningless numbers. The layout is named from the
# tensors stored beside the weights (their last name part), as each method writes them.
_LAYOUTS = {"qzeros": "GPTQ/AWQ (qweight, qzeros, scales)", "g_idx": "GPTQ (qweight, g_idx, scales)",
            "weight_scale_inv": "block-wise FP8 (weight_scale_inv)", "weight_scale": "scaled FP8/INT8 (weight_scale: "
            "compressed-tensors, FBGEMM)", "SCB": "bitsandbytes 8-bit (SCB)", "absmax": "bitsandbytes 4-bit (absmax, "
            "quant_map)", "quant_map": "bitsandbytes 4-bit (absmax, quant_map)", "scales": "integers with scales",
            "_scales": "MXFP4 (_blocks, _scales: gpt-oss)"}
_LOW = (torch.int8, torch.uint8, torch.int16, torch.int32)
# What loads such a checkpoint, by config.json's quantization_config.quant_method (transformers' names).
_LIBRARIES = {"bitsandbytes": "bitsandbytes", "gptq": "gptqmodel and optimum", "awq": "autoawq",
              "compressed-tensors": "compressed-tensors", "hqq": "hqq", "quanto": "optimum-quanto",
              "torchao": "torchao", "eetq": "eetq", "aqlm": "aqlm", "vptq": "vptq", "fbgemm_fp8": "fbgemm-gpu", "fp8": "accelerate, on a GPU",
              "mxfp4": "Mxfp4Config(dequantize=True)"}
DEQUANTIZE = ("load an unquantized copy (float16, bfloat16 or float32), or load this one with transformers and its "
              "quantization library, dequantize it there (model.dequantize(), where the method has one) and pass the "
              "model to interp.from_hf")


def _low_precision(dtype: torch.dtype) -> bool:
    """Integers or 8-bit floats: stored codes of a quantized weight, not its values."""
    return dtype in _LOW or (dtype.is_floating_point and dtype.itemsize == 1)


def refuse_quantized(dtypes: dict[str, torch.dtype], source: str, *, every: bool = False) -> None:
    """Refuse (CheckpointError, one line naming the layout) weights stored as integers or float8: a quantized
    layout interp cannot dequantize. `dtypes`: {tensor name: dtype} (a checkpoint's names, from its headers or
    its tensors); only the weights count (names ending in weight, qweight or _blocks: masks and position ids
    may be integers), unless `every` (interp's own names, every one a weight)."""
    low = [k for k, d in dtypes.items() if _low_precision(d) and (every or k.endswith(("weight", "_blocks")))]
    if not low:
        return
    stored = "/".join(sorted({str(dtypes[k]).removeprefix("torch.") for k in low}))
    beside = sorted(({k.rsplit(".", 1)[-1] for k in dtypes} & set(_LAYOUTS))
                    | ({"_scales"} if any(k.endswith("_scales") for k in dtypes) else set()))
    what = f"{len(low)} weight tensor(s) stored as {stored} ({low[0]!r}{', ...' if len(low) > 1 else ''})"
    if beside:
        raise CheckpointError(f"{source} is quantized, {_LAYOUTS[beside[0]]}: {what}, a layout interp cannot "
                              f"dequantize; {DEQUANTIZE}")
    raise CheckpointError(f"{source} holds {what} with no scale tensors beside them: quantized codes interp cannot "
                          "dequantize (cast to float they would be meaningless numbers); load an unquantized copy "
                          "(float16, bfloat16 or float32) of the model")


def refuse_quantization_config(config_file, raw: dict) -> None:
    """A config.json with a `quantization_config`: its weights are in a quantized layout that transformers loads
    through a quantization library, and interp cannot dequantize; refused in one line naming the method."""
    q = raw.get("quantization_config")
    if not q:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    library = _LIBRARIES.get(str(method))
    raise CheckpointError(f"{config_file} says its weights are quantized (quantization_config, quant_method "
                          f"{method!r}), a layout interp cannot dequantize; "
                          + DEQUANTIZE.replace("its quantization library", library or "its quantization library"))


def build_model(cfg: ModelConfig, sd: dict[str, Tensor], source: str, dtype, device, *,
                fresh: bool = False, offload: str | None = None,
                device_map: dict[str, torch.device] | None = None) -> HookedTransformer:
    """A model holding the state dict `sd` (checked against the config's shapes). With `fresh` (the
    tensors belong to no one else, e.g. just read from a file), the model adopts them without a copy
    and `sd` is emptied as it goes. `offload` ("disk" or "cpu", fresh tensors only): the blocks, the
    embedding and the unembedding stay where `interp.models.placement.offload` keeps them, each brought to `device`
    when it runs. `device_map` ({unit: torch.device}, `device_map.resolve_device_map`'s, fresh tensors only):
    each parameter goes straight to its unit's device, and the units run there (`interp.models.placement.device_map`)."""
    if offload is not None and not fresh:
        raise ValueError("offload needs tensors read from a checkpoint (fresh=True)")
    if device_map is not None and (not fresh or offload is not None):
        raise ValueError("device_map needs tensors read from a checkpoint (fresh=True), and no offload")
    refuse_quantized({k: v.dtype for k, v in sd.items()}, source, every=True)
    if not fresh:
        check_finite(sd, source)
    with torch.device("meta"):
        model = HookedTransformer(cfg, seed=None)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise CheckpointError(f"{source} is missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} for this config")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source} has tensors this config does not use: {unexpected[:5]}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise CheckpointError(f"tensor {k!r} in {source} has shape {tuple(sd[k].shape)}, the config implies {tuple(shape)}")
    if fresh:
        # Taken out of `sd` one at a time, so a tensor that needs a copy (a transposed view, another
        # dtype) frees its source as it goes: loading peaks near one copy of the weights, not two.
        # A tensor already in the parameter's layout (strides) and dtype is adopted as it is: a view of a
        # memory-mapped file stays the file's memory (`tensor_files.mapped_safetensors`).
        # Each is checked for NaN as it comes, and a memory-mapped one's pages are then handed back to the
        # kernel (`release_pages`: re-read from the page cache when used), so the checkpoint's file is
        # never resident all at once during the load.
        target, owned, bad = torch.device(device or "cpu"), {}, []
        specs = model.state_dict()
        offloading = None if offload is None else Offload(offload, target, dtype)
        kept_off: dict[str, Tensor] = {}
        layouts: dict[str, tuple] = {}
        params = {k for k, _ in model.named_parameters()}  # buffers (a sinusoidal table) are rebuilt below
        for k in list(sd):
            v = sd.pop(k)
            bad += non_finite(k, v)
            layout = adopted_stride(k, v, specs[k])
            if offloading is not None and k in params and offloading.unit_of(k) is not None:
                layouts[k] = layout  # as the model held whole has it
                kept_off[k] = offloading.source(v, layout)  # the mapped view itself (disk), or a host copy (cpu)
                release_pages([v])
                del v
                continue
            where = target if device_map is None else device_map[device_maps.unit_of(k)]
            kept = v.to(device=where, dtype=dtype) if v.is_floating_point() else v.to(where)
            if tuple(kept.stride()) != layout:
                kept = torch.empty_strided(tuple(kept.shape), layout, dtype=kept.dtype, device=kept.device).copy_(kept)
            owned[k] = kept
            release_pages([v])
            del v, kept
        refuse_non_finite(bad, source)
        if offloading is not None:
            offloading.attach(model, kept_off, specs, layouts)  # placeholders on the meta device until each unit runs
        model.load_state_dict(owned, strict=offloading is None, assign=True)
    else:
        model = model.to_empty(device=device or "cpu")
        model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    if device_map is not None:
        device_maps.attach(model, device_map)  # before the buffers: they go where their unit runs
    if getattr(model, "offload", None) is None:
        model.to(dtype)
    for block in model.blocks:  # adopted tensors are contiguous: back to the MLP's out-major layout
        relayout_mlp_(block.mlp)
    # Buffers (rotary frequencies, sinusoidal tables, ALiBi slopes) were on the meta device: rebuild them.
    _rebuild_buffers(model, cfg)
    return model.eval()


_RELAID = re.compile(r"blocks\.\d+\.mlp\.(W_in|W_gate)$")  # what `relayout_mlp_` turns out-major again


def adopted_stride(key: str, tensor: Tensor, spec: Tensor) -> tuple:
    """The strides `build_model` gives the parameter `key` made from `tensor`: the tensor's own when they are the
    parameter's (`spec`, the meta model's) or out-major (a matrix [in, out] that is the transposed view of a
    checkpoint's [out, in], as nn.Linear stores it: `builders.t`), else contiguous; an MLP's W_in / W_gate then
    out-major (`relayout_mlp_`). Keeping the file's layout costs no copy (a bf16 8B model is adopted from its
    mapped files as they are), and it is the layout CPU kernels multiply fastest in bf16: x @ W with W
    [4096, 4096] in-major runs at 0.3 GFLOP/s on 2 cores (a scalar fallback), out-major at 19 GFLOP/s (float32:
    78 and 83). An offloaded model materialises each weight in this layout, so its matrix products are the
    model held whole's, bit for bit."""
    shape = tuple(spec.shape)
    if tuple(tensor.stride()) == tuple(spec.stride()):
        stride = tuple(spec.stride())
    elif len(shape) == 2 and shape[0] > 1 and tuple(tensor.stride()) == (1, shape[0]):
        stride = (1, shape[0])
    else:
        stride = torch.empty(shape, device="meta").stride()
    if _RELAID.match(key) and len(shape) == 2 and stride[0] != 1:
        stride = (1, shape[0])
    return tuple(stride)


def check_finite(sd: dict[str, Tensor], source: str) -> None:
    """Weights holding NaN or inf make every number computed from them meaningless (a diverged training
    step, a damaged file): refused on load, naming the tensors, so no analysis ever reports them."""
    refuse_non_finite([b for name, t in sd.items() for b in non_finite(name, t)], source)


def non_finite(name: str, t: Tensor) -> list[str]:
    """["name (count of numel)"] when `t` holds NaN or inf, else []. A `Joined` weight is checked part by part."""
    if isinstance(t, Joined):
        counts = [int(found.rsplit(" (", 1)[1].split(" of ")[0]) for p in t.parts for found in non_finite(name, p)]
        return [f"{name} ({sum(counts)} of {t.numel()})"] if counts else []
    # A NaN or inf anywhere makes the sum NaN or inf (IEEE arithmetic), and a sum reads the tensor once
    # in place, as it lies (a memory-mapped file's view, transposed or not), with no temporary: 0.2 s a
    # billion bf16 weights, where isfinite took 7 s. A sum that is not finite (a real NaN, or finite
    # weights whose sum overflows, as float16's can) is then counted exactly, in slabs.
    if not t.is_floating_point() or not t.numel() or bool(torch.isfinite(t.sum())):
        return []
    count = sum(int((~torch.isfinite(s)).sum()) for s in t.reshape(-1).split(1 << 22))
    return [f"{name} ({count} of {t.numel()})"] if count else []


def refuse_non_finite(bad: list[str], source: str) -> None:
    if bad:
        raise CheckpointError(f"{source} holds non-finite weights (NaN or inf) in {', '.join(bad[:4])}"
                              f"{' ...' if len(bad) > 4 else ''}: the checkpoint is damaged or its training "
                              "diverged; nothing computed from it would mean anything")


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Shapes read from a file's header (`tensor_files.header_shapes`) against what `cfg` implies,
    before any model is built, so a config that lies about its size (n_layers 100000) is refused at
    once instead of after building it. The expected shapes come from a one-layer model on the meta
    device (free)."""
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    if layers != set(range(cfg.n_layers)):
        raise CheckpointError(f"the config says n_layers={cfg.n_layers} but {source} holds {len(layers)} blocks: "
                              "config.json and the weights do not belong together")
    with torch.device("meta"):
        one = HookedTransformer(cfg.replace(n_layers=1, layer_types=None), seed=None)
    for key, value in one.state_dict().items():
        names = [key] if not key.startswith("blocks.0.") else [f"blocks.{l}.{key[9:]}" for l in range(cfg.n_layers)]
        for name in names:
            if name in shapes and shapes[name] != tuple(value.shape):
                raise CheckpointError(f"tensor {name!r} in {source} has shape {shapes[name]}, the config implies "
                                      f"{tuple(value.shape)}: config.json and the weights do not belong together")


def _rebuild_buffers(model: HookedTransformer, cfg: ModelConfig) -> None:
    device = model.device
    where = model.device_map or {}
    if model.rotary is not None:
        model.rotary.inv_freq = Rotary(cfg).inv_freq.to(device)
    if cfg.positional == "sinusoidal":
        model.pos_embed.W_pos = sinusoidal_table(cfg.n_ctx, cfg.d_model).to(where.get("pos_embed", device), model.dtype)
    if cfg.positional == "alibi":
        for b in model.blocks:
            b.attn.alibi_slopes = alibi_slopes(cfg.n_heads).to(where.get(f"blocks.{b.layer}", device))


def _getter(tensors: dict[str, Tensor], source: str) -> Callable[[str], Tensor]:
    """get(name, *alternatives): a tensor by its Hugging Face name (or the first alternative name
    present, e.g. Pythia's `embed_out` vs transformers 5's `lm_head`), tolerating a missing or extra
    base-model prefix."""

    def get(*names: str) -> Tensor:
        get.last = names[0]
        for name in names:
            short = name.split(".", 1)[1] if "." in name else name
            for cand in (name, short, f"model.{short}", f"transformer.{short}", f"gpt_neox.{short}"):
                if cand in tensors:
                    get.used.add(cand)
                    return tensors[cand]
        raise CheckpointError(f"{source} has no tensor {' or '.join(map(repr, names))} (it holds {len(tensors)} tensors)")

    get.used, get.last = set(), None  # what the conversion read: unread tensors are an error (see _convert)
    return get


# Buffers some checkpoints carry that hold no weights (causal masks, rotary frequencies).
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")


def convert_weights(family, cfg: ModelConfig, tensors: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """A family's weight mapping, failing loudly: a tensor it cannot convert, or a checkpoint tensor it
    does not read (a weight the config does not describe, e.g. a bias the config turns off), raises. Integer
    or float8 weights (a quantized layout) are refused first (`refuse_quantized`)."""
    if isinstance(tensors, dict):  # read tensors (a GGUF file's mapping dequantizes each as it is read)
        refuse_quantized({k: v.dtype for k, v in tensors.items()}, source)
    get = _getter(tensors, source)
    try:
        sd = family.weights(cfg, get)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"{source}: could not convert the {family.name} weights at tensor {get.last!r} ({e}); "
            "do config.json and the weights belong to the same model?"
        ) from e
    unread = sorted(k for k in tensors if k not in get.used and not k.endswith(_NOT_WEIGHTS))
    tied = [k for k in unread if k.endswith("lm_head.weight") and cfg.tie_embeddings]
    for k in tied:  # transformers keeps the tied head in state_dict(); it must be the embedding
        if not torch.equal(tensors[k], sd["embed.W_E"]):
            raise CheckpointError(f"{source}: the config ties the embeddings but {k!r} differs from the embedding matrix")
        unread.remove(k)
    if unread:
        raise CheckpointError(
            f"{source} has tensors the {family.name} conversion does not use: {unread[:5]}{' ...' if len(unread) > 5 else ''}; "
            "the config does not describe these weights (e.g. a bias or norm the config turns off)"
        )
    return sd

