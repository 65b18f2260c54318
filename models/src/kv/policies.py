"""KV-cache policies: what one KV head keeps of the context. One class per policy, and each class's
docstring is its description (the paper, what it keeps, the shapes it reads), as kvpress's presses do;
`policy_table()` lists them from the registry (the README's list is its output, checked by a test).

A policy is one class: its names and arguments (`names`, `from_args`), what it needs (`reads_queries`),
where its entries live (`layout`: every token in slot order, "dense" or "kivi", or a chosen "subset"),
how it chooses (a subset policy's `priority(view)`: a score per entry, kept by the shared top-k step
`keep_top`), and its byte theory (`theory_bytes`). Defining a subclass registers its names: a policy
written outside the package (a test file) parses, runs in `PolicyKVCache`, `absorb`, the studies and the
benchmark with no other file touched:

    @dataclass(frozen=True)
    class Oldest(SubsetPolicy):          # keep the B oldest tokens
        size: int = 64
        names: ClassVar[tuple[str, ...]] = ("oldest",)

        def priority(self, view):
            return -view.slots.float()      # earlier slots first; padding is dropped by the shared step

Names parse with `parse_policy("streaming(4,128)")` (or "streaming:4:128"); a map gives each
(layer, KV head) its own: `resolve_policies({3: "streaming(4,128)", (5, 1): "kivi4"}, ...)`.
Windows follow the model's convention (Hugging Face's): a query sees itself and the W - 1 tokens
before it, so a streaming head holds S + W entries.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from interp.kernels.kv_quant import bytes_per_vector

from interp.errors import BadValue

from .candidates import Candidates, Selection, keep_top
from .protect import Protect, protect_boundaries

_REGISTRY: dict[str, type["Policy"]] = {}


@dataclass(frozen=True)
class Policy:
    """One KV head's cache policy (frozen: a policy is a value, equal policies share storage).

    Class attributes a policy declares:
      names           the names it parses from ("streaming"; "kivi4", "kivi2"; every precision)
      form            how to write it, for help and errors ("streaming(S,W)")
      layout          "dense" / "kivi": every token in slot order (the model's own mask applies);
                      "subset": held entries with their slots (`PolicyKVCache`)
      holds_all       keeps every token (its codes may be lossy)
      reads_queries   chooses by the queries' attention: a prefill it absorbs must keep the queries
      shares_prefill  its prefill computes what the full model's does, so one full prefill serves it
    """

    names: ClassVar[tuple[str, ...]] = ()
    form: ClassVar[str] = ""
    layout: ClassVar[str] = "subset"
    holds_all: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = False
    shares_prefill: ClassVar[bool] = True
    arity: ClassVar[tuple[int, int]] = (0, 0)  # how many whole-number arguments its name takes

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("names", ()):
            other = _REGISTRY.get(name)
            if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"KV-cache policy name {name!r} is taken by {other.__module__}.{other.__qualname__}")
            _REGISTRY[name] = cls

    @classmethod
    def from_args(cls, name: str, args: list[int]) -> "Policy":
        """The policy `name(args...)` (arguments already counted against `arity`)."""
        return cls(*args)

    @property
    def base_name(self) -> str:
        """The canonical spelling of the policy itself, without its settings after '+' (`protect`)."""
        args = [getattr(self, f.name) for f in dataclasses.fields(self) if not f.kw_only]
        return f"{self.names[0]}({','.join(map(str, args))})" if args else self.names[0]

    @property
    def name(self) -> str:
        """The canonical spelling (parses back to an equal policy): `base_name`, then any '+' settings."""
        return self.base_name

    @property
    def budget(self) -> int | None:
        """Tokens held per head, None when unbounded."""
        return None

    def check(self, max_len: int, d_head: int) -> None:
        """Raise BadValue when this policy cannot run in a cache of `max_len` tokens."""

    def theory_bytes(self, *, d_head: int, length: int, dtype_bytes: int) -> float:
        """Bytes one KV head should hold per token of a `length`-token sequence (keys and values), from the
        definition: what the benchmark prints beside the measured `bytes_per_token`."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


# ---- every token -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dense(Policy):
    """Every token, stored in `precision`: "full" (the model's own dtype: the unmodified model), fp32, fp16,
    bf16, or int8 / fp8 / int4 codes with one float32 scale per vector (`interp.kernels.kv_quant`).

    Reads nothing: it chooses no token. Written by its precision: `full`, `int8`, ..."""

    precision: str = "full"
    names: ClassVar[tuple[str, ...]] = ("full", "fp32", "fp16", "bf16", "int8", "fp8", "int4")
    layout: ClassVar[str] = "dense"
    holds_all: ClassVar[bool] = True

    @classmethod
    def from_args(cls, name, args):
        return cls(name)

    @property
    def base_name(self) -> str:
        return self.precision

    @property
    def shares_prefill(self) -> bool:  # a per-vector quantized cache's prefill reads its own codes
        return self.precision in ("full", "fp32")

    def check(self, max_len: int, d_head: int) -> None:
        if self.precision == "int4" and d_head % 2:
            raise BadValue(f"int4 packs two codes per byte and needs an even d_head; this model's is {d_head}")

    def theory_bytes(self, *, d_head, length, dtype_bytes):
        name = self.precision if self.precision != "full" else {4: "fp32", 2: "fp16"}[dtype_bytes]
        return 2 * bytes_per_vector(name, d_head)


@dataclass(frozen=True)
class Kivi(Policy):
    """KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): every token;
    keys quantized per channel over groups of `group` tokens, values per token over groups of `group`
    channels, to `bits` bits; the latest tokens stay in full precision until `residual` of them fill a flush.

    Reads the keys and values as they arrive, [b, g, n, d]. Written kivi4, kivi2, kivi4(G,R) (G = R = 32)."""

    bits: int = 4
    group: int = 32
    residual: int = 32
    names: ClassVar[tuple[str, ...]] = ("kivi4", "kivi2")
    form: ClassVar[str] = "kivi4 or kivi4(group,residual)"
    layout: ClassVar[str] = "kivi"
    holds_all: ClassVar[bool] = True
    arity: ClassVar[tuple[int, int]] = (0, 2)

    @classmethod
    def from_args(cls, name, args):
        return cls(int(name[-1]), *args)

    @property
    def base_name(self) -> str:
        return f"kivi{self.bits}" if (self.group, self.residual) == (32, 32) else \
            f"kivi{self.bits}({self.group},{self.residual})"

    def check(self, max_len: int, d_head: int) -> None:
        if self.group < 1 or d_head % self.group:
            raise BadValue(f"{self.name}: the group size {self.group} must divide d_head ({d_head}): KIVI groups "
                           f"values over channels; e.g. kivi{self.bits}({_divisor(d_head)},{_divisor(d_head)})")
        if self.residual < self.group or self.residual % self.group:
            raise BadValue(f"{self.name}: the residual ({self.residual} full-precision tokens) must be a multiple "
                           f"of the group size ({self.group}), since keys are quantized a whole group at a time")

    def theory_bytes(self, *, d_head, length, dtype_bytes):
        nq = length // self.residual * self.residual
        per_q = 2 * d_head * self.bits / 8 + 2 * 2 * d_head / self.group + 2 * 2 * d_head / self.group
        return (nq * per_q + (length - nq) * 2 * d_head * dtype_bytes) / length


def _divisor(d: int) -> int:
    return max(g for g in (8, 16, 32, 64) if d % g == 0) if d % 8 == 0 else 1


# ---- a subset of the tokens: what a policy chooses among (candidates.py), its boundaries (protect.py) ----
_INF = float("inf")


@dataclass(frozen=True)
class SubsetPolicy(Policy):
    """A policy that holds a chosen subset of the tokens. Subclasses give `priority(view)` (higher is kept,
    +inf always, -inf never; padding is never kept), the field `size` (entries per head) or `budget`, and their
    names; `evict` applies the shared step. Override `evict` to keep everything on some calls (return None) or
    to choose without scores, and `visibility` to narrow what a query sees (StreamingLLM's window).

    Every subset policy takes `protect` (`Protect`, keyword only; `+protect(4,9)` / `+protect(10%)` in its
    name): the first and last tokens it names are kept above everything else, +inf included, inside the same
    budget. A policy that keeps only its boundaries already refuses it (`protectable` False, StreamingLLM)."""

    protect: Protect | None = field(default=None, kw_only=True)
    protectable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if type(self).priority is SubsetPolicy.priority and type(self).evict is SubsetPolicy.evict:
            raise TypeError(f"{type(self).__name__} must define priority(view) (or evict(view))")
        if self.protect is not None:
            self._check_protect()

    def _check_protect(self) -> None:
        if not isinstance(self.protect, Protect):
            raise BadValue(f"{self.base_name}: protect is a Protect (e.g. Protect(4, 9) or Protect(fraction=0.1)), "
                           f"got {self.protect!r}")
        if not self.protectable:
            raise BadValue(f"{self.base_name} keeps only its first and last tokens already (it evicts nothing but "
                           "the middle), so protect adds nothing: widen its sinks or window instead")
        first, last = self.protect.counts(self.budget)
        if first + last > self.budget:
            raise BadValue(f"{self.name}: protects {first} + {last} = {first + last} tokens, more than its budget of "
                           f"{self.budget} (protected tokens count inside it): protect fewer, e.g. protect(10%), or "
                           "raise the budget")

    @property
    def name(self) -> str:
        return self.base_name if self.protect is None else f"{self.base_name}+{self.protect.spelled}"

    @property
    def protected(self) -> tuple[int, int]:
        """(first, last): the tokens at each end never evicted, (0, 0) without `protect`."""
        return (0, 0) if self.protect is None else self.protect.counts(self.budget)

    @property
    def budget(self) -> int:
        return self.size  # a subset policy's fields name its size `size` unless it overrides `budget`

    entry_names: ClassVar[tuple[str, ...]] = ()  # per-entry float32 values it keeps (bytes: 4 each)

    def priority(self, view: Candidates) -> Tensor | None:
        """float [b, g, m]: how much each entry is worth keeping; None: keep every entry this call."""
        raise NotImplementedError

    def evict(self, view: Candidates) -> Selection | None:
        prio = self.priority(view)
        if prio is None:
            return None
        prio = torch.where(view.valid, prio.float(), -_INF)
        if self.protect is not None:
            prio = protect_boundaries(prio, view, *self.protected)
        return keep_top(prio, self.budget)

    def visibility(self, rel: Tensor, slots: Tensor, window: int | None, own_window: int | None):
        """(window, sink mask or None) for `kernels.visibility.visible`: what a query sees of the held entries.
        `rel` [b, g, n, m] is p - j; `window` the layer's (narrowed) window, `own_window` the layer's own."""
        return window, None

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "budget", self.budget, 1, max_len)

    def theory_bytes(self, *, d_head, length, dtype_bytes):
        per_entry = 2 * d_head * dtype_bytes + 4 + 4 * len(self.entry_names)  # keys, values, slot, extras
        return min(self.budget, length) * per_entry / length


