"""Splicing sparse autoencoders into a model, with SAELens's names and meaning (its `HookedSAETransformer`).

`model.add_sae(sae)` puts `sae` at the hook point `sae.cfg.hook_name`: from then on the activation there is
`sae(activation)`, the reconstruction (or, with `use_error_term`, the reconstruction plus the error, which is the
clean activation again until a hook edits a feature). `run_with_saes`, `run_with_cache_with_saes`,
`run_with_hooks_with_saes` and the `saes(...)` context do it for one call or one block and restore what was there
before, even when the forward raises; `reset_saes` removes them; `acts_to_saes` says which are in.

While spliced, the SAE's own hook points are the model's, under SAELens's names: `{hook_name}.hook_sae_input`,
`.hook_sae_acts_pre`, `.hook_sae_acts_post`, `.hook_sae_output`, `.hook_sae_recons`, `.hook_sae_error`, so
`run_with_cache` caches them and `run_with_hooks` edits them.

Where this differs from SAELens, on purpose:
- The hook point stays and keeps its hooks: they see the activation before the SAE (`hook_sae_input` sees the
  same tensor). SAELens replaces the hook point, dropping its hooks.
- A hook name the model lacks is refused (a `KeyError` naming the closest hook points), as is an SAE whose
  width differs from the activation's. SAELens logs "No hook found ... Skipping" and runs the clean model.
- The SAE is not a child module of the model: `model.state_dict()`, `model.to()` and the parameter count stay
  the model's. Move the SAE to the model's device and dtype yourself (SAELens's SAEs are the same).

The hook point runs the SAE after its own hooks (`HookPoint.forward`), so this works the same on native and
wrapped models, and attention stays fused: no pattern is asked for.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from .sae import SAE

SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_output", "hook_sae_recons",
             "hook_sae_error")


def _as_list(saes) -> list:
    if saes is None:
        return []
    return [saes] if not isinstance(saes, (list, tuple)) else list(saes)


class SAEMixin:
    """SAELens's `HookedSAETransformer` methods on any interp model (mixed into `HookedModel`)."""

    @property
    def acts_to_saes(self) -> "dict[str, SAE]":
        """{hook name: the SAE spliced there}, read from the hook points, which hold them (`HookPoint.sae`)."""
        return {name: hp.sae for name, hp in self.hook_dict.items() if hp.sae is not None}

    def add_sae(self, sae, use_error_term: bool | None = None) -> "SAE":
        """Splice `sae` (ours, or SAELens's, read into ours with the same weights) at its hook point, replacing
        any SAE there, until `reset_saes`. `use_error_term`: set the SAE's own for as long as it stays spliced.
        Returns the SAE spliced (ours)."""
        from .formats import as_sae  # formats reads files and SAELens objects; splicing needs it only here

        sae = as_sae(sae)
        name = self._check_name(sae.cfg.hook_name)
        _check_width(self, name, sae)
        if self.hook_dict[name].sae is not None:
            self._unsplice(name)
        if use_error_term is not None:
            sae.__dict__.setdefault("_original_use_error_term", sae.use_error_term)
            sae.use_error_term = use_error_term
        self.hook_dict[name].set_sae(sae)
        self.setup_hooks()
        return sae

    def reset_saes(self, act_names: str | Iterable[str] | None = None, prev_saes: Iterable | None = None) -> None:
        """Remove the SAEs at `act_names` (default: all), putting back `prev_saes` (one per name; None: nothing)
        where given, as SAELens's `reset_saes`."""
        names = list(self.acts_to_saes) if act_names is None else _as_list(act_names)
        prev = list(prev_saes) if prev_saes is not None else [None] * len(names)
        if len(prev) != len(names):
            raise ValueError(f"reset_saes: {len(names)} hook names and {len(prev)} previous SAEs: give one each")
        names = [self._check_name(n) for n in names]
        missing = [n for n in names if self.hook_dict[n].sae is None]
        if missing:
            raise KeyError(f"no SAE is spliced at {missing[0]!r}: the SAEs in are at {sorted(self.acts_to_saes)}")
        self._restore(names, prev)

    def _restore(self, names: list[str], before: list) -> None:
        """Take out the SAEs at `names` (where one is in) and put `before` back (where not None)."""
        for name, sae in zip(names, before):
            if self.hook_dict[name].sae is not None:
                self._unsplice(name)
            if sae is not None:
                self.hook_dict[name].set_sae(sae)
        self.setup_hooks()

    def _unsplice(self, name: str) -> None:
        sae = self.hook_dict[name].sae
        self.hook_dict[name].set_sae(None)
        if "_original_use_error_term" in sae.__dict__:
            sae.use_error_term = sae.__dict__.pop("_original_use_error_term")
        sae.setup_hooks()  # its hook points get their own names back

    @contextlib.contextmanager
    def saes(self, saes=(), reset_saes_end: bool = True, use_error_term: bool | None = None) -> Iterator:
        """Splice `saes` for the duration of a `with` block; on leaving (also on an exception) the SAEs that
        were at those hook points before come back."""
        from .formats import as_sae

        names, before = [], []
        try:
            for sae in _as_list(saes):
                sae = as_sae(sae)
                name = self._check_name(sae.cfg.hook_name)
                if name not in names:  # two SAEs at one name: what was there before the first comes back
                    names.append(name)
                    before.append(self.hook_dict[name].sae)
                self.add_sae(sae, use_error_term=use_error_term)
            yield self
        finally:
            if reset_saes_end:
                self._restore(names, before)

    def run_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True, use_error_term: bool | None = None,
                      **model_kwargs):
        """The model's output with `saes` spliced for this call only."""
        with self.saes(saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True,
                                 use_error_term: bool | None = None, return_cache_object: bool = True,
                                 remove_batch_dim: bool = False, **kwargs):
        """`run_with_cache` with `saes` spliced for this call only: the cache holds their hook points too."""
        with self.saes(saes, reset_saes_end=reset_saes_end, use_error_term=use_error_term):
            return self.run_with_cache(*model_args, return_cache_object=return_cache_object,
                                       remove_batch_dim=remove_batch_dim, **kwargs)

    def run_with_hooks_with_saes(self, *model_args, saes=(), reset_saes_end: bool = True, fwd_hooks=(),
                                 bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False,
                                 **model_kwargs):
        """`run_with_hooks` with `saes` spliced for this call only (hooks may name their hook points)."""
        with self.saes(saes, reset_saes_end=reset_saes_end):
            return self.run_with_hooks(*model_args, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks,
                                       reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts,
                                       **model_kwargs)

    def setup_hooks(self) -> None:
        super().setup_hooks()
        self._index_saes()

    def _index_saes(self) -> None:
        """After `setup_hooks` indexed the model's own hook points: each spliced SAE's hook points under
        `{hook name}.{its name}`, right after the hook point it sits at (so a cache keeps the forward's order)."""
        if not any(hp.sae is not None for hp in self.hook_dict.values()):
            return
        ordered: dict = {}
        for name, hp in dict(self.hook_dict).items():
            ordered[name] = hp
            if hp.sae is None:
                continue
            for local in SAE_HOOKS:
                point = getattr(hp.sae, local)
                point.name = f"{name}.{local}"
                ordered[point.name] = point
                self._names_of[point.name] = [point.name]
        self.hook_dict = type(self.hook_dict)(ordered, self.hook_aliases)


def _check_width(model, name: str, sae) -> None:
    """Refuse an SAE whose input width is not the activation's, where the config says the width."""
    width = activation_width(model.cfg, name)
    if width is not None and width != sae.cfg.d_in:
        raise ValueError(f"the SAE for {name} reads d_in={sae.cfg.d_in}, but that activation has width {width} "
                         f"in this model: it was trained on another model or hook point")


def activation_width(cfg, name: str) -> int | None:
    """The width an SAE at hook point `name` reads (a hook_z one: the heads flattened); None where unknown."""
    last = name.rsplit(".", 1)[-1]
    if last in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                "hook_embed", "hook_normalized"):
        return cfg.d_model
    if last == "hook_z":
        return cfg.n_heads * cfg.d_head
    if last in ("hook_pre", "hook_post") and ".mlp." in name and getattr(cfg, "d_mlp", None):
        return cfg.d_mlp
    return None

