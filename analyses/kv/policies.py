"""What a KV-cache policy costs, measured: passkey retrieval (or a needle in real text) and perplexity
through caches whose heads hold what a policy says (`interp.models.kv.policies`), with the bytes held.

    runs = policy_runs("full,kivi4,streaming(4,128),h2o(132)")
    table = passkey_table(model, retrieval_prompts(model, [1024], [0.1, 0.5], 5, seed=0), runs)
    ppl = policy_perplexity(model, text_tokens, runs)           # {label: (perplexity, bytes per token)}
    run_policy_study(model, "out/kv-passkey", runs=runs, ...)   # kv_policies.parquet + report

Protocol.
- Passkey: each prompt is prefilled once with the full model for every policy whose prefill is the
  full model's (full, KIVI, H2O, SnapKV: `PolicyKVCache.absorb` then leaves each cache as its own
  prefill would), and on its own for the others (streaming attends through its window, per-vector
  quantized caches read their own codes); then `max_new_tokens` greedy tokens are decoded through
  the policy's cache. Correct when the key appears in the continuation (`tasks.is_correct`).
- Perplexity: the text's first `prefix` tokens are prefilled (as above), the rest is fed through the
  cache in chunks that end at multiples of `chunk` (the first one shorter when `prefix` is not a
  multiple: positions prefix..c-1, c..c+chunk-1, ...; teacher forcing), and the loss counts the fed
  positions only, where the cache's compression acts. Chunks of KIVI's residual length (32), aligned
  so, make KIVI's numbers those of token-by-token decoding exactly at any prefix (unaligned chunks
  would read a flushed group in full precision); streaming is exact at any chunk; H2O evicts once per
  chunk.
- Bytes per token: `PolicyKVCache.bytes_per_token()` at the end of the sequence: what is held
  (codes, scales, kept keys and values, their slots), over the tokens seen.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from interp.models.errors import BadValue
from interp.models.kv.policies import WINDOW, Policy, PolicyMap, is_window, parse_policies, resolve_policies, split_policies

from .. import plots
from .._common import progress, stages
from ..document import Section, png, write_document
from ..store import OutputFolder, atomic_write_text
from ..sweep_data import source_line
from .tasks import RetrievalPrompt, accuracy_label, is_correct

DEFAULT_POLICIES = "full,kivi4,kivi2,streaming(4,128),h2o(132),snapkv(132),knorm(132),tova(132)"
COLUMNS = ["policy", "selection", "budget", "seed", "variant", "length", "depth", "correct", "n", "accuracy",
           "perplexity", "bytes_per_token"]


@dataclass(frozen=True)
class PolicyRun:
    """One cache configuration of a study: a label, the policy (one for every head, or a map of
    (layer, kv_head) -> policy with `default` for the rest), the selection that chose the map
    ("all": the same policy everywhere) and its token budget per head (None: unbounded)."""

    label: str
    policy: PolicyMap
    default: str = "full"
    selection: str = "all"
    budget: float | None = None
    seed: int | None = None  # the seed that drew a random selection
    full_heads: int | None = None  # KV heads kept full by a selection
    lengths: tuple[int, ...] | None = None  # evaluate on prompts of these lengths only (None: all)

    def runs_on(self, prompt) -> bool:
        return self.lengths is None or prompt.length in self.lengths

    def grid(self, model, max_len: int) -> list[list[Policy]]:
        return self.grid_for(model.cfg, max_len)

    def grid_for(self, cfg, max_len: int) -> list[list[Policy]]:
        """The policy of every (layer, KV head) for a model of config `cfg` (checked: the CLI calls it
        before loading the model)."""
        return resolve_policies(self.policy, cfg.n_layers, cfg.kv_heads, default=self.default, max_len=max_len,
                                d_head=cfg.head_dim, windows=cfg.windows())

    def shares_prefill(self, model, max_len: int) -> bool:
        return all(p.shares_prefill for row in self.grid(model, max_len) for p in row)

    def needs_queries(self, model, max_len: int) -> bool:
        return any(p.reads_queries for row in self.grid(model, max_len) for p in row)

    def cache(self, model, max_len: int):
        return model.new_kv_cache(1, max_len, policy=self.policy, default=self.default)


def policy_runs(policies: str | Sequence[Policy]) -> list[PolicyRun]:
    """One run per policy, every head alike: from "full,kivi4,streaming(4,128)" or Policy objects.
    "window" is the cache each layer's own window asks for (`WINDOW`: Gemma's local layers keep their
    last 512 positions, the global ones every token)."""
    if not isinstance(policies, str):
        return [PolicyRun(p.name, p, budget=p.budget) for p in policies]
    names = split_policies(policies)
    windows = [n for n in names if is_window(n)]
    if len(windows) > 1:
        raise BadValue("KV-cache policy listed twice: window")
    rest = [n for n in names if not is_window(n)]
    parsed = parse_policies(",".join(rest)) if rest or not windows else []
    runs = [PolicyRun(p.name, p, budget=p.budget) for p in parsed]
    if windows:
        runs.insert(names.index(windows[0]), PolicyRun(WINDOW, WINDOW))
    return runs


def check_runs(model, runs: Sequence[PolicyRun], max_len: int) -> None:
    """Every run's policies against a cache of `max_len` tokens (the shortest the study makes), before any work."""
    if not runs:
        raise ValueError("no KV-cache policy to measure")
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs share a label: {labels}")
    for r in runs:
        r.grid(model, max_len)


