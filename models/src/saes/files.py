"""The SAE formats on disk, read into SAELens's fields and tensors (`SAEFiles`); `sae.py` builds the SAE.

    SAELens            cfg.json + sae_weights.safetensors      all four architectures; the 6.x cfg.json (metadata
                                                               {hook_name, ...}) and the older flat ones SAELens 6
                                                               still reads (hook_point / hook_name at the top,
                                                               activation_fn_str "topk" + activation_fn_kwargs {k})
    Gemma Scope        params.npz                              JumpReLU (W_enc, W_dec, b_enc, b_dec, threshold);
                                                               the hook from the path: layer_N in a -res, -mlp or
                                                               -att repo (resid_post, mlp_out, attn hook_z)
    Gemma Scope 2      params.safetensors (+ config.json)      JumpReLU, lowercase names (w_enc, ...); the hook
                                                               from the folder: resid_post/, attn_out/, mlp_out/
                                                               layer_N_... (SAELens's gemma_3 loader)
    EleutherAI         cfg.json + sae.safetensors              top-k (or groupmax) with sparsify's encode:
    sparsify                                                   encoder.weight [d_sae, d_in], encoder.bias, W_dec,
                                                               b_dec; the hook from the folder's hookpoint name

Never read: SAELens's sparsity.safetensors (not the SAE) and any pickle (`.pt`, `.pth`, `.bin`: code in a
checkpoint never runs; an .npz holding objects is refused by numpy's allow_pickle=False). Every check that
needs no weights (files present, shapes against the config, the architecture) is made before a weight is read.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from interp.errors import CheckpointError
from ..placement.tensor_files import inside, mapped_safetensors, safetensors_header

SAE_LENS_WEIGHTS, SPARSIFY_WEIGHTS, CFG = "sae_weights.safetensors", "sae.safetensors", "cfg.json"
GEMMA_SCOPE, GEMMA_SCOPE_2 = "params.npz", "params.safetensors"
LOOKED_FOR = (f"SAELens ({CFG} + {SAE_LENS_WEIGHTS}), Gemma Scope ({GEMMA_SCOPE}; Gemma Scope 2: {GEMMA_SCOPE_2}) "
              f"or EleutherAI sparsify ({CFG} + {SPARSIFY_WEIGHTS})")
PICKLES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


@dataclass
class SAEFiles:
    """What a folder says, before any weight is read: SAEConfig's fields (by name), each tensor's shape by
    SAELens's name, and `load()`, which reads the tensors (by the same names)."""

    fields: dict
    shapes: dict[str, tuple[int, ...]]
    load: Callable[[], dict[str, Tensor]]
    source: str


