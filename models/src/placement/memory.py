"""Will a forward at this length fit? An estimate made from the config alone, before any weight loads.

Long-context work (`interp analyze --seq-len 32768`, `interp lengths`, `interp kv passkey --lengths`)
holds the weights, one layer's activations at a time, and nothing of size n x n (the streaming
statistics, banded sliding windows, slabbed unembedding: `tests/analyses/extrapolation/test_long_context.py` holds the
code to that). What grows with the length is then linear:

    bytes(batch, n) = FIXED + weights + batch * n * per_token

    per_token = 4 * (6 d_mlp + 12 d_model + 4 (heads + 2 kv_heads) d_head) float32 values: the residual
                stream and its norms, the MLP's hidden activations (gate, input, product and their
                temporaries), one layer's q, k, v and attention output, and the per-query statistics.
    FIXED     = 1.5 GiB: torch and the interpreter (~0.5 GiB), the unembedding's logit slabs (two of
                512 MiB), the tokenizer.

Measured on this project's CPU (peak RSS of `interp analyze`): Gemma 3 270M at 32,768 tokens holds
about half of the per-token term the formula gives, so it is a ceiling, not a forecast: a length it
refuses would not have fitted, and one it allows has room to spare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interp.errors import UserError

FIXED_BYTES = 3 * 2**29  # 1.5 GiB
GiB = 2**30


def parameters_text(n: int) -> str:
    """A parameter count in words, never to be read as bytes: "135.0 million parameters", "1.2 billion
    parameters", "128.0 trillion parameters"."""
    for size, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if n >= size:
            return f"{n / size:,.1f} {word} parameters"
    return f"{n:,} parameters"


def gib_text(nbytes: float) -> str:
    """Bytes as GiB, with thousands separated: "2.5 GiB", "476,837.2 GiB"; under 1 GiB to 0.01 ("0.12 GiB"), so
    that what is needed and what is free never read the same when they differ by more than rounding."""
    return f"{nbytes / GiB:,.{2 if nbytes < GiB else 1}f} GiB"


def per_token_bytes(cfg) -> int:
    """The estimate's bytes per token of one sequence (float32 activations)."""
    d_mlp = cfg.d_mlp or 0
    qkv = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
    return 4 * (6 * d_mlp + 12 * cfg.d_model + 4 * qkv)


def weight_bytes(cfg, element_size: int = 4) -> int:
    return cfg.n_params() * element_size


def held_weight_bytes(cfg, element_size: int = 4, offload: str | None = None) -> int:
    """Bytes of weights the compute device holds at once: all of them, or offloaded the largest block."""
    return weight_bytes(cfg, element_size) if offload is None else largest_unit_bytes(cfg, element_size)