# ---- shared prefill -------------------------------------------------------------------------------
PREFILL_CHUNK = 1024  # tokens per piece of a prefill that cannot be shared (a policy that attends through its window)

class _Prefill:
    """One full prefill of a prompt, absorbed by every run whose prefill is the full model's."""

    def __init__(self, model, tokens: torch.Tensor, runs: Sequence[PolicyRun], max_len: int) -> None:
        self.model, self.tokens, self.max_len = model, tokens, max_len
        shared = [r for r in runs if r.shares_prefill(model, max_len)]
        self.full = self.logits = None
        if shared:
            queries = any(r.needs_queries(model, max_len) for r in shared)
            self.full = model.new_kv_cache(1, tokens.shape[1], capture_queries=queries)
            self.logits = self._last_logits(self.full)

    def _last_logits(self, cache, chunk: int | None = None) -> torch.Tensor:
        """Prefill through the blocks (in pieces of `chunk` tokens when given), then unembed the last position only."""
        model, tokens = self.model, self.tokens
        step = tokens.shape[1] if chunk is None else chunk
        for s in range(0, tokens.shape[1], step):
            resid = model(tokens[:, s:s + step], kv_cache=cache, stop_at_layer=model.cfg.n_layers)
        return model(resid[:, -1:], start_at_layer=model.cfg.n_layers)[:, -1]

    def cache_for(self, run: PolicyRun):
        """(run's cache holding the prompt, the prompt's last logits)."""
        cache = run.cache(self.model, self.max_len)
        if self.full is not None and run.shares_prefill(self.model, self.max_len):
            cache.absorb(self.full, self.model)
            return cache, self.logits
        # A cache whose heads hold different tokens (streaming, each layer's window) attends with a mask given
        # outright, [n, held] per query head: in pieces of PREFILL_CHUNK the held entries stay its budget (what
        # the whole prompt at once keeps: sinks and the window) and the mask [chunk, budget + chunk], not
        # [n, n] (4 GiB at 32k). Quantized caches (KIVI's residual depends on it) prefill whole.
        subset = any(not g.contiguous for layer in getattr(cache, "groups", ()) for g in layer)
        return cache, self._last_logits(cache, chunk=PREFILL_CHUNK if subset else None)


def _cache_len(prompt: RetrievalPrompt, max_new_tokens: int) -> int:
    """A prompt's cache size: its requested length (its tokens are a unit or so fewer) plus the answer,
    so a policy is checked against the length asked for, as the CLI checks it before any prompt exists."""
    return max(prompt.n_tokens, prompt.length) + max_new_tokens


