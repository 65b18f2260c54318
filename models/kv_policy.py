"""KV-cache policies: what one KV head keeps of the context, by name or as an object.

    full               every token, in the model's dtype (the unmodified model)
    fp32 fp16 bf16     every token, stored in that precision
    int8 fp8 int4      every token, one scale per vector (`interp.kernels.kv_quant`)
    kivi4 kivi2        KIVI (Liu et al. 2024): keys per channel over groups of G tokens, values per
                       token over groups of G channels, the latest tokens in full precision until R
                       of them fill a flush (kivi4(G,R); default G = R = 32)
    streaming(S,W)     StreamingLLM (Xiao et al. 2023): the first S tokens (sinks) and the last W
    h2o(B) h2o(B,R)    H2O (Zhang et al. 2023): B tokens, the R most recent (default B // 2) and the
                       heavy hitters (most attention received, summed over every query so far)
    snapkv(B) snapkv(B,W,K)  SnapKV (Li et al. 2024): after the prompt, B tokens: the last W prompt
                       tokens (default 32) and the prefix tokens most attended by those W queries,
                       votes average-pooled over K neighbours (default 7); later tokens all kept

Names parse with `parse_policy("streaming(4,128)")` (or "streaming:4:128"); a map gives each
(layer, KV head) its own: `resolve_policies({3: "streaming(4,128)", (5, 1): "kivi4"}, ...)`.
Windows follow the model's convention (Hugging Face's): a query sees itself and the W - 1 tokens
before it, so a streaming head holds S + W entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence, Union

from .errors import BadValue

DENSE = ("full", "fp32", "fp16", "bf16", "int8", "fp8", "int4")


@dataclass(frozen=True)
class Policy:
    """One KV head's cache policy. `holds_all`: keeps every token (codes may be lossy);
    `shares_prefill`: its prefill computes exactly what the full model computes (so one full prefill
    serves it, `PolicyKVCache.absorb`); `budget`: tokens held per head, None when unbounded."""

    kind: ClassVar[str] = ""
    holds_all: ClassVar[bool] = True
    shares_prefill: ClassVar[bool] = True

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def budget(self) -> int | None:
        return None

    def check(self, max_len: int, d_head: int) -> None:
        """Raise BadValue when this policy cannot run in a cache of `max_len` tokens."""

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Dense(Policy):
    """Every token kept, in `precision` ("full": the model's own dtype)."""

    precision: str = "full"
    kind: ClassVar[str] = "dense"

    @property
    def name(self) -> str:
        return self.precision

    @property
    def shares_prefill(self) -> bool:  # a per-vector quantized cache's prefill reads its own codes
        return self.precision in ("full", "fp32")

    def check(self, max_len: int, d_head: int) -> None:
        if self.precision == "int4" and d_head % 2:
            raise BadValue(f"int4 packs two codes per byte and needs an even d_head; this model's is {d_head}")


@dataclass(frozen=True)
class Kivi(Policy):
    bits: int = 4
    group: int = 32
    residual: int = 32
    kind: ClassVar[str] = "kivi"

    @property
    def name(self) -> str:
        return f"kivi{self.bits}" if (self.group, self.residual) == (32, 32) else \
            f"kivi{self.bits}({self.group},{self.residual})"

    def check(self, max_len: int, d_head: int) -> None:
        if self.group < 1 or d_head % self.group:
            raise BadValue(f"{self.name}: the group size {self.group} must divide d_head ({d_head}): KIVI groups "
                           f"values over channels; e.g. kivi{self.bits}({_divisor(d_head)},{_divisor(d_head)})")
        if self.residual < self.group or self.residual % self.group:
            raise BadValue(f"{self.name}: the residual ({self.residual} full-precision tokens) must be a multiple "
                           f"of the group size ({self.group}), since keys are quantized a whole group at a time")


def _divisor(d: int) -> int:
    return max(g for g in (8, 16, 32, 64) if d % g == 0) if d % 8 == 0 else 1


@dataclass(frozen=True)
class Streaming(Policy):
    sinks: int = 4
    window: int = 128
    kind: ClassVar[str] = "streaming"
    holds_all: ClassVar[bool] = False
    shares_prefill: ClassVar[bool] = False  # its prefill attends through the window

    @property
    def name(self) -> str:
        return f"streaming({self.sinks},{self.window})"

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "sinks", self.sinks, 0, max_len)
        _count(self.name, "window", self.window, 1, max_len)
        if self.sinks + self.window > max_len:
            raise BadValue(f"{self.name}: sinks + window = {self.sinks + self.window} tokens is more than the "
                           f"{max_len} this cache holds; use a smaller window (or plain 'full')")


