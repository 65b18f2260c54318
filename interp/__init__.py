"""interp: mechanistic interpretability for PyTorch transformers.

Attention runs fused (SDPA / FlashAttention) by default and switches, per layer and on demand, to an
instrumented path that exposes scores and patterns to hooks.

The names below are imported on first use (PEP 562), so `import interp` (and the `interp` command's
`--help`) does not pay for torch until a model is touched.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ActivationCache": "interp.models.cache",
    "KVCache": "interp.models.kv.cache",
    "FactoredMatrix": "interp.models.factored",
    "HookPoint": "interp.models.hooks",
    "act_name": "interp.models.hooks",
    "HookedTransformer": "interp.models",
    "ModelConfig": "interp.models",
    "RopeScaling": "interp.models",
    "CheckpointError": "interp.loading",
    "UserError": "interp.errors",  # every bad-input error (a bad name, file or setting) is one
    "from_hf": "interp.loading",
    "load": "interp.loading",
    "save_model": "interp.loading",
    "from_transformer_lens": "interp.interop",  # imports transformer_lens only when called
}

__all__ = sorted(_LAZY)

# Modules that moved into rooms by concept (issue 37): the old import paths keep working for one release,
# with a DeprecationWarning naming the new one. The old name is the new module (one object, not a copy).
_MOVED = {
    "interp.models.kv_cache": "interp.models.kv.cache",
    "interp.models.kv_cache_policy": "interp.models.kv.policy_cache",
    "interp.models.kv_policy": "interp.models.kv.policies",
    "interp.models.kv_cache_quant": "interp.models.kv.quant",
    "interp.models.format_ours": "interp.models.formats.ours",
    "interp.models.format_hf": "interp.models.formats.hf",
    "interp.models.gguf": "interp.models.formats.gguf",
    "interp.models.gguf_file": "interp.models.formats.gguf_file",
    "interp.models.build": "interp.models.formats.build",
    "interp.models.checkpoint": "interp.models.formats.checkpoint",
    "interp.models.folder": "interp.models.formats.folder",
    "interp.models.tokenizer": "interp.models.formats.tokenizer",
    "interp.models.names": "interp.models.runs.names",
    "interp.models.hook_aliases": "interp.models.hooks.aliases",
    "interp.models.evaldata": "interp.analyses.evaldata",  # issue 44: what only analyses read leaves models/
    "interp.analyses.kv_study": "interp.analyses.kv.precision_study",
    "interp.analyses.kv_policies": "interp.analyses.kv.policies",
    "interp.analyses.kv_roles_study": "interp.analyses.kv.roles_study",
    "interp.analyses.head_roles": "interp.analyses.kv.roles",
    "interp.analyses.gates": "interp.analyses.kv.gates",
    "interp.analyses.tasks": "interp.analyses.kv.tasks",
    # issue 54: models/ holds the model; the errors are the lowest layer's, training and its probes the zoo's
    "interp.models.errors": "interp.errors",
    "interp.models.training": "interp.models.zoo.training",
    "interp.models.probes": "interp.models.zoo.probes",
    "interp.models.rope_choice": "interp.models.rope.choice",
    "interp.models.rope_heads": "interp.models.rope.heads",
    # issue 54: analyses/ in rooms, one per study (a moved package's modules follow it: `_moved`)
    "interp.analyses.sweep": "interp.analyses.atlas.sweep",
    "interp.analyses.executors": "interp.analyses.atlas.executors",
    "interp.analyses.report": "interp.analyses.atlas.report",
    "interp.analyses.atlas_pass": "interp.analyses.atlas.atlas_pass",
    "interp.analyses.registry": "interp.analyses.atlas.registry",
    "interp.analyses.sweep_data": "interp.analyses.data",
    "interp.analyses.circuit": "interp.analyses.circuits",
    "interp.analyses.circuit_tasks": "interp.analyses.circuits.tasks",
    "interp.analyses.circuit_study": "interp.analyses.circuits.study",
    "interp.analyses.extrapolate": "interp.analyses.extrapolation.extrapolate",
    "interp.analyses.extrapolate_study": "interp.analyses.extrapolation.study",
    "interp.analyses.lengths": "interp.analyses.extrapolation.lengths",
    # issue 54: the streaming statistics are one package, kernels/src/stats/ (interp.kernels.stats, the entry point,
    # keeps its name: the package's __init__)
    "interp.kernels.stats_common": "interp.kernels.stats.common",
    "interp.kernels.stats_fused": "interp.kernels.stats.fused",
    "interp.kernels.stats_triton": "interp.kernels.stats.triton_kernel",
    "interp.kernels.stats_reference": "interp.kernels.stats.reference",
}


def _moved(fullname: str) -> str | None:
    """The new path of an old module path: listed in `_MOVED`, or a module of a moved package
    (`interp.analyses.registry.base` -> `interp.analyses.atlas.registry.base`)."""
    head, _, rest = fullname, "", ""
    while head:
        if head in _MOVED:
            return _MOVED[head] + (f".{rest}" if rest else "")
        head, _, tail = head.rpartition(".")
        rest = f"{tail}.{rest}" if rest else tail
    return None


class _MovedFinder:
    """Finds an old module path (`_moved`). It stands first: a moved package's old name is the new package,
    whose `__path__` would otherwise let the path finder load its modules a second time under old names.
    No real module has an old path (its file moved), so it shadows nothing."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if not fullname.startswith("interp.") or (new := _moved(fullname)) is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _MovedLoader(), origin=new)


class _MovedLoader:
    @staticmethod
    def create_module(spec):
        return None  # a placeholder; exec_module puts the real module in its place

    @staticmethod
    def exec_module(module):
        import sys
        import warnings

        new = module.__spec__.origin
        warnings.warn(f"{module.__name__} moved to {new}; import it from there (the old path goes in the next "
                      "release)", DeprecationWarning, stacklevel=4)
        sys.modules[module.__name__] = importlib.import_module(new)  # what the import returns: one object


def _install_moved_finder() -> None:
    import sys

    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


_install_moved_finder()


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'interp' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