@torch.no_grad()
def answer(model, prompt: RetrievalPrompt, runs: Sequence[PolicyRun], max_new_tokens: int = 8) -> list[dict]:
    """Greedy answers to one prompt through each run's cache: [{label, text, correct, bytes_per_token}]."""
    prefill = _Prefill(model, prompt.tokens, runs, _cache_len(prompt, max_new_tokens))
    out = []
    for run in runs:
        cache, logits = prefill.cache_for(run)
        ids = []
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)
            ids.append(int(nxt))
            if step < max_new_tokens - 1:
                logits = model(nxt[:, None], kv_cache=cache)[:, -1]
        text = model.tokenizer.decode(ids)
        out.append(dict(label=run.label, text=text, correct=is_correct(text, prompt.key),
                        bytes_per_token=cache.bytes_per_token()))
    return out


def passkey_table(model, prompts: Sequence[RetrievalPrompt], runs: Sequence[PolicyRun], *, max_new_tokens: int = 8,
                  progress_bar: bool | None = None) -> pd.DataFrame:
    """One row per (run, prompt): label, selection, budget, selection_seed, full_heads, variant,
    length, depth, seed, key, n_tokens, answer, correct, bytes_per_token. A run with `lengths` answers
    the prompts of those lengths only."""
    check_runs(model, runs, min(_cache_len(p, max_new_tokens) for p in prompts))
    rows = []
    for p in progress(prompts, desc="passkey prompts", enabled=progress_bar):
        mine = [r for r in runs if r.runs_on(p)]
        for a, run in zip(answer(model, p, mine, max_new_tokens), mine):
            rows.append(dict(policy=run.label, selection=run.selection, budget=run.budget, selection_seed=run.seed,
                             full_heads=run.full_heads, variant=p.variant, length=p.length, depth=p.depth,
                             seed=p.seed, key=p.key, n_tokens=p.n_tokens, answer=a["text"], correct=a["correct"],
                             bytes_per_token=a["bytes_per_token"]))
    return pd.DataFrame(rows)