@dataclass(frozen=True)
class H2O(Policy):
    size: int = 256
    recent: int | None = None  # None: size // 2
    kind: ClassVar[str] = "h2o"
    holds_all: ClassVar[bool] = False

    @property
    def n_recent(self) -> int:
        return self.size // 2 if self.recent is None else self.recent

    @property
    def name(self) -> str:
        return f"h2o({self.size})" if self.recent is None else f"h2o({self.size},{self.recent})"

    @property
    def budget(self) -> int:
        return self.size

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "budget", self.size, 1, max_len)
        _count(self.name, "recent window", self.n_recent, 0, self.size)


@dataclass(frozen=True)
class SnapKV(Policy):
    size: int = 256
    window: int = 32
    kernel: int = 7
    kind: ClassVar[str] = "snapkv"
    holds_all: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return f"snapkv({self.size})" if (self.window, self.kernel) == (32, 7) else \
            f"snapkv({self.size},{self.window},{self.kernel})"

    @property
    def budget(self) -> int:
        return self.size

    def check(self, max_len: int, d_head: int) -> None:
        _count(self.name, "budget", self.size, 1, max_len)
        _count(self.name, "observation window", self.window, 1, self.size)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise BadValue(f"{self.name}: the pooling kernel must be an odd number >= 1, got {self.kernel}")


def _count(policy: str, what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise BadValue(f"{policy}: the {what} must be between {low} and {high} (the tokens this cache holds), "
                       f"got {value}")


_SYNTAX = re.compile(r"^\s*([a-z0-9]+)\s*(?:\(\s*([0-9,\s]*)\)|((?::[0-9]+)*))\s*$")
_ARGS = {"streaming": (Streaming, 2, 2), "h2o": (H2O, 1, 2), "snapkv": (SnapKV, 1, 3), "kivi4": (Kivi, 0, 2),
         "kivi2": (Kivi, 0, 2)}
NAMES = (*DENSE, "kivi4", "kivi2", "streaming(S,W)", "h2o(B)", "snapkv(B)")
PolicyLike = Union[Policy, str]


def parse_policy(spec: PolicyLike) -> Policy:
    """A Policy from its name ("kivi4", "streaming(4,128)", "h2o:256"); a Policy is returned as is."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise BadValue(f"a KV-cache policy is a name or a Policy, got {spec!r}")
    m = _SYNTAX.match(spec.lower())
    name = m.group(1) if m else spec
    if not m or (name not in DENSE and name not in _ARGS):
        raise BadValue(f"unknown KV-cache policy {spec!r}; choose from {', '.join(NAMES)}")
    raw = m.group(2) if m.group(2) is not None else (m.group(3) or "").replace(":", ",", 1).replace(":", ",")
    try:
        args = [int(a) for a in raw.split(",") if a.strip()]
    except ValueError:
        raise BadValue(f"KV-cache policy {spec!r}: arguments must be whole numbers") from None
    if name in DENSE:
        if args:
            raise BadValue(f"KV-cache policy {name!r} takes no arguments, got {spec!r}")
        return Dense(name)
    cls, low, high = _ARGS[name]
    if not low <= len(args) <= high:
        form = {"streaming": "streaming(sinks,window)", "h2o": "h2o(budget) or h2o(budget,recent)",
                "snapkv": "snapkv(budget) or snapkv(budget,window,kernel)"}.get(name, f"{name} or {name}(group,residual)")
        raise BadValue(f"KV-cache policy {spec!r}: write it as {form}")
    if cls is Kivi:
        return Kivi(int(name[-1]), *args)
    return cls(*args)


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
    if isinstance(policy, str) and policy.strip().lower() == WINDOW:
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
