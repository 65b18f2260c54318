"""Hook points: an identity module at every activation, named from the module tree.

A hook is `fn(tensor, hook) -> tensor | None` (TransformerLens's signature): return a tensor to
replace the activation, or None to leave it. Backward hooks get the gradient of the activation.

Hooks are global state, so every way of adding one has a way of scoping it: `model.hooks(...)`
and `run_with_hooks` remove exactly what they added, even when the forward raises; a handle from
`add_hook` removes its hook (and is a context manager).
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from typing import Callable, Iterable, Iterator, Literal, Sequence, Union

import torch
from torch import Tensor, nn

from .aliases import act_name, canonical, hook_aliases

HookFn = Callable[..., Union[Tensor, None]]
Direction = Literal["fwd", "bwd"]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


class HookHandle:
    """Removes one hook. Usable as a context manager."""

    def __init__(self, hook_list: list, entry) -> None:
        self._list, self._entry = hook_list, entry

    def remove(self) -> None:
        if self._entry in self._list:
            self._list.remove(self._entry)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class HookPoint(nn.Module):
    """Identity on the forward pass, unless hooks are attached. `name` is set by the root model."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None
        self._fwd: list[HookFn] = []
        self._bwd: list[HookFn] = []
        self.ctx: dict = {}  # scratch space hooks may share across calls (TransformerLens's hook.ctx)
        # A sparse autoencoder spliced here (`model.add_sae`, models/src/saes/splice.py), run after the hooks. Kept
        # out of the module tree, so the model's state_dict, .to() and parameters stay the model's.
        self.__dict__["sae"] = None

    def set_sae(self, sae: "nn.Module | None") -> None:
        """Splice `sae` here (None: take it out); `model.add_sae` is the way in (it indexes the SAE's hooks)."""
        self.__dict__["sae"] = sae

    def layer(self) -> int:
        """The block this hook point is in (`blocks.3.attn.hook_pattern` -> 3), as TransformerLens's."""
        parts = (self.name or "").split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(f"hook point {self.name!r} is not inside a block, so it has no layer")
        return int(parts[1])

    def clear_context(self) -> None:
        self.ctx.clear()

    @property
    def active(self) -> bool:
        """True when any hook is attached or an SAE is spliced here (the model then calls this hook point; a
        hook on the scores or pattern also switches its layer's attention to the instrumented path)."""
        return bool(self._fwd or self._bwd) or self.sae is not None

    def add_hook(self, fn: HookFn, dir: Direction = "fwd", prepend: bool = False, is_permanent: bool = False) -> HookHandle:
        """Attach `fn(tensor, hook)`; `is_permanent` hooks survive `reset_hooks()` (as in
        TransformerLens) and go only with `including_permanent=True` or their handle."""
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"hook direction must be 'fwd' or 'bwd', got {dir!r}")
        if not callable(fn):
            raise TypeError(f"a hook must be callable as fn(tensor, hook), got {type(fn).__name__}")
        hooks = self._fwd if dir == "fwd" else self._bwd
        entry = _Entry(fn, is_permanent)
        hooks.insert(0, entry) if prepend else hooks.append(entry)
        return HookHandle(hooks, entry)

    def remove_hooks(self, dir: Literal["fwd", "bwd", "both"] = "both", including_permanent: bool = True) -> None:
        for which, hooks in (("fwd", self._fwd), ("bwd", self._bwd)):
            if dir in (which, "both"):
                hooks[:] = [] if including_permanent else [e for e in hooks if e.permanent]

    def forward(self, x: Tensor) -> Tensor:
        for entry in list(self._fwd):
            out = entry.fn(x, hook=self)
            if out is not None:
                if not isinstance(out, Tensor):
                    raise TypeError(f"forward hook on {self.name} returned {type(out).__name__}; return a tensor or None")
                if out.shape != x.shape:
                    raise ValueError(f"forward hook on {self.name} changed the shape {tuple(x.shape)} -> {tuple(out.shape)}")
                x = out
        if self._bwd and torch.is_grad_enabled() and x.is_floating_point():  # not integer ones (expert indices)
            if not x.requires_grad:
                # Frozen weights (model.requires_grad_(False), attribution) or a buffer (sinusoidal
                # positions): make the activation a leaf that needs a gradient, so the hook still
                # receives d(output)/d(activation) instead of silently never firing.
                x = x.detach().requires_grad_(True)
            for entry in list(self._bwd):
                x.register_hook(_BackwardCall(entry.fn, self))
        if self.sae is not None:
            x = self.sae(x)
        return x

    def extra_repr(self) -> str:
        return f"name={self.name!r}, fwd={len(self._fwd)}, bwd={len(self._bwd)}"