@dataclass(frozen=True)
class Streaming(SubsetPolicy):
    """StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): the first
    `sinks` tokens and the last `window`, a rolling buffer of sinks + window entries per head; a query sees
    its sinks and its window, in the prefill too (Hugging Face's window convention: itself and the W - 1
    tokens before it).

    Reads the entries' slots [b, g, m] only. Written streaming(S,W)."""

    sinks: int = 4
    window: int = 128
    names: ClassVar[tuple[str, ...]] = ("streaming",)
    protectable: ClassVar[bool] = False  # it keeps only its boundaries already: protect is refused
    form: ClassVar[str] = "streaming(sinks,window)"
    shares_prefill: ClassVar[bool] = False  # its prefill attends through the window
    arity: ClassVar[tuple[int, int]] = (2, 2)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "sinks", self.sinks, 0, max_len)
        _count(self.name, "window", self.window, 1, max_len)
        if self.sinks + self.window > max_len:
            raise BadValue(f"{self.name}: sinks + window = {self.sinks + self.window} tokens is more than the "
                           f"{max_len} this cache holds; use a smaller window (or plain 'full')")

    def visibility(self, rel, slots, window, own_window):
        sink = (slots < self.sinks)[:, :, None, :]
        if own_window is not None:  # sinks never beyond the layer's own window
            sink = sink & (rel < own_window)
        return (self.window if window is None else min(self.window, window)), sink

    def priority(self, view):
        keep = view.valid & ((view.slots < self.sinks) | (view.slots > view.last - self.window))
        return torch.where(keep, _INF, -_INF)

    def evict(self, view):
        m = view.slots.shape[-1]
        if m > self.budget and bool(view.valid.all()):  # no padding: entries are in slot order, so the sinks are
            # the first `sinks` entries and the window the last `window`: no top-k
            idx = torch.cat([torch.arange(self.sinks), torch.arange(m - self.window, m)]).to(view.slots.device)
            return Selection(idx.expand(*view.slots.shape[:2], -1))
        return super().evict(view)