def estimate_bytes(cfg, batch: int, length: int, element_size: int = 4, offload: str | None = None) -> int:
    """Peak bytes of one forward with the long-context analyses over `batch` sequences of `length`."""
    return FIXED_BYTES + held_weight_bytes(cfg, element_size, offload) + batch * length * per_token_bytes(cfg)


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (Linux: MemAvailable, MemTotal, ...), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(device: str | torch.device = "cpu") -> int | None:
    """Memory a new allocation can have on `device`: CUDA's free memory, or the host's MemAvailable
    (Linux) / what psutil reports; None when it cannot be read (then nothing is refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    found = meminfo("MemAvailable")
    if found is not None:
        return found
    try:
        import psutil  # optional: macOS, Windows
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class Fit:
    needed: int  # estimated bytes
    available: int | None
    longest: int | None  # the longest length that fits at this batch (None: unknown)

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available


def check_fits(cfg, batch: int, length: int, device="cpu", *, what: str = "--seq-len", available: int | None = None,
               element_size: int = 4, offload: str | None = None, weights: int | None = None) -> Fit:
    """Raise ValueError (one line: the estimate, what is free, the longest length that fits) when a
    forward over `batch` x `length` tokens would not fit on `device`; return the `Fit` otherwise.
    `weights`: the bytes of weights `device` holds, when not all of them (one device of a `device_map`:
    `device_map.check_fits_split`)."""
    available = available_bytes(device) if available is None else available
    held = held_weight_bytes(cfg, element_size, offload) if weights is None else weights
    needed = FIXED_BYTES + held + batch * length * per_token_bytes(cfg)
    longest = None
    if available is not None:
        room = available - FIXED_BYTES - held
        longest = max(0, room // (batch * per_token_bytes(cfg)))
    fit = Fit(needed, available, longest)
    if not fit.fits:
        where = "this machine's" if torch.device(device).type == "cpu" else f"{device}'s"
        whole = weights is None
        weights = held
        if offload is None and whole and FIXED_BYTES + weights > available:  # no length fits: the weights are the problem
            block = largest_unit_bytes(cfg, element_size)
            instead = (f"--offload disk (offload=\"disk\") holds one block of {gib_text(block)} at a time"
                       if FIXED_BYTES + block <= available else
                       f"not even one block ({gib_text(block)}) fits offloaded: use a device with more memory")
            raise ValueError(f"{what} {length}: the weights alone need about {gib_text(weights)} "
                             f"({parameters_text(cfg.n_params())} of {element_size} bytes each), more than {where} "
                             f"{gib_text(available)} free; {instead}")
        raise ValueError(f"{what} {length}: about {gib_text(needed)} needed for {batch} sequence(s) of {length} "
                         f"tokens, more than {where} {gib_text(available)} free; the longest that fits is about "
                         f"{longest:,} tokens (or use fewer sequences)")
    return fit


class WeightsDoNotFit(UserError, MemoryError):
    """A load refused before any weight is read: the weights in the requested dtype would not fit."""


# What a refusal offers instead, narrowest last: the sizes a checkpoint can be loaded in.
_SMALLER = (torch.float32, torch.bfloat16, torch.float16)


def largest_unit_bytes(cfg, element_size: int) -> int:
    """Bytes of the largest piece an offloaded model holds at once (`interp.models.placement.offload`): one block, or
    the embedding or unembedding matrix (d_vocab x d_model), whichever is bigger."""
    matrix = cfg.d_vocab * cfg.d_model
    blocks = max(0, cfg.n_params() - matrix * (1 if cfg.tie_embeddings else 2))
    return max(matrix, -(-blocks // max(1, cfg.n_layers))) * element_size


def check_weights_fit(cfg, dtype: torch.dtype, device=None, *, source: str, available: int | None = None,
                      offload: str | None = None, n_params: int | None = None) -> None:
    """Refuse (`WeightsDoNotFit`, one line) a load whose weights alone, `cfg.n_params()` in `dtype`, exceed
    what `device` has free (`available_bytes`), naming a smaller dtype that would fit, with its size, and
    offload where one block fits: only what would fit is offered. Made from the config before any weight is
    read; a ceiling-free estimate (activations come on top), so a load it allows can still run short, but one
    it refuses could not have fitted. Nothing is refused when the free memory cannot be read. Offloaded
    (`offload`), the device holds its largest block at a time (`largest_unit_bytes`); offload="cpu" holds every
    weight in host memory besides. `n_params`: the count when the config's formula does not know it (a wrapped
    architecture, counted on the meta device); such a model cannot be offloaded, so the refusal does not offer it."""
    device = torch.device(device or "cpu")
    name = _name(dtype)
    smaller = [d for d in _SMALLER if d.itemsize < dtype.itemsize]
    if offload is not None:
        if offload == "cpu" and device.type != "cpu":
            check_weights_fit(cfg, dtype, "cpu", source=source)
        available = available_bytes(device) if available is None else available
        needed = largest_unit_bytes(cfg, dtype.itemsize)
        if available is not None and needed > available:
            where = "this machine's" if device.type == "cpu" else f"{device}'s"
            fits = [d for d in smaller if largest_unit_bytes(cfg, d.itemsize) <= available]
            instead = (f"in {_name(fits[0])} it takes {gib_text(largest_unit_bytes(cfg, fits[0].itemsize))}, which "
                       f"fits (dtype=torch.{_name(fits[0])}), or use a device with more memory" if fits else
                       "no smaller dtype interp loads makes it fit"
                       + (f" ({gib_text(largest_unit_bytes(cfg, 2))} in bfloat16)" if smaller else "")
                       + ": use a device with more memory")
            raise WeightsDoNotFit(f"{source}: offloaded, its largest block in {name} needs about {gib_text(needed)} at "
                                  f"a time, more than {where} {gib_text(available)} free; {instead}")
        return
    available = available_bytes(device) if available is None else available
    n = cfg.n_params() if n_params is None else n_params
    needed = n * dtype.itemsize
    if available is None or needed <= available:
        return
    where = "this machine's" if device.type == "cpu" else f"{device}'s"
    fits = [d for d in smaller if n * d.itemsize <= available]
    instead = (f"in {_name(fits[0])} they take {gib_text(n * fits[0].itemsize)}, which fits "
               f"(dtype=torch.{_name(fits[0])})" if fits else
               f"no dtype interp loads in fits ({gib_text(n * 2)} in bfloat16)")
    if n_params is None:  # a native model: offloading is the other way, offered where a block fits
        held = [d for d in (dtype, *smaller) if largest_unit_bytes(cfg, d.itemsize) <= available]
        if held:
            block = gib_text(largest_unit_bytes(cfg, held[0].itemsize))
            instead += (f"; or offload=\"disk\" (--offload disk): the weights stay in the checkpoint's files and one "
                        f"block of {block} is held at a time"
                        + ("" if held[0] == dtype else f" in {_name(held[0])} (dtype=torch.{_name(held[0])})"))
    raise WeightsDoNotFit(f"{source}: its weights, {parameters_text(n)} in {name}, need about {gib_text(needed)}, "
                          f"more than {where} {gib_text(available)} free; {instead}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
