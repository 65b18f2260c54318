"""Heads as a user names them: "1.0", "L1H0" or (1, 0) -> (layer, head), checked against a model's config
(`--qk`, `qk_attribution`, the runner's head arguments)."""

from __future__ import annotations

import re


def parse_head(text, cfg=None) -> tuple[int, int]:
    """"1.0", "L1H0" or (1, 0) -> (layer, head); checked against `cfg` when given."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        layer, head = int(text[0]), int(text[1])
    else:
        m = re.fullmatch(r"\s*(?:L(\d+)H(\d+)|(\d+)[.:](\d+))\s*", str(text), flags=re.IGNORECASE)
        if m is None:
            raise ValueError(f"not a head: {text!r} (write LAYER.HEAD, e.g. 1.0, or L1H0)")
        layer, head = (int(m.group(1)), int(m.group(2))) if m.group(1) is not None else (int(m.group(3)),
                                                                                         int(m.group(4)))
    if cfg is not None:
        check_head(cfg, layer, head)
    return layer, head


def parse_heads(text: str, cfg=None) -> list[tuple[int, int]]:
    """"1.0,L1H2" or "1.0 1.2" -> [(1, 0), (1, 2)]; a head named twice ("1.0,L1H0") is refused."""
    parts = [p for p in re.split(r"[\s,;]+", str(text).strip()) if p]
    if not parts:
        raise ValueError("--qk needs at least one head (LAYER.HEAD, e.g. 1.0, or L1H0)")
    heads = [parse_head(p, cfg) for p in parts]
    twice = [(p, h) for i, (p, h) in enumerate(zip(parts, heads)) if h in heads[:i]]
    if twice:
        p, (layer, head) = twice[0]
        first = parts[heads.index((layer, head))]
        said = f"{first!r} and {p!r} both name" if first != p else f"{p!r} names"
        raise ValueError(f"--qk {text}: {said} L{layer}H{head}" + (" twice" if first == p else "")
                         + ": give each head once")
    return heads


def check_head(cfg, layer: int, head: int) -> None:
    if not (0 <= layer < cfg.n_layers and 0 <= head < cfg.n_heads):
        raise ValueError(f"no head L{layer}H{head}: this model has {cfg.n_layers} layers of {cfg.n_heads} heads "
                         f"(L0H0 .. L{cfg.n_layers - 1}H{cfg.n_heads - 1})")


__all__ = ["check_head", "parse_head", "parse_heads"]
