"""Where an SAE comes from: `load_sae(name)` for a local folder, a zoo SAE or a folder of a Hugging Face repo
(through huggingface_hub's cache, as `interp.load` reads a model: `hub.hub_download`), and `as_sae(obj)`
for an SAE object SAELens made. The files themselves are read by `files.py` and built by `sae.build`.

    load_sae("path/to/folder")                                          a SAELens, Gemma Scope or sparsify folder
    load_sae("attn-only-2l/blocks.1.attn.hook_z")                       a zoo SAE (models/src/zoo/saes/)
    load_sae("smollm2-135m/blocks.18.attn.hook_z")                      one trained here, too large to ship
                                                                        ($INTERP_CACHE/saes/, default ~/.cache/interp)
    load_sae("google/gemma-scope-2b-pt-res/layer_20/width_16k/average_l0_71")   owner/repo, then the folder in it
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from interp.errors import BadValue
from ..placement.device import resolve_device
from ..placement.tensor_files import inside
from ..hub import ModelNotFound, hub_download
from .files import CFG, GEMMA_SCOPE, GEMMA_SCOPE_2, SAE_LENS_WEIGHTS, SPARSIFY_WEIGHTS, SAEFiles, sae_lens_fields
from .sae import SAE, build, dtype_name, load_from_disk

# The zoo's SAEs, <model run>/<hook name>/: SAELens folders, with the eval.json of the trainer that made them
# (models/src/zoo/saes/train.py). A folder of data found by its path: the zoo package is no import of this
# one (its training builds models, above SAEs).
ZOO_SAES = Path(__file__).resolve().parents[1] / "zoo" / "saes"
# The zoo's trainer, which writes an SAE over 5 MB to the cache folder instead (run it in SAELens's venv).
TRAIN_SAE = "models/src/zoo/saes/train.py"
_FILES = (CFG, SAE_LENS_WEIGHTS, SPARSIFY_WEIGHTS, GEMMA_SCOPE, GEMMA_SCOPE_2, "config.json")


def load_sae(path_or_name, *, revision: str | None = None, hook_name: str | None = None,
             device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> SAE:
    """The SAE a path or name gives (see the module), on `device`, in `dtype` (None: the file's).

    `hook_name`: interp's hook name where it splices in, for files that do not say (Gemma Scope outside its
    repos, a sparsify module interp cannot name) or to put it elsewhere. `revision`: a Hub branch, tag or
    commit. Offline (HF_HUB_OFFLINE=1) only what huggingface_hub's cache holds is read; nothing is written."""
    dev = resolve_device(device)
    folder, where = resolve_sae(path_or_name, revision=revision)
    return load_from_disk(folder, device=dev, dtype=dtype, hook_name=hook_name, where=where)


def resolve_sae(path_or_name, *, revision: str | None = None) -> tuple[Path, str]:
    """(the local folder, the name it was asked by) of an SAE path or name, reading no weight."""
    if not isinstance(path_or_name, (str, Path)):
        raise BadValue(f"load_sae takes a path or a name, got {type(path_or_name).__name__}; "
                       "for an SAE object use interp.models.saes.as_sae")
    text = str(path_or_name)
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise BadValue(f"revision={revision!r} applies to Hugging Face repos, not to the local path {path}")
        return (path.parent if path.is_file() else path), text
    if revision is None and not text.startswith((".", "/", "~")):
        for root, what in ((ZOO_SAES, "the zoo's SAEs"), (sae_cache(), "interp's SAE cache")):
            if (root / text).is_dir():
                return _inside(root, text, what), text
    parts = text.strip("/").split("/")
    if revision is None and len(parts) == 2 and "hook_" in parts[1]:  # <model>/<hook name>: one trained here
        raise ModelNotFound(f"no SAE {text!r} in the zoo nor in {sae_cache()}; train it (SAELens's venv, see "
                            f"docs/saes.md): python {TRAIN_SAE} {parts[0]} {parts[1]}")
    if len(parts) < 2 or not all(parts) or text.startswith((".", "/", "~")) or ".." in parts:
        raise ModelNotFound(f"no SAE at {text!r}: it is no local folder, no zoo SAE ({', '.join(zoo_saes()) or 'none'}) "
                            "and no Hugging Face name (owner/repo/folder...)")
    repo_id, sub = "/".join(parts[:2]), "/".join(parts[2:])
    prefix = f"{sub}/" if sub else ""
    try:
        snapshot = hub_download(repo_id, revision, [prefix + f for f in _FILES], include=f"{prefix}*")
    except ModelNotFound as e:
        raise ModelNotFound(f"no local folder {text}, no zoo SAE of that name, and the Hub: {e}") from None
    folder = _inside(snapshot, sub, f"{repo_id}'s snapshot") if sub else snapshot
    if not folder.is_dir():
        raise ModelNotFound(f"{repo_id} has no folder {sub!r} in the Hugging Face cache ({snapshot}); fetch it: "
                            f"hf download {repo_id} --include '{prefix}*'")
    return folder, f"{repo_id}/{sub}" if sub else repo_id