def format_of(folder: Path) -> str:
    """"sae_lens", "gemma_scope", "gemma_scope_2" or "sparsify"; CheckpointError naming what was looked for."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder: an SAE is a folder of {LOOKED_FOR}")
    has = {p.name for p in folder.iterdir()}
    pickles = sorted(n for n in has if n.endswith(PICKLES))
    never = (f"; {', '.join(pickles[:3])} {'is a pickle' if len(pickles) == 1 else 'are pickles'}, never read "
             "(code in a checkpoint never runs): re-save it as safetensors") if pickles else ""
    for kind, weights in (("sae_lens", SAE_LENS_WEIGHTS), ("sparsify", SPARSIFY_WEIGHTS)):
        if weights in has:
            if CFG not in has:
                raise CheckpointError(f"{folder} has {weights} but no {CFG}: the download is incomplete "
                                      f"({'an EleutherAI sparsify' if kind == 'sparsify' else 'a SAELens'} SAE is both)")
            return kind
    if GEMMA_SCOPE in has:
        return "gemma_scope"
    if GEMMA_SCOPE_2 in has:
        return "gemma_scope_2"
    if CFG in has:
        raise CheckpointError(f"{folder} has {CFG} but neither {SAE_LENS_WEIGHTS} (SAELens) nor {SPARSIFY_WEIGHTS} "
                              f"(EleutherAI sparsify): the download is incomplete{never}")
    raise CheckpointError(f"{folder} holds no SAE interp reads: it looked for {LOOKED_FOR}{never}")


def read(folder: Path, *, where: str | None = None, hook_name: str | None = None) -> SAEFiles:
    """The SAE in `folder`. `where`: the name it was asked by (a Hub repo and folder), read for the hook of
    a Gemma Scope file; `hook_name` overrides the hook the files say (or supplies one they cannot say)."""
    folder = Path(folder)
    kind = format_of(folder)
    reader = {"sae_lens": _sae_lens, "gemma_scope": _gemma_scope, "gemma_scope_2": _gemma_scope_2,
              "sparsify": _sparsify}[kind]
    files = reader(folder, where or str(folder))
    if hook_name is not None:
        files.fields["hook_name"] = hook_name
    if not files.fields.get("hook_name"):
        raise CheckpointError(f"{files.source} does not say which hook point it reads; pass hook_name= "
                              "(interp's name, e.g. 'blocks.6.hook_resid_post' or 'blocks.6.attn.hook_z')")
    return files


# ---- shared ----------------------------------------------------------------------------------------
def _json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"could not read {file} ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return raw


def _file(folder: Path, name: str) -> Path:
    return inside(folder, name, f"the SAE folder {folder}")


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(e["shape"]) for k, e in safetensors_header(file)[0].items()}


def _int(cfg: dict, key: str, source: Path):
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{source} says {key}={value!r}; it must be a positive integer")
    return value


def _layer(text: str) -> int | None:
    """The layer the last `layer_N` (or `layers.N`) of a path names."""
    found = re.findall(r"layers?[._](\d+)", text)
    return int(found[-1]) if found else None


# ---- SAELens ---------------------------------------------------------------------------------------
# What SAELens keeps as metadata (its LLM_METADATA_KEYS), found at the top of the flat cfg.json layouts.
_METADATA = ("hook_head_index", "hook_point_head_index", "model_class_name", "model_from_pretrained_kwargs",
             "prepend_bos", "exclude_special_tokens", "neuronpedia_id", "context_size", "seqpos_slice", "dataset_path",
             "sae_lens_version", "sae_lens_training_version")


def sae_lens_fields(cfg: dict, source: str) -> dict:
    """SAEConfig's fields from a SAELens cfg dict (cfg.json, or `sae.cfg.to_dict()`): 6.x's layout and the
    flat ones before it, read as SAELens 6 reads them (its `handle_pre_6_0_config`)."""
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    arch = cfg.get("architecture", "standard")
    activation = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    kwargs = cfg.get("activation_fn_kwargs") if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
    k = cfg.get("k")
    if activation == "topk" and kwargs.get("k") is not None and "architecture" not in cfg:
        arch, k = "topk", kwargs["k"]
    norm = cfg.get("normalize_activations", "none")
    norm = {True: "expected_average_only_in", False: "none", None: "none"}.get(norm, norm) if isinstance(norm, (bool, type(None))) else norm
    reshape = cfg.get("reshape_activations") or ("hook_z" if "hook_z" in str(hook or "") else "none")
    fields = {
        "architecture": arch, "d_in": cfg.get("d_in"), "d_sae": cfg.get("d_sae"),
        "hook_name": hook, "apply_b_dec_to_input": cfg.get("apply_b_dec_to_input", True),
        "normalize_activations": norm, "reshape_activations": reshape,
        "k": k if arch == "topk" else None, "dtype": str(cfg.get("dtype") or "float32").removeprefix("torch."),
        "model_name": meta.get("model_name") or cfg.get("model_name"),
        "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "metadata": {**{k: cfg[k] for k in _METADATA if k in cfg},
                     **{k: v for k, v in meta.items() if k not in ("hook_name", "model_name")}},
    }
    if cfg.get("finetuning_scaling_factor"):
        raise CheckpointError(f"{source} says finetuning_scaling_factor: a scale SAELens 6 no longer applies "
                              "(SAELens cannot load it either); fold it into W_dec and re-save")
    return fields


def _sae_lens(folder: Path, where: str) -> SAEFiles:
    cfg_file, weights = _file(folder, CFG), _file(folder, SAE_LENS_WEIGHTS)
    fields = sae_lens_fields(_json(cfg_file), str(cfg_file))
    return SAEFiles(fields, _header(weights), lambda: mapped_safetensors(weights), str(folder))


# ---- Gemma Scope ------------------------------------------------------------------------------------
_GEMMA_SITES = {"res": "blocks.{L}.hook_resid_post", "mlp": "blocks.{L}.hook_mlp_out", "att": "blocks.{L}.attn.hook_z"}
_GEMMA_MODELS = {"2b-it": "gemma-2-2b-it", "9b-it": "gemma-2-9b-it", "2b": "gemma-2-2b", "9b": "gemma-2-9b",
                 "27b": "gemma-2-27b"}


def gemma_scope_hook(where: str) -> tuple[str | None, str | None]:
    """(hook name, model name) from a Gemma Scope path or name: the repo (gemma-scope-2b-pt-res, or the Hub
    cache's models--google--gemma-scope-2b-pt-res) says the site, layer_N the layer, as SAELens's loader."""
    site = model = None
    for part in re.split(r"[/\\]", where):
        m = re.search(r"gemma-scope-([0-9a-z]+)-(pt|it)-(res|mlp|att)\b", part)
        if m:
            site = m.group(3)
            model = _GEMMA_MODELS.get(f"{m.group(1)}-it" if m.group(2) == "it" else m.group(1))
    layer = _layer(where)
    if "embedding" in where and site == "res":
        return "hook_embed", model
    if site is None or layer is None:
        return None, model
    return _GEMMA_SITES[site].format(L=layer), model


def _npz_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """{array name: shape} of an .npz from the headers of its members, reading no array."""
    try:
        out = {}
        with zipfile.ZipFile(file) as z:
            for info in z.infolist():
                with z.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _, dtype = header(fh)
                if dtype.hasobject:
                    raise CheckpointError(f"{file} holds Python objects in {info.filename} (a pickle), never read: "
                                          "code in a checkpoint never runs")
                out[info.filename.removesuffix(".npy")] = tuple(shape)
        return out
    except CheckpointError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"could not read {file} ({type(e).__name__}: {e}): re-download it") from None


def _gemma_fields(shapes: dict, file: Path, where: str, hook: str | None, model: str | None) -> dict:
    if "W_enc" not in shapes or len(shapes["W_enc"]) != 2:
        raise CheckpointError(f"{file} has no 2-D W_enc (it holds {', '.join(sorted(shapes)) or 'nothing'}): not a Gemma Scope SAE")
    d_in, d_sae = shapes["W_enc"]
    return {"architecture": "jumprelu", "d_in": d_in, "d_sae": d_sae, "hook_name": hook, "apply_b_dec_to_input": False,
            "normalize_activations": "none", "reshape_activations": "none", "dtype": "float32", "model_name": model,
            "metadata": {"prepend_bos": True, "context_size": 1024}}


def _gemma_scope(folder: Path, where: str) -> SAEFiles:
    file = _file(folder, GEMMA_SCOPE)
    shapes = {("W_" + k[2:] if k.startswith("w_") else k): v for k, v in _npz_shapes(file).items()}
    hook, model = gemma_scope_hook(where)
    fields = _gemma_fields(shapes, file, where, hook, model)

    def load() -> dict[str, Tensor]:
        try:
            with np.load(file, allow_pickle=False) as data:
                out = {("W_" + k[2:] if k.startswith("w_") else k): torch.from_numpy(np.array(data[k], dtype=np.float32))
                       for k in data.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise CheckpointError(f"could not read {file} ({type(e).__name__}: {e})") from None
        if hook == "hook_embed":  # SAELens's loader: an embedding SAE was trained on Gemma's unscaled embedding
            out["W_enc"] = out["W_enc"] / np.sqrt(fields["d_in"])
            out["W_dec"] = out["W_dec"] * np.sqrt(fields["d_in"])
        return out

    return SAEFiles(fields, shapes, load, str(file))


_GEMMA_3_SITES = {"resid_post": "blocks.{L}.hook_resid_post", "attn_out": "blocks.{L}.attn.hook_z",
                  "mlp_out": "blocks.{L}.hook_mlp_out"}


def _gemma_scope_2(folder: Path, where: str) -> SAEFiles:
    file = _file(folder, GEMMA_SCOPE_2)
    if re.search(r"transcoder|(^|[/_])clt", where):
        raise CheckpointError(f"{where} is a Gemma Scope 2 transcoder (it maps an MLP's input to its output), not an "
                              "SAE: interp reads SAEs")
    raw = _json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if raw and raw.get("architecture", "jump_relu") != "jump_relu":
        raise CheckpointError(f"{folder / 'config.json'} says architecture {raw.get('architecture')!r}; Gemma Scope 2's "
                              "SAEs are jump_relu")
    header = _header(file)
    shapes = {("W_" + k[2:] if k.startswith("w_") else k): v for k, v in header.items()}
    hook, layer = None, _layer(where)
    for site, pattern in _GEMMA_3_SITES.items():
        if re.search(rf"(^|[/\\]){site}(_all)?([/\\]|$)", where) and layer is not None:
            hook = pattern.format(L=layer)
    model = raw.get("model_name")
    fields = _gemma_fields(shapes, file, where, hook, model)
    if raw.get("hf_hook_point_in"):
        fields["metadata"]["hf_hook_name"] = raw["hf_hook_point_in"]

    def load() -> dict[str, Tensor]:
        return {("W_" + k[2:] if k.startswith("w_") else k): t for k, t in mapped_safetensors(file).items()}

    return SAEFiles(fields, shapes, load, str(folder))


# ---- EleutherAI sparsify ------------------------------------------------------------------------------
_SPARSIFY_SITES = {"": "hook_resid_post", "mlp": "hook_mlp_out", "self_attn": "hook_attn_out", "attn": "hook_attn_out",
                   "attention": "hook_attn_out"}


def sparsify_hook(hookpoint: str) -> str | None:
    """interp's hook name for a sparsify hookpoint (a module's output: `layers.6` -> blocks.6.hook_resid_post,
    `layers.6.mlp` -> hook_mlp_out, `layers.6.self_attn` -> hook_attn_out; GPT-2's `h.6`, NeoX's
    `gpt_neox.layers.6.attention` alike; `embed_tokens` -> hook_embed), or None for any other module."""
    if hookpoint.split(".")[-1] in ("embed_tokens", "wte", "embed_in"):
        return "hook_embed"
    m = re.fullmatch(r"(?:.*\.)?(?:layers|h|blocks)\.(\d+)(?:\.(\w+))?", hookpoint)
    if m is None or (m.group(2) or "") not in _SPARSIFY_SITES:
        return None
    return f"blocks.{m.group(1)}.{_SPARSIFY_SITES[m.group(2) or '']}"


def _sparsify(folder: Path, where: str) -> SAEFiles:
    cfg_file, weights = _file(folder, CFG), _file(folder, SPARSIFY_WEIGHTS)
    cfg = _json(cfg_file)
    for flag, what in (("transcode", "a transcoder (it predicts a module's output from its input)"),
                       ("skip_connection", "a sparse coder with a skip connection")):
        if cfg.get(flag):
            raise CheckpointError(f"{cfg_file} is {what}, not an SAE: interp reads SAEs")
    d_in = _int(cfg, "d_in", cfg_file)
    d_sae = cfg.get("num_latents") or d_in * _int(cfg, "expansion_factor", cfg_file)
    activation = cfg.get("activation", "topk")
    if activation not in ("topk", "groupmax"):
        raise CheckpointError(f"{cfg_file} says activation {activation!r}; sparsify's are topk and groupmax")
    header = _header(weights)
    shapes = {"W_enc": header.get("encoder.weight", ())[::-1], "b_enc": header.get("encoder.bias"),
              "W_dec": header.get("W_dec"), "b_dec": header.get("b_dec")}
    absent = [theirs for ours, theirs in (("W_enc", "encoder.weight"), ("b_enc", "encoder.bias"), ("W_dec", "W_dec"),
                                          ("b_dec", "b_dec")) if theirs not in header]
    if absent:
        raise CheckpointError(f"{weights} has no {', '.join(absent)}: not a sparsify SAE (it holds {', '.join(sorted(header))})")
    parent = folder.parent / "config.json"
    model = None
    if parent.is_file():
        try:
            model = json.loads(parent.read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            model = None
    fields = {"architecture": "topk", "d_in": d_in, "d_sae": d_sae, "k": _int(cfg, "k", cfg_file),
              "topk_activation": activation, "hook_name": sparsify_hook(folder.name), "apply_b_dec_to_input": True,
              "normalize_activations": "none", "reshape_activations": "none", "model_name": model,
              "metadata": {"sparsify_hookpoint": folder.name, "normalize_decoder": cfg.get("normalize_decoder")}}

    def load() -> dict[str, Tensor]:
        t = mapped_safetensors(weights)
        return {"W_enc": t["encoder.weight"].T, "b_enc": t["encoder.bias"], "W_dec": t["W_dec"], "b_dec": t["b_dec"]}

    fields["dtype"] = str(safetensors_header(weights)[0]["encoder.weight"]["torch_dtype"]).removeprefix("torch.")
    return SAEFiles(fields, shapes, load, str(folder))