@torch.no_grad()
def policy_perplexity(model, tokens: torch.Tensor, runs: Sequence[PolicyRun], *, prefix: int | None = None,
                      chunk: int = 32, progress_bar: bool | None = None) -> dict[str, tuple[float, float]]:
    """{label: (perplexity, bytes per token)} over `tokens` [1, T] (module docstring: the first
    `prefix` tokens, default T // 2, prefilled; the rest fed in chunks; loss on the fed positions)."""
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"policy_perplexity takes one sequence [1, T], got {tuple(tokens.shape)}")
    t = tokens.shape[1]
    prefix = t // 2 if prefix is None else prefix
    if not 1 <= prefix < t - 1:
        raise ValueError(f"prefix must leave tokens to feed: 1 <= prefix < {t - 1}, got {prefix}")
    check_runs(model, runs, t)
    prefill = _Prefill(model, tokens[:, :prefix], runs, t)
    out = {}
    for run in progress(runs, desc="perplexity", enabled=progress_bar):
        cache, _ = prefill.cache_for(run)
        losses = []
        starts = [prefix, *range((prefix // chunk + 1) * chunk, t, chunk)]  # chunks end at multiples of `chunk`
        for a, b in zip(starts, [*starts[1:], t]):
            logits = model(tokens[:, a:b], kv_cache=cache)[0]
            targets = tokens[0, a + 1 : b + 1]
            losses.append(F.cross_entropy(logits[: len(targets)].float(), targets, reduction="none"))
        loss = torch.cat(losses)
        if not torch.isfinite(loss).all():
            raise FloatingPointError(f"{run.label}: the loss is not finite: NaN or inf is an error, not a perplexity")
        out[run.label] = (math.exp(float(loss.mean())), cache.bytes_per_token())
    return out


def cell_table(answers: pd.DataFrame, perplexity: Mapping[str, tuple[float, float]]) -> pd.DataFrame:
    """kv_policies.parquet: one row per (policy, length, depth) with the count of correct answers
    (`correct` of `n`), accuracy = correct / n, the policy's perplexity, and the bytes per token held
    at the end of those prompts (mean)."""
    keys = ["policy", "selection", "budget", "selection_seed", "full_heads", "seed", "variant", "length", "depth"]
    frame = answers.assign(**{c: (answers[c] if c in answers else None) for c in ("selection_seed", "full_heads")})
    frame = frame.astype({c: "float" for c in ("budget", "selection_seed", "full_heads")})
    cells = (frame.groupby(keys, dropna=False, sort=False)
             .agg(correct=("correct", "sum"), n=("correct", "size"), bytes_per_token=("bytes_per_token", "mean"))
             .reset_index())
    cells["correct"] = cells["correct"].astype(int)
    cells["accuracy"] = cells["correct"] / cells["n"]
    cells["perplexity"] = [perplexity.get(p, (math.nan, math.nan))[0] for p in cells["policy"]]
    return cells[COLUMNS + ["selection_seed", "full_heads"]]


# ---- the study ----------------------------------------------------------------------------------
def measure_runs(model, runs: Sequence[PolicyRun], prompts: Sequence[RetrievalPrompt], text_tokens: torch.Tensor, *,
                 max_new_tokens: int = 8, chunk: int = 32, progress_bar: bool | None = None, log=print,
                 timings: dict | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every run's passkey answers and perplexity: (answers, cells as kv_policies.parquet, one summary row
    per run: policy, selection, budget, perplexity, bytes_per_token). Stage times go into `timings`."""
    stage = stages({} if timings is None else timings, log)
    answers = stage(f"passkey over {len(prompts)} prompts x {len(runs)} caches",
                    lambda: passkey_table(model, prompts, runs, max_new_tokens=max_new_tokens, progress_bar=progress_bar),
                    key="passkey")
    ppl = stage(f"perplexity over {text_tokens.shape[1]} tokens",
                lambda: policy_perplexity(model, text_tokens, runs, chunk=chunk, progress_bar=progress_bar),
                key="perplexity")
    summary = pd.DataFrame([dict(policy=r.label, selection=r.selection, budget=r.budget, perplexity=ppl[r.label][0],
                                 bytes_per_token=ppl[r.label][1]) for r in runs])
    return answers, cell_table(answers, ppl), summary


def run_policy_study(model, out, *, runs: Sequence[PolicyRun], prompts: Sequence[RetrievalPrompt],
                     text_tokens: torch.Tensor, name: str = "model", data_description: str = "",
                     max_new_tokens: int = 8, chunk: int = 32, progress_bar: bool | None = None,
                     log=print, data_source: dict | None = None) -> Path:
    """Passkey (or needle) accuracy and perplexity for every run; writes kv_policies.parquet,
    kv_passkey_answers.parquet, settings.json, report.html / report.md and figures/ into `out` (an
    `OutputFolder`: only files interp wrote there are ever replaced). Returns the report's path.
    `data_source` (`sweep_data.data_source`) names the perplexity text by sha256 (settings.json, report)."""
    folder = OutputFolder(out)
    folder.check()  # before any heavy work
    timings = {}
    answers, cells, summary = measure_runs(model, runs, prompts, text_tokens, max_new_tokens=max_new_tokens,
                                           chunk=chunk, progress_bar=progress_bar, log=log, timings=timings)
    settings = dict(model=name, data=data_description, data_source=data_source, policies=[r.label for r in runs],
                    prompts=len(prompts), prompts_per_cell=max(1, len(prompts) // max(1, len(
                        {(p.length, p.depth) for p in prompts}))), lengths=sorted({p.length for p in prompts}),
                    depths=sorted({p.depth for p in prompts}), seeds=sorted({p.seed for p in prompts if p.seed is not None}),
                    variant=sorted({p.variant for p in prompts}), max_new_tokens=max_new_tokens,
                    perplexity_tokens=int(text_tokens.shape[1]), chunk=chunk, seconds=timings)
    sections = policy_sections(name, cells, summary, answers, data_description, timings)
    if data_source is not None:
        sections[0].add(source_line(data_source))
    with folder.writing():
        folder.claim("kv_policies.parquet", "kv_passkey_answers.parquet", "settings.json")
        cells.to_parquet(Path(out) / "kv_policies.parquet", index=False)
        answers.to_parquet(Path(out) / "kv_passkey_answers.parquet", index=False)
        atomic_write_text(Path(out) / "settings.json", json.dumps(settings, indent=2))
        return write_document(out, f"KV-cache policies: {name}", sections, folder=folder)


def headline(name: str, cells: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    """Sentences read off the data: the full cache's accuracy per length, every other policy's bytes,
    accuracy and perplexity against it."""
    variant = "pass key" if set(cells["variant"]) == {"passkey"} else "needle's key"
    acc = cells.groupby(["policy", "length"], sort=False)[["correct", "n"]].sum()
    lengths = sorted(cells["length"].unique())

    def counts(policy):
        return ", ".join(f"{accuracy_label(int(acc.loc[(policy, L), 'correct']), int(acc.loc[(policy, L), 'n']))} at "
                         f"{L} tokens" for L in lengths if (policy, L) in acc.index)

    by = summary.set_index("policy")
    base = "full" if "full" in by.index else by.index[0]
    lines = [f"{name} finds the {variant} with the {base} cache in {counts(base)}."]
    for p in by.index:
        if p == base:
            continue
        ratio = by.loc[p, "bytes_per_token"] / by.loc[base, "bytes_per_token"]
        d = by.loc[p, "perplexity"] / by.loc[base, "perplexity"] - 1
        lines.append(f"{p}: {ratio:.2f}x the {base} cache's bytes per token, perplexity {d:+.1%}, {counts(p)}.")
    return lines


def policy_sections(name, cells, summary, answers, data, timings) -> list[Section]:
    s = Section("summary", "Summary").add(*headline(name, cells, summary),
                                         f"Perplexity on {data}." if data else None,
                                         "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ".")
    by_len = (cells.groupby(["policy", "length"], sort=False)[["correct", "n"]].sum().reset_index())
    table = by_len.assign(accuracy=[accuracy_label(c, n) for c, n in zip(by_len["correct"], by_len["n"])]).pivot(
        index="policy", columns="length", values="accuracy")
    table.columns = [f"passkey @ {c}" for c in table.columns]
    table = summary.set_index("policy")[["perplexity", "bytes_per_token"]].join(table).reset_index()
    base = summary["bytes_per_token"].iloc[0]
    table.insert(3, "bytes vs first", (table["bytes_per_token"] / base).round(3))
    table["perplexity"] = table["perplexity"].round(4)
    table["bytes_per_token"] = table["bytes_per_token"].round(0).astype(int)
    main = Section("policies", "Policies side by side").add(
        "Each policy on every KV head. Accuracy as k of n prompts (greedy decoding; correct when the key appears); "
        "perplexity of the text's second half fed through the cache after a prefill of its first half; bytes per "
        "token held at the end of that text (codes, scales, kept keys and values, their slots; "
        "kv_policies.parquet gives the bytes held at the end of each passkey answer instead).",
        table, png(plots.policy_tradeoff(cells, summary), "kv_policies.png"))
    depth = cells.groupby(["policy", "depth"], sort=False)[["correct", "n"]].sum().reset_index()
    order = list(dict.fromkeys(cells["policy"]))  # as the policies were given
    depth = depth.assign(accuracy=[accuracy_label(c, n) for c, n in zip(depth["correct"], depth["n"])]).pivot(
        index="policy", columns="depth", values="accuracy").reindex(order).reset_index()
    depth.columns = ["policy"] + [f"depth {c:g}" for c in depth.columns[1:]]
    depths = Section("depths", "By depth of the needle").add("Accuracy over lengths, by where the key sits (0: start).",
                                                             depth)
    wrong = answers[~answers["correct"]].head(12)[["policy", "length", "depth", "key", "answer"]]
    examples = Section("answers", "Wrong answers (first 12)").add(
        wrong if len(wrong) else "Every answer was correct.")
    return [s, main, depths, examples]