class _Entry:
    """A list entry compared by identity, so the same function can be added twice and removed once."""

    __slots__ = ("fn", "permanent")

    def __init__(self, fn: HookFn, permanent: bool = False) -> None:
        self.fn, self.permanent = fn, permanent


class _BackwardCall:
    def __init__(self, fn: HookFn, hook: HookPoint) -> None:
        self.fn, self.hook = fn, hook

    def __call__(self, grad: Tensor):
        return self.fn(grad, hook=self.hook)


class HookedRootModule(nn.Module):
    """Mixin for a model built of HookPoints: names them, adds, scopes and removes hooks."""

    hook_dict: dict[str, HookPoint]

    def setup_hooks(self) -> None:
        """Name every hook point and index them: `hook_dict` (our names; it also answers the bridge's
        names for them, without listing those) and `hook_aliases` ({the bridge's name: ours}, from
        `models/src/hooks/aliases.py`). A hook point added after construction (by a `set_use_*` switch)
        takes the training mode of the module it sits in, so an eval model stays entirely in eval
        mode (TransformerLens's tools check every module)."""
        own: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                own[name] = module
            for child in module.children():
                if isinstance(child, HookPoint):
                    child.training = module.training
        self.mod_dict = dict(self.named_modules())
        self.hook_aliases = hook_aliases(own)
        self._names_of: dict[str, list[str]] = {n: [n] for n in own}  # our name -> it and its aliases
        for alias, target in self.hook_aliases.items():
            self._names_of[target].append(alias)
        self.hook_dict = _HookDict(own, self.hook_aliases)

    def hook_points(self) -> list[HookPoint]:
        return list(self.hook_dict.values())

    def resolve_hook_names(self, names: NamesFilter) -> list[str]:
        """Our names of the hook points `names` selects (None = all; a name, ours or the bridge's; a
        list of names; a predicate, which selects a hook point when it accepts any of its names).
        Each hook point appears once, so a hook is never attached twice.

        A name that is not a hook point raises a KeyError naming the closest hook points."""
        if names is None:
            return list(self.hook_dict)
        if callable(names) and not isinstance(names, str):
            return [n for n, every in self._names_of.items() if any(names(a) for a in every)]
        if isinstance(names, str):
            names = [names]
        return list(dict.fromkeys(self._check_name(n) for n in names))

    # Hook points that exist only once a `set_use_*` switch adds them, as in TransformerLens.
    _OPTIONAL_HOOKS = {"hook_q_input": "set_use_split_qkv_input", "hook_k_input": "set_use_split_qkv_input",
                       "hook_v_input": "set_use_split_qkv_input", "hook_attn_in": "set_use_attn_in",
                       "hook_mlp_in": "set_use_hook_mlp_in"}

    def _check_name(self, name: str) -> str:
        """Our name for the hook point `name` names (our name or the bridge's); when it names none, a
        KeyError that says what to do."""
        own = canonical(name, self.hook_aliases)
        if own not in self.hook_dict:
            switch = self._OPTIONAL_HOOKS.get(name.rsplit(".", 1)[-1])
            if switch is not None:
                raise KeyError(f"{name!r} exists only after model.{switch}(True) (TransformerLens's optional hook "
                               "point; it is off by default so attention stays fused)")
            close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(
                f"{name!r} is not a hook point of this model.{hint} "
                f"List them with `list(model.hook_dict)` ({len(self.hook_dict)} hook points)."
            )
        return own

    def add_hook(
        self, name: str | Callable[[str], bool], fn: HookFn, dir: Direction = "fwd", is_permanent: bool = False,
        prepend: bool = False,
    ) -> HookHandle | "_MultiHandle":
        """Attach `fn` to the hook point `name` (or to every hook point the predicate accepts).
        `is_permanent=True`: the hook survives `reset_hooks()` (TransformerLens's permanent hooks)."""
        if callable(name) and not isinstance(name, str):
            return _MultiHandle([self.hook_dict[n].add_hook(fn, dir, prepend, is_permanent) for n in self.resolve_hook_names(name)])
        return self.hook_dict[self._check_name(name)].add_hook(fn, dir, prepend, is_permanent)

    def add_perma_hook(self, name: str | Callable[[str], bool], fn: HookFn, dir: Direction = "fwd"):
        """A hook that stays until `reset_hooks(including_permanent=True)` (TransformerLens's name)."""
        return self.add_hook(name, fn, dir, is_permanent=True)

    def reset_hooks(self, clear_contexts: bool = True, direction: Literal["fwd", "bwd", "both"] = "both",
                    including_permanent: bool = False) -> None:
        """Remove every hook except permanent ones (with `including_permanent=True`, those too), as
        TransformerLens's `reset_hooks`. `clear_contexts` is accepted for its signature."""
        if direction not in ("fwd", "bwd", "both"):
            raise ValueError(f"direction must be 'fwd', 'bwd' or 'both', got {direction!r}")
        for hp in self.hook_dict.values():
            hp.remove_hooks(direction, including_permanent)
            if clear_contexts:
                hp.clear_context()

    @contextlib.contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[str | Callable, HookFn]] = (),
        bwd_hooks: Iterable[tuple[str | Callable, HookFn]] = (),
        reset_hooks_end: bool = True,
    ) -> Iterator["HookedRootModule"]:
        """Attach hooks for the duration of a `with` block; they are removed even if it raises.

        Only the hooks added here are removed (hooks added elsewhere stay)."""
        handles = []
        try:
            for name, fn in fwd_hooks:
                handles.append(self.add_hook(name, fn, "fwd"))
            for name, fn in bwd_hooks:
                handles.append(self.add_hook(name, fn, "bwd"))
            yield self
        finally:
            if reset_hooks_end:
                for h in handles:
                    h.remove()

    def run_with_hooks(
        self,
        *model_args,
        fwd_hooks: Iterable[tuple[str | Callable, HookFn]] = (),
        bwd_hooks: Iterable[tuple[str | Callable, HookFn]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **model_kwargs,
    ):
        """Run the model with hooks attached for this call only (`clear_contexts`: empty every
        hook point's `ctx` afterwards, as TransformerLens)."""
        bwd_hooks = list(bwd_hooks)
        if bwd_hooks and reset_hooks_end:
            warnings.warn(
                "backward hooks are removed when run_with_hooks returns, before you can call backward(); "
                "pass reset_hooks_end=False (and call model.reset_hooks() after) or use `with model.hooks(...)`",
                stacklevel=2,
            )
        try:
            with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end):
                return self(*model_args, **model_kwargs)
        finally:
            if clear_contexts:
                for hp in self.hook_dict.values():
                    hp.clear_context()


class _HookDict(dict):
    """{our name: hook point} that also answers the bridge's names (`hook_dict["blocks.0.hook_in"]`,
    `in`, `.get`) without listing them: iterating it gives each hook point once."""

    def __init__(self, own: dict, aliases: dict[str, str]) -> None:
        super().__init__(own)
        self.aliases = aliases

    def __missing__(self, name: str) -> HookPoint:
        if name not in self.aliases:
            raise KeyError(name)
        return self[self.aliases[name]]

    def __contains__(self, name) -> bool:
        return super().__contains__(name) or name in self.aliases

    def get(self, name, default=None):
        return self[name] if name in self else default


class _MultiHandle:
    def __init__(self, handles: list[HookHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def caching_hook(store: dict, name_key: str | None = None, detach: bool = True, device=None) -> HookFn:
    """A hook that stores the activation in `store` under its hook's name (or `name_key`)."""

    def hook(x: Tensor, hook: HookPoint) -> None:
        t = x.detach() if detach else x
        store[name_key or hook.name] = t.to(device) if device is not None else t

    return hook


__all__ = ["HookPoint", "HookHandle", "HookedRootModule", "HookFn", "act_name", "caching_hook"]