@dataclass(frozen=True)
class H2O(SubsetPolicy):
    """H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models"): B = `size` tokens per head, the `recent` most recent (default B // 2) and the heavy hitters: the
    entries that received the most attention, summed over every query so far.

    Reads the call's queries [b, g * n_rep, n, d] against the held keys [b, g, m, d] (`Candidates.attention`)
    and its running score per entry [b, g, m], kept beside the entries. Written h2o(B), h2o(B,R)."""

    size: int = 256
    recent: int | None = None  # None: size // 2
    names: ClassVar[tuple[str, ...]] = ("h2o",)
    form: ClassVar[str] = "h2o(budget) or h2o(budget,recent)"
    reads_queries: ClassVar[bool] = True
    entry_names: ClassVar[tuple[str, ...]] = ("score",)
    arity: ClassVar[tuple[int, int]] = (1, 2)

    @property
    def n_recent(self) -> int:
        return self.size // 2 if self.recent is None else self.recent

    @property
    def base_name(self) -> str:
        return f"h2o({self.size})" if self.recent is None else f"h2o({self.size},{self.recent})"

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "budget", self.size, 1, max_len)
        _count(self.name, "recent window", self.n_recent, 0, self.size)

    def priority(self, view):
        mass = view.attention()
        old = view.entry("score")
        score = mass if old is None else old + mass
        view.entries["score"] = score  # accumulated attention, kept with each entry
        return torch.where(view.recent(self.n_recent), _INF, score)


