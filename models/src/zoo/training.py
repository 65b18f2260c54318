"""Training small models from scratch, deterministically, on a corpus every machine has offline.

The corpus is the Python standard library's own `.py` sources (`sysconfig.get_paths()["stdlib"]`,
`site-packages` excluded), files sorted by relative path, read as UTF-8 bytes: token ids 0..255 are
bytes and 256 is `<bos>` (see `interp.models.formats.tokenizer.ByteTokenizer`). Every 20th file is held out for
evaluation. The training stream is `<bos> file_0 <bos> file_1 ...`; a training window is `<bos>`
followed by `n_ctx - 1` tokens from a random offset of the stream.

Copy-span augmentation: in a fraction `copy_prob` of the windows, a span of 16-96 tokens is copied
from an earlier place in the window to a later one. Repeated spans are what induction heads exploit;
adding a few makes the induction-head phase change (Olsson et al. 2022) reliable at this tiny scale.
In a fraction `random_span_prob` of those windows the span is first overwritten with uniform random
bytes: source code uses ~100 of the 256 byte values, and without this the other ~150 keep their
random initial embeddings, so induction on repeated *uniform* random tokens (the standard probe)
would fail on them while working on printable text. The first copy of a random span (and the first
token of its repeat) cannot be predicted, so those targets are left out of the loss (`Batch.weights`):
in trials, training on that noise slowed everything down and delayed the phase change from ~1100 to
~2000 steps.

Determinism: the model is initialised from `seed`, the data order comes from a PCG64 generator seeded
from `seed`, and the thread count is fixed, so the same seed, threads, torch version, stdlib *and CPU
kernels* give bitwise-identical checkpoints. The kernels torch picks depend on the CPU (its vector
capability, AVX2 vs AVX512, and vendor): `training_environment()` records all of these in run.json,
and a bitwise claim holds only where every one of them matches. Elsewhere a retrained checkpoint
differs from the shipped one by float round-off (one fp16 ulp in a few elements after 10 steps).

At every checkpoint the loop records, in `meta.json`, cheap head scores computed from materialised
patterns (`probe_scores`) and the in-context-learning score (`icl_score`), so the phase change can be
read without other tools. Recipes (`Recipe`) are frozen dataclasses; the shipped ones live in
`interp.models.zoo.recipes`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from interp.errors import UserError, check_int, check_threads
from ..placement.tensor_files import save_model
from ..formats.tokenizer import ByteTokenizer

from . import probes
from ..config import ModelConfig
from ..native.transformer import HookedTransformer

BOS = 256
EVAL_SEED = 1234  # the evaluation windows and probe tokens are the same for every run and seed
RUN_FILE = "run.json"
CHECKPOINT_NAMING = "step_%05d"  # a checkpoint's folder, by its step
RESUME_FILE = "resume.pt"  # fp32 weights, optimizer and data-order state at the last checkpoint; deleted at the end


# ---- recipes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """Everything that determines a training run (plus `seed` and `threads`, which the CLI may override)."""

    name: str
    model: ModelConfig
    steps: int
    checkpoints: tuple[int, ...]  # steps at which a checkpoint is saved (the last step always is)
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 100  # linear warm-up from 0
    schedule: Literal["constant", "cosine"] = "constant"  # after warm-up
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.05  # on matrices and embeddings only (not norms or biases)
    grad_clip: float | None = 1.0
    copy_prob: float = 0.5  # fraction of windows with a copied span
    copy_span: tuple[int, int] = (16, 96)  # inclusive range of the copied span's length
    random_span_prob: float = 0.0  # of the copied spans, the fraction that are uniform random bytes
    seed: int = 0
    threads: int = 1  # torch intra-op threads; results are bitwise-reproducible for a fixed count only.
    # One thread: reproducible on any machine, and on a shared 2-core box faster than 2 contending threads.
    eval_windows: int = 512  # held-out windows for eval loss and the ICL score
    probe_len: int = 100  # length of each half of the repeated random sequence
    probe_batch: int = 32
    description: str = ""
    # A twin's base (the sink twins): the parameters this config's model shares with the recipe's start from the
    # weights the base draws from the seed, so twins that add parameters (learned sinks, an attention gate) still
    # start from identical shared weights. None: the recipe's model is initialised from the seed alone.
    init_like: ModelConfig | None = None

    def checkpoint_steps(self, steps: int | None = None) -> list[int]:
        """The checkpoint steps of a run of `steps` (default `self.steps`): those <= steps, plus steps."""
        steps = self.steps if steps is None else steps
        return sorted({s for s in self.checkpoints if s <= steps} | {steps})

    def lr_at(self, step: int, steps: int) -> float:
        """Learning rate for optimizer step `step` (0-based) of a run of `steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        frac = (step - self.warmup_steps) / max(1, steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + float(np.cos(np.pi * min(frac, 1.0)))))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = self.model.to_dict()
        if self.init_like is None:
            out.pop("init_like")
        else:
            out["init_like"] = self.init_like.to_dict()
        return out


# ---- the corpus ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Corpus:
    """Token streams of the stdlib sources. `train`: one int16 array; `eval_docs`: held-out files."""

    train: np.ndarray
    eval_docs: tuple[np.ndarray, ...]
    n_files: int
    n_bytes: int
    sha256: str
    root: str

    def describe(self) -> dict:
        return {"source": "python stdlib *.py (site-packages excluded), sorted by path", "root": self.root,
                "files": self.n_files, "bytes": self.n_bytes, "sha256": self.sha256,
                "train_tokens": int(self.train.size), "eval_files": len(self.eval_docs)}


def cpu_model() -> str:
    """The CPU's model string (/proc/cpuinfo's "model name"; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def training_environment(threads: int, corpus: Corpus) -> dict:
    """Everything a bitwise-reproduction claim depends on besides the recipe and seed.

    torch's CPU kernels differ by vector capability (`torch.backends.cpu.get_cpu_capability()`) and
    by vendor, so two machines with the same torch and corpus can round differently."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_model(), "threads": threads, "corpus_sha256": corpus.sha256,
            "python": platform.python_version()}


def environment_mismatch(recorded: dict, current: dict) -> str | None:
    """The first field of a recorded training environment that differs from `current` (or is not
    recorded at all), as a sentence; None when every field matches."""
    for key in ("torch", "cpu_capability", "cpu", "threads", "corpus_sha256"):
        if key not in recorded:
            return f"the run does not record its {key} (trained before environments were recorded)"
        if recorded[key] != current[key]:
            return f"{key} differs: trained with {recorded[key]!r}, running {current[key]!r}"
    return None


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's `.py` files, sorted by path relative to `root` (site-packages excluded)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [f for f in root.rglob("*.py") if f.is_file() and not skip & set(f.relative_to(root).parts)]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def load_corpus(root: str | Path | None = None, eval_every: int = 20) -> Corpus:
    """Read the corpus; every `eval_every`-th file (in sorted order) is held out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; the training corpus is the Python standard library")
    digest = hashlib.sha256()
    train, evals, n_bytes = [], [], 0
    for i, f in enumerate(files):
        data = f.read_bytes()
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + data + b"\0")
        n_bytes += len(data)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int16)
        if i % eval_every == 0:
            evals.append(ids)
        else:
            train.extend([np.array([BOS], dtype=np.int16), ids])
    return Corpus(np.concatenate(train), tuple(evals), len(files), n_bytes, digest.hexdigest(), str(root))


# ---- batches -------------------------------------------------------------------------------------
class Batch(NamedTuple):
    """tokens: long [batch, n_ctx]; weights: float [batch, n_ctx - 1], the weight of predicting
    tokens[:, t] from tokens[:, :t] at index t - 1 (0 for the unpredictable targets of random spans)."""

    tokens: Tensor
    weights: Tensor


class BatchSampler:
    """Random windows `<bos> + stream[o : o + n_ctx - 1]`, with copy-span augmentation.

    All randomness comes from one PCG64 generator, so the sequence of batches is a function of the
    seed alone (and identical on every platform)."""

    def __init__(self, stream: np.ndarray, n_ctx: int, batch_size: int, seed: int,
                 copy_prob: float = 0.0, copy_span: tuple[int, int] = (16, 96),
                 random_span_prob: float = 0.0) -> None:
        if stream.size < n_ctx:
            raise ValueError(f"the stream ({stream.size} tokens) is shorter than one window ({n_ctx})")
        self.stream, self.n_ctx, self.batch_size = stream, n_ctx, batch_size
        self.copy_prob, self.copy_span, self.random_span_prob = copy_prob, copy_span, random_span_prob
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        n = self.n_ctx
        offsets = self.rng.integers(0, self.stream.size - (n - 1) + 1, size=self.batch_size)
        rows = np.empty((self.batch_size, n), dtype=np.int64)
        rows[:, 0] = BOS
        rows[:, 1:] = self.stream[offsets[:, None] + np.arange(n - 1)]
        weights = np.ones((self.batch_size, n - 1), dtype=np.float32)
        for row, w in zip(rows, weights):
            if self.copy_prob and self.rng.random() < self.copy_prob:
                randomize = bool(self.random_span_prob) and self.rng.random() < self.random_span_prob
                src, dst, length = copy_span(row, self.rng, *self.copy_span, randomize=randomize)
                if randomize and length:  # targets t in [src, src + length) and dst sit at index t - 1
                    w[src - 1:src - 1 + length] = 0
                    w[dst - 1] = 0
        return Batch(torch.from_numpy(rows), torch.from_numpy(weights))


def copy_span(row: np.ndarray, rng: np.random.Generator, lo: int, hi: int,
              randomize: bool = False) -> tuple[int, int, int]:
    """In place: copy `row[s : s + L]` over `row[d : d + L]` for a random L in [lo, hi] and s + L <= d
    (position 0, the `<bos>`, is never a source or target). With `randomize`, `row[s : s + L]` is first
    replaced by uniform random bytes (0..255), so the window holds one random span twice.
    Returns (s, d, L); L is 0 when the row is too short for any span."""
    n = row.size
    hi = min(hi, (n - 1) // 2)
    if hi < 1:
        return 1, 1, 0
    length = int(rng.integers(min(lo, hi), hi + 1))
    src = int(rng.integers(1, n - 2 * length + 1))
    dst = int(rng.integers(src + length, n - length + 1))
    if randomize:
        row[src:src + length] = rng.integers(0, 256, size=length)
    row[dst:dst + length] = row[src:src + length]
    return src, dst, length


def eval_windows(corpus: Corpus | Sequence[np.ndarray], n_ctx: int, n: int, seed: int = EVAL_SEED) -> Tensor:
    """`n` held-out windows `<bos> + doc[o : o + n_ctx - 1]`, each inside one file (no copied spans), of a
    corpus's held-out files or of the given byte-id arrays (the shipped ones: `evaldata.heldout_docs()`)."""
    held = corpus.eval_docs if isinstance(corpus, Corpus) else corpus
    docs = [d for d in held if d.size >= n_ctx - 1]
    if not docs:
        raise ValueError(f"no held-out file has {n_ctx - 1} tokens")
    sizes = np.array([d.size - (n_ctx - 1) + 1 for d in docs], dtype=np.float64)
    rng = np.random.Generator(np.random.PCG64(seed))
    which = rng.choice(len(docs), size=n, p=sizes / sizes.sum())
    rows = np.empty((n, n_ctx), dtype=np.int64)
    rows[:, 0] = BOS
    for r, i in enumerate(which):
        o = int(rng.integers(0, docs[i].size - (n_ctx - 1) + 1))
        rows[r, 1:] = docs[i][o:o + n_ctx - 1]
    return torch.from_numpy(rows)


# ---- cheap probes (the analyses package has the full detectors) ----------------------------------
def repeated_random_tokens(n_seq: int, length: int, low: int = 0, high: int = 256, seed: int = EVAL_SEED) -> Tensor:
    """`<bos>, r_0..r_{L-1}, r_0..r_{L-1}` with r uniform in [low, high): [n_seq, 1 + 2 * length]."""
    return probes.repeated_random_tokens(n_seq, length, high, low=low, seed=seed, bos=BOS)


@torch.no_grad()
def probe_scores(model: HookedTransformer, tokens: Tensor, length: int) -> dict[str, Tensor]:
    """Per-head scores [layer, head] from materialised patterns on repeated random tokens (see
    `repeated_random_tokens`):

    induction: mean attention from each token of the second copy (position L + 1 + i) to the token
               after its earlier occurrence (position i + 2) (Olsson et al. 2022; TransformerLens's
               induction stripe, restricted to the second copy).
    previous:  mean attention from every position p >= 1 to p - 1.
    sink:      mean attention from every position p >= 1 to position 0 (the `<bos>`; Xiao et al. 2023).
    """
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    ind, prev, sink = [], [], []
    q = torch.arange(length + 1, 2 * length + 1)
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer].float()  # [batch, head, q, k]
        ind.append(pattern[:, :, q, q - length + 1].mean(dim=(0, 2)))
        p = torch.arange(1, pattern.shape[-1])
        prev.append(pattern[:, :, p, p - 1].mean(dim=(0, 2)))
        sink.append(pattern[:, :, 1:, 0].mean(dim=(0, 2)))
    return {"induction": torch.stack(ind), "previous": torch.stack(prev), "sink": torch.stack(sink)}


@torch.no_grad()
def icl_score(model: HookedTransformer, windows: Tensor, early: int = 50, late: int = 500,
              batch_size: int = 64) -> dict[str, float]:
    """In-context-learning score (Olsson et al. 2022): loss at token `late` minus loss at token `early`,
    averaged over `windows`. A `late` past the window is moved to its last position (n_ctx - 1) and
    the position used is recorded (`late_token`). "Loss at token t" is the cross-entropy of predicting
    token t from tokens < t. Also returns the mean eval loss."""
    nll = torch.cat([model(w, return_type="loss", loss_per_token=True) for w in windows.split(batch_size)])
    got = probes.icl_from_losses(nll, early, min(late, windows.shape[1] - 1))
    return {"icl": got["icl"], "loss_early": got["loss_early"], "loss_late": got["loss_late"],
            "eval_loss": nll.mean().item(), "late_token": got["late"]}


# ---- the loop ------------------------------------------------------------------------------------
def train(recipe: Recipe, out_dir: str | Path, *, steps: int | None = None, seed: int | None = None,
          threads: int | None = None, corpus: Corpus | None = None, progress: bool = True,
          log: Callable[[str], None] = print) -> Path:
    """Train `recipe` and write its run folder: `out_dir/step_XXXXX/` checkpoints and `out_dir/run.json`.

    `steps`, `seed` and `threads` override the recipe's (e.g. a short test run). Returns out_dir.

    A run that was killed resumes from its last checkpoint when started again with the same settings
    and `out_dir` (`out_dir/resume.pt` holds the exact state), and ends bit-identical to an
    uninterrupted run."""
    from tqdm.auto import tqdm

    steps = check_int("steps", recipe.steps if steps is None else steps, minimum=1)
    seed = check_int("seed", recipe.seed if seed is None else seed, minimum=0)
    threads = check_threads(recipe.threads if threads is None else threads)
    out_dir = Path(out_dir)  # created only now, after every setting is checked
    out_dir.mkdir(parents=True, exist_ok=True)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        corpus = corpus or load_corpus()
        cfg = recipe.model
        model = initial_model(recipe, seed)
        opt = _optimizer(model, recipe)
        sampler = BatchSampler(corpus.train, cfg.n_ctx, recipe.batch_size, seed, recipe.copy_prob, recipe.copy_span,
                               recipe.random_span_prob)
        held_out = eval_windows(corpus, cfg.n_ctx, recipe.eval_windows)
        probe_len = min(recipe.probe_len, (cfg.n_ctx - 1) // 2)
        probe = repeated_random_tokens(recipe.probe_batch, probe_len)
        run = {"name": recipe.name, "recipe": recipe.to_dict(), "steps": steps, "seed": seed, "threads": threads,
               "torch": torch.__version__, "python": platform.python_version(), "corpus": corpus.describe(),
               "environment": training_environment(threads, corpus), "checkpoint_naming": CHECKPOINT_NAMING, "checkpoints": []}
        ckpt_steps = set(recipe.checkpoint_steps(steps))
        key = json.dumps({k: run[k] for k in ("recipe", "steps", "seed", "threads", "torch")}, sort_keys=True)
        first, losses, elapsed = 0, [], 0.0
        if (out_dir / RESUME_FILE).exists():
            first, losses, elapsed = _resume(out_dir, key, model, opt, sampler)
            done = json.loads((out_dir / RUN_FILE).read_text())["checkpoints"]
            run["checkpoints"] = [c for c in done if c["step"] <= first]
            log(f"resuming {recipe.name} from step {first} ({out_dir / RESUME_FILE})")
        start = time.perf_counter() - elapsed
        bar = tqdm(total=steps, initial=first, desc=recipe.name, disable=not progress, dynamic_ncols=True)
        for step in range(first, steps + 1):
            if step in ckpt_steps and not (step == first and run["checkpoints"]):
                model.eval()
                meta = _checkpoint_meta(model, recipe, step, steps, seed, losses, held_out, probe, probe_len)
                meta["seconds"] = round(time.perf_counter() - start, 1)
                name = CHECKPOINT_NAMING % step
                save_model(model, out_dir / name, dtype=torch.float16, meta=meta)
                run["checkpoints"].append({"dir": name, **{k: meta[k] for k in _SUMMARY}})
                _write_json(out_dir / RUN_FILE, run)
                msg = " ".join(f"{k} {meta[k]:.3f}" if isinstance(meta[k], float) else f"{k} {meta[k]}" for k in _SUMMARY)
                (bar.write if progress else log)(msg)
                model.train()
                if step < steps:
                    _save_resume(out_dir, key, step, model, opt, sampler, losses, time.perf_counter() - start)
            if step == steps:
                break
            losses.append(_train_step(model, opt, sampler, recipe, step, steps))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.close()
        run["train_seconds"] = round(time.perf_counter() - start, 1)
        _write_json(out_dir / RUN_FILE, run)
        (out_dir / RESUME_FILE).unlink(missing_ok=True)
        log(f"trained {recipe.name} for {steps} steps in {run['train_seconds']:.0f} s "
            f"({threads} threads, seed {seed}) -> {out_dir}")
        return out_dir
    finally:
        torch.set_num_threads(saved_threads)


def initial_model(recipe: Recipe, seed: int) -> HookedTransformer:
    """The recipe's model at step 0: initialised from `seed`; with `recipe.init_like`, every parameter it shares
    with that base (same name and shape) then copied from the base's own initialisation from `seed`."""
    model = HookedTransformer(recipe.model, seed=seed, tokenizer=ByteTokenizer())
    if recipe.init_like is not None:
        base = HookedTransformer(recipe.init_like, seed=seed).state_dict()
        own = model.state_dict()
        shared = {k: v for k, v in base.items() if k in own and own[k].shape == v.shape}
        model.load_state_dict(shared, strict=False)
    return model


_SUMMARY = ("step", "loss", "eval_loss", "icl", "induction", "previous")


def _optimizer(model, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with the recipe's weight decay on the matrices (2-d and up) only, none on biases and norm weights."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=recipe.lr, betas=recipe.betas)


def _train_step(model, opt, sampler: BatchSampler, recipe: Recipe, step: int, steps: int) -> float:
    """One update at `step` of `steps` on the sampler's next batch (the schedule's rate, the loss weighted by
    `Batch.weights`, the recipe's gradient clipping); returns its loss."""
    for group in opt.param_groups:
        group["lr"] = recipe.lr_at(step, steps)
    batch = next(sampler)
    nll = model(batch.tokens, return_type="loss", loss_per_token=True)
    loss = (nll * batch.weights).sum() / batch.weights.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if recipe.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    opt.step()
    return loss.item()


def _checkpoint_meta(model, recipe: Recipe, step: int, steps: int, seed: int, losses: list[float], held_out: Tensor,
                     probe: Tensor, probe_len: int) -> dict:
    scores = probe_scores(model, probe, probe_len)
    icl = icl_score(model, held_out)
    later = scores["induction"][1:] if model.cfg.n_layers > 1 else scores["induction"]
    recent = losses[-50:]
    return {
        "run": recipe.name, "step": step, "seed": seed,
        "tokens_seen": step * recipe.batch_size * recipe.model.n_ctx,
        "loss": round(float(np.mean(recent)), 4) if recent else round(icl["eval_loss"], 4),
        "eval_loss": round(icl["eval_loss"], 4),
        "icl": round(icl["icl"], 4),
        "induction": round(later.max().item(), 4),  # best head outside layer 0
        "previous": round(scores["previous"][0].max().item(), 4),  # best layer-0 head
        "icl_detail": {k: round(v, 4) if isinstance(v, float) else v for k, v in icl.items()},
        "scores": {k: [[round(x, 4) for x in row] for row in v.tolist()] for k, v in scores.items()},
        "probe": f"{recipe.probe_batch} x (<bos> + 2 x {probe_len} uniform random bytes), seed {EVAL_SEED}",
        "lr": recipe.lr_at(step - 1, steps) if step else 0.0,  # the rate of the last update
    }


def _save_resume(out_dir: Path, key: str, step: int, model, opt, sampler: BatchSampler, losses: list[float],
                 elapsed: float) -> None:
    state = {"key": key, "step": step, "model": model.state_dict(), "opt": opt.state_dict(),
             "rng": json.dumps(sampler.rng.bit_generator.state), "losses": losses, "elapsed": elapsed}
    tmp = out_dir / (RESUME_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out_dir / RESUME_FILE)


def _resume(out_dir: Path, key: str, model, opt, sampler: BatchSampler) -> tuple[int, list[float], float]:
    """Restore the state saved at the last checkpoint; returns (step, losses, elapsed seconds)."""
    state = torch.load(out_dir / RESUME_FILE, weights_only=True)
    if state["key"] != key:
        raise UserError(
            f"{out_dir} holds an unfinished run with other settings (recipe, steps, seed, threads or torch "
            f"version); delete {out_dir / RESUME_FILE} to start over, or choose another output folder"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sampler.rng.bit_generator.state = json.loads(state["rng"])
    return state["step"], list(state["losses"]), float(state["elapsed"])


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


__all__ = [
    "BOS", "Batch", "BatchSampler", "Corpus", "Recipe", "copy_span", "eval_windows", "icl_score", "initial_model",
    "load_corpus",
    "probe_scores", "repeated_random_tokens", "stdlib_files", "train",
]