def _inside(root: Path, sub: str, what: str) -> Path:
    """root / sub, refused unless it lies inside root (no .., no folder on the way, the last included, that
    links out of it): a snapshot or the zoo never makes interp read another folder's files."""
    inside(root, f"{sub.strip('/')}/{CFG}", what)  # checks the folder `sub` itself, not only its parent
    return root / sub.strip("/")


def sae_cache() -> Path:
    """Where the zoo's trainer writes SAEs too large to ship: $INTERP_CACHE/saes (default ~/.cache/interp/saes)."""
    return Path(os.environ.get("INTERP_CACHE") or Path.home() / ".cache" / "interp") / "saes"


def zoo_saes() -> list[str]:
    """The zoo's SAEs by name (`<run>/<hook name>`)."""
    if not ZOO_SAES.is_dir():
        return []
    return sorted(f"{run.name}/{hook.name}" for run in ZOO_SAES.iterdir() if run.is_dir()
                  for hook in run.iterdir() if (hook / CFG).is_file())


def as_sae(obj) -> SAE:
    """`obj` as interp's SAE: an interp SAE as it is; a SAELens SAE (any version, found by its `W_enc`,
    `W_dec` and `cfg`: no import of sae_lens) converted with the same numbers, device and dtype, its
    `use_error_term` kept."""
    if isinstance(obj, SAE):
        return obj
    cfg = getattr(obj, "cfg", None)
    if cfg is None or not hasattr(obj, "W_enc") or not hasattr(obj, "W_dec") or not hasattr(obj, "state_dict"):
        raise BadValue(f"as_sae takes an interp SAE or a SAELens SAE (with W_enc, W_dec and cfg); got {type(obj).__name__}")
    raw = cfg.to_dict() if callable(getattr(cfg, "to_dict", None)) else dict(vars(cfg))
    arch = getattr(cfg, "architecture", raw.get("architecture", "standard"))
    raw["architecture"] = arch() if callable(arch) else arch
    meta = raw.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raw["metadata"] = meta.to_dict() if callable(getattr(meta, "to_dict", None)) else dict(vars(meta))
    source = f"a SAELens {type(obj).__name__}"
    fields = sae_lens_fields(raw, source)
    state = {k: v.detach().clone() for k, v in obj.state_dict().items()}  # ours, not a view of theirs
    weights = obj.W_dec
    sae = build(SAEFiles(fields, {k: tuple(v.shape) for k, v in state.items()}, lambda: state, source),
                device=weights.device, dtype=dtype_name(weights.dtype))
    sae.use_error_term = bool(getattr(obj, "use_error_term", False))
    d_head = getattr(obj, "d_head", None)
    if sae.cfg.hook_z and isinstance(d_head, int) and sae.cfg.d_in % d_head == 0:
        sae.d_head = d_head
    return sae


__all__ = ["ZOO_SAES", "as_sae", "load_sae", "resolve_sae", "sae_cache", "zoo_saes"]