@dataclass(frozen=True)
class SnapKV(SubsetPolicy):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): once, after the
    prompt, B = `size` tokens per head: the last `window` prompt tokens (default 32) and the prefix tokens most
    attended by those `window` queries, their votes average-pooled over `kernel` neighbours (default 7);
    every later token is kept.

    Reads the prompt's last `window` queries [b, g * n_rep, window, d] against the keys [b, g, m, d].
    Written snapkv(B), snapkv(B,W,K)."""

    size: int = 256
    window: int = 32
    kernel: int = 7
    names: ClassVar[tuple[str, ...]] = ("snapkv",)
    form: ClassVar[str] = "snapkv(budget) or snapkv(budget,window,kernel)"
    reads_queries: ClassVar[bool] = True
    arity: ClassVar[tuple[int, int]] = (1, 3)

    @property
    def base_name(self) -> str:
        return f"snapkv({self.size})" if (self.window, self.kernel) == (32, 7) else \
            f"snapkv({self.size},{self.window},{self.kernel})"

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "budget", self.size, 1, max_len)
        _count(self.name, "observation window", self.window, 1, self.size)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise BadValue(f"{self.name}: the pooling kernel must be an odd number >= 1, got {self.kernel}")

    def priority(self, view):
        if once_after_prompt(view, self.size):
            return None
        w = min(self.window, view.n)
        votes = view.attention(last=w)
        pooled = F.avg_pool1d(votes.flatten(0, 1)[:, None], self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False)[:, 0].view_as(votes)
        return torch.where(view.recent(w), _INF, pooled)


@dataclass(frozen=True)
class KNorm(SubsetPolicy):
    """KNorm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression";
    kvpress's KnormPress): once, after the prompt, the B = `size` keys of smallest L2 norm; every later token
    is kept.

    Reads the keys [b, g, m, d] only (no query). Written knorm(B)."""

    size: int = 256
    names: ClassVar[tuple[str, ...]] = ("knorm",)
    form: ClassVar[str] = "knorm(budget)"
    arity: ClassVar[tuple[int, int]] = (1, 1)

    def priority(self, view):
        if once_after_prompt(view, self.size):
            return None
        return -view.keys.float().norm(dim=-1)  # the smallest key norms are kept (kvpress's KnormPress)


@dataclass(frozen=True)
class TOVA(SubsetPolicy):
    """TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"; kvpress's TOVAPress): B = `size` tokens per
    head; after every call, the entries the call's last query attends to least are evicted, its weights
    averaged over every query head of the layer (so the layer's KV heads keep the same tokens); the last
    token always stays.

    Reads the call's last query [b, g * n_rep, 1, d] against the keys [b, g, m, d]. Written tova(B)."""

    size: int = 256
    names: ClassVar[tuple[str, ...]] = ("tova",)
    form: ClassVar[str] = "tova(budget)"
    reads_queries: ClassVar[bool] = True
    arity: ClassVar[tuple[int, int]] = (1, 1)

    def priority(self, view):
        if view.slots.shape[-1] <= self.size:
            return None
        weights = view.attention(last=1)  # [b, g, m]: the last query's weights, summed over each KV head's queries
        mean = weights.sum(1, keepdim=True) / (weights.shape[1] * view.n_rep)  # over every query head: TOVA's and
        # kvpress's layer-wise choice (the KV heads under this policy keep the same tokens); the last token stays
        return torch.where(view.slots == view.last, _INF, mean.expand_as(weights))


@dataclass(frozen=True)
class Random(SubsetPolicy):
    """Random eviction, the floor of "Protection is (nearly) all you need" (arXiv 2605.18053): B = `size`
    uniformly random tokens per head. Each token gets a fixed pseudo-random number from (seed, layer, KV head,
    slot) and the B highest are held: at every step the held entries are a uniform draw of B of the tokens
    seen so far, the same on every run and machine, different per layer and head.

    Reads the entries' slots [b, g, m] only. Written random(B), random(B,seed) (seed 0)."""

    size: int = 256
    seed: int = 0
    names: ClassVar[tuple[str, ...]] = ("random",)
    form: ClassVar[str] = "random(budget) or random(budget,seed)"
    arity: ClassVar[tuple[int, int]] = (1, 2)

    @property
    def base_name(self) -> str:
        return f"random({self.size})" if self.seed == 0 else f"random({self.size},{self.seed})"

    def priority(self, view):
        if view.slots.shape[-1] <= self.size:
            return None
        g = view.slots.shape[1]
        heads = torch.arange(g) if view.heads is None else view.heads.cpu()
        per_head = _mix(_mix(_mix(torch.tensor(self.seed, dtype=torch.int64)) ^ view.layer) ^ heads.long())  # [g]
        h = _mix(per_head.to(view.slots.device)[None, :, None] ^ view.slots.long().clamp(min=0))
        return (h >> 8).float()  # 23 bits: exact in float32


def _mix(x: Tensor) -> Tensor:
    """A 31-bit integer hash of int64 values in [0, 2^31) (three rounds of a multiply, add and xor-shift; the
    products stay below 2^62, so nothing overflows)."""
    x = x & 0x7FFFFFFF
    for _ in range(3):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        x = x ^ (x >> 16)
    return x


def once_after_prompt(view: Candidates, size: int) -> bool:
    """For policies that compress the prompt once (SnapKV, KNorm): True (keep everything) on every call after
    the first, and on a first call that already fits; marks the heads done."""
    if view.state.get("done") or view.slots.shape[-1] <= size:
        view.state["done"] = True
        return True
    view.state["done"] = True
    return False


def _count(policy: str, what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise BadValue(f"{policy}: the {what} must be between {low} and {high} (the tokens this cache holds), "
                       f"got {value}")


# ---- names -----------------------------------------------------------------------------------------
_SYNTAX = re.compile(r"^\s*([a-z0-9_]+)\s*(?:\(\s*([0-9,\s]*)\)|((?::[0-9]+)*))\s*$")
PolicyLike = Union[Policy, str]


def policy_names(ours: bool = False) -> list[str]:
    """Every registered policy, as it is written (precisions by name, the others by their form); `ours`:
    interp's own only (not those defined elsewhere)."""
    out = []
    for name, cls in _REGISTRY.items():
        if ours and cls.__module__ != __name__:
            continue
        spelled = name if cls.arity == (0, 0) or cls.arity[0] == 0 else (cls.form.split(" or ")[0] or name)
        if spelled not in out:
            out.append(spelled)
    return out


def policy_table() -> str:
    """A Markdown list of interp's policies, from the registry: how each is written, then the first paragraph
    of its class's docstring (policies defined elsewhere are theirs to describe)."""
    lines, seen = [], set()
    for name, cls in _REGISTRY.items():
        if cls in seen or cls.__module__ != __name__:
            continue
        seen.add(cls)
        spelled = ", ".join(f"`{n}`" for n in cls.names) if cls.arity == (0, 0) else f"`{cls.form}`"
        first = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        lines.append(f"- {spelled}: {first}")
    lines.append(f"- `+protect(first,last)` or `+protect(10%)` after an eviction policy: {_protect_line()}")
    return "\n".join(lines) + "\n"


def _protect_line() -> str:
    """`Protect`'s docstring, one line, and which policies refuse it (policy_table)."""
    text = " ".join(inspect.cleandoc(Protect.__doc__ or "").split())
    refuse = [c.names[0] for c in dict.fromkeys(_REGISTRY.values()) if c.__module__ == __name__ and
              (not issubclass(c, SubsetPolicy) or not c.protectable)]
    return f"{text} Refused by {', '.join(refuse)}: they evict nothing, or only the middle already."


def parse_policy(spec: PolicyLike) -> Policy:
    """A Policy from its name ("kivi4", "streaming(4,128)", "h2o:256", "h2o(132)+protect(4,9)",
    "tova(132)+protect(10%)"); a Policy is returned as is."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise BadValue(f"a KV-cache policy is a name or a Policy, got {spec!r}")
    base, plus, setting = spec.partition("+")
    policy = _parse_base(base, spec)
    if not plus:
        return policy
    protect = Protect.parse(setting, spec)
    if not isinstance(policy, SubsetPolicy):
        evicting = ", ".join(n for n, c in _REGISTRY.items() if issubclass(c, SubsetPolicy) and c.protectable)
        raise BadValue(f"KV-cache policy {spec!r}: {policy.name} keeps every token and evicts nothing, so there is "
                       f"nothing to protect; protect applies to eviction policies ({evicting})")
    return dataclasses.replace(policy, protect=protect)


def _parse_base(base: str, spec: str) -> Policy:
    m = _SYNTAX.match(base.lower())
    name = m.group(1) if m else base
    if not m or name not in _REGISTRY:
        raise BadValue(f"unknown KV-cache policy {spec!r}; choose from {', '.join(policy_names())}")
    raw = m.group(2) if m.group(2) is not None else (m.group(3) or "").replace(":", ",")
    try:
        args = [int(a) for a in raw.split(",") if a.strip()]
    except ValueError:
        raise BadValue(f"KV-cache policy {spec!r}: arguments must be whole numbers") from None
    cls = _REGISTRY[name]
    low, high = cls.arity
    if not low <= len(args) <= high:
        if high == 0:
            raise BadValue(f"KV-cache policy {name!r} takes no arguments, got {spec!r}")
        raise BadValue(f"KV-cache policy {spec!r}: write it as {cls.form or name}")
    return cls.from_args(name, args)


def split_policies(text: str) -> list[str]:
    """"full,streaming(4,128),h2o(132)" -> its policy names (commas inside parentheses kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [p for p in out if p]


def parse_policies(text: str) -> list[Policy]:
    """A comma-separated list of policy names, each parsed (duplicates refused)."""
    policies = [parse_policy(p) for p in split_policies(text)]
    if not policies:
        raise BadValue("no KV-cache policy given; e.g. 'full,kivi4,streaming(4,128)'")
    names = [p.name for p in policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BadValue(f"KV-cache policy listed twice: {', '.join(dup)}")
    return policies


PolicyMap = Union[PolicyLike, Mapping]

# Each layer holds what it can see: a layer with its own sliding window (Gemma's local layers, Mistral)
# a rolling buffer of its last `window` positions, the others every token.
WINDOW = "window"


def is_window(policy) -> bool:
    """Whether `policy` is the name `WINDOW` ("window"): each layer's own window (resolved in `resolve_policies`)."""
    return isinstance(policy, str) and policy.strip().lower() == WINDOW


def window_policy(windows: Sequence[int | None], max_len: int) -> dict:
    """{layer: streaming(0, window)} for every layer whose own window (`cfg.window(l)` per layer) is
    shorter than `max_len`: the map that `WINDOW` stands for."""
    return {l: Streaming(0, w) for l, w in enumerate(windows) if w is not None and w < max_len}


def resolve_policies(policy: PolicyMap, n_layers: int, n_kv_heads: int, *, default: PolicyLike = "full",
                     max_len: int, d_head: int, windows: Sequence[int | None] | None = None) -> list[list[Policy]]:
    """[layer][kv head] -> Policy from one policy for every head, or a map keyed by layer (every KV
    head of it) or (layer, kv_head) (that head; wins over its layer's entry), the rest `default`;
    `WINDOW` ("window") is the map of the layers' own `windows`. Every policy is checked against the
    cache's size and d_head; a layer or head the model lacks is an error."""
    if is_window(policy):
        if windows is None:
            raise BadValue("the 'window' policy needs the model's per-layer windows")
        policy = window_policy(windows, max_len)
    base = parse_policy(default)
    grid = [[base] * n_kv_heads for _ in range(n_layers)]
    if isinstance(policy, (str, Policy)):
        one = parse_policy(policy)
        grid = [[one] * n_kv_heads for _ in range(n_layers)]
    else:
        items = sorted(dict(policy).items(), key=lambda kv: isinstance(kv[0], tuple))  # layers, then heads
        for key, spec in items:
            layer, heads = _where(key, n_layers, n_kv_heads)
            p = parse_policy(spec)
            for h in heads:
                grid[layer][h] = p
    for p in {p for row in grid for p in row}:
        p.check(max_len, d_head)
    return grid


def _where(key, n_layers: int, n_kv_heads: int) -> tuple[int, range]:
    ok_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if not (ok_int(key) or (isinstance(key, tuple) and len(key) == 2 and all(map(ok_int, key)))):
        raise BadValue(f"a policy map is keyed by layer or (layer, kv_head), got {key!r}")
    layer, head = (key, None) if ok_int(key) else key
    if not 0 <= layer < n_layers:
        raise BadValue(f"policy map names {key!r}; this model has layers 0..{n_layers - 1}")
    if head is None:
        return layer, range(n_kv_heads)
    if not 0 <= head < n_kv_heads:
        raise BadValue(f"policy map names layer {layer}, KV head {head}; this model has KV heads 0..{n_kv_heads - 1}")
    return layer, range(head, head + 1)


def theory_bytes_per_token(policy: PolicyLike, *, n_layers: int, n_kv_heads: int, d_head: int, length: int,
                           dtype_bytes: int = 4) -> float:
    """What `policy` on every head should hold per token of a `length`-token sequence, from its
    definition (the benchmark prints it beside the measured `bytes_per_token`)."""
    p = parse_policy(policy)
    return n_layers * n_kv_heads * p.theory_bytes(d_head=d_head, length=length, dtype_bytes=dtype_bytes)
