"""What a KV-cache policy costs, measured: passkey retrieval (or a needle in real text) and perplexity
through caches whose heads hold what a policy says (`interp.models.kv.policies`), with the bytes held.

    runs = policy_runs("full,kivi4,streaming(4,128),h2o(132)")
    table = passkey_table(model, retrieval_prompts(model, [1024], [0.1, 0.5], 5, seed=0), runs)
    ppl = policy_perplexity(model, text_tokens, runs)           # {label: (perplexity, bytes per token)}
    study.run(PolicyStudy(), model, "out/kv-passkey", PolicySettings(runs=tuple(runs), ...))  # tables + report

Protocol.
- Passkey: each prompt is prefilled once with the full model for every policy whose prefill is the
  full model's (`Policy.shares_prefill`: `PolicyKVCache.absorb` then leaves each cache as its own
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

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from interp.errors import BadValue, as_user_errors, check_int
from interp.models.kv.policies import (WINDOW, Policy, PolicyMap, SubsetPolicy, is_window, parse_policies,
                                       parse_policy, resolve_policies, split_policies)

from .. import plots
from .._common import progress, stages
from ..document import Section, png
from ..study import Measured, Study, StudySettings, Table, fit_default, fit_note
from .tasks import VARIANTS, RetrievalPrompt, accuracy_label, is_correct, retrieval_prompts

DEFAULT_POLICIES = "full,kivi4,kivi2,streaming(4,128),h2o(132),snapkv(132),knorm(132),tova(132)"
COLUMNS = ["policy", "selection", "tokens_per_head", "full_fraction", "seed", "variant", "length", "depth", "correct",
           "n", "accuracy", "perplexity", "bytes_per_token"]


@dataclass(frozen=True)
class PolicyRun:
    """One cache configuration of a study: a label, the policy (one for every head, or a map of
    (layer, kv_head) -> policy with `default` for the rest), the selection that chose the map
    ("all": the same policy everywhere), and two numbers that are not the same thing:

    tokens_per_head  the entries one head holds (`Policy.budget`: H2O's and SnapKV's B, StreamingLLM's
                     sinks + window); None when unbounded or when the heads differ (a selection's map)
    full_fraction    the share of the KV heads a selection keeps `full` (the head-roles study: 0.1,
                     0.25, ...; SnapKV compared "at the bytes of" a share carries that share); None
                     for a policy on every head"""

    label: str
    policy: PolicyMap
    default: str = "full"
    selection: str = "all"
    tokens_per_head: float | None = None
    full_fraction: float | None = None
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
        return [PolicyRun(p.name, p, tokens_per_head=p.budget) for p in policies]
    names = split_policies(policies)
    windows = [n for n in names if is_window(n)]
    if len(windows) > 1:
        raise BadValue("KV-cache policy listed twice: window")
    rest = [n for n in names if not is_window(n)]
    parsed = parse_policies(",".join(rest)) if rest or not windows else []
    runs = [PolicyRun(p.name, p, tokens_per_head=p.budget) for p in parsed]
    if windows:
        runs.insert(names.index(windows[0]), PolicyRun(WINDOW, WINDOW))
    return runs


def protected_counts(runs: Sequence[PolicyRun]) -> dict[str, list[int]]:
    """{label: [first, last]} for every run whose one policy protects its boundaries (`+protect(...)`): the
    tokens at each end it never evicts, resolved against its budget (what settings.json records)."""
    out = {}
    for r in runs:
        if isinstance(r.policy, (str, Policy)) and not is_window(r.policy):
            p = parse_policy(r.policy)
            if isinstance(p, SubsetPolicy) and p.protect is not None:
                out[r.label] = list(p.protected)
    return out


def protect_sentence(labels: Sequence[str]) -> str | None:
    """The report's line on boundary protection: which policies hold their first and last tokens, how many."""
    parts, protecting = [], False
    for label in dict.fromkeys(labels):
        try:
            p = parse_policy(label)
        except BadValue:  # a selection's label ("razor 9/90"), not a policy name
            continue
        if isinstance(p, SubsetPolicy) and p.protect is not None:
            first, last = p.protected
            parts.append(f"{label} never evicts its first {first} and last {last} tokens (inside its {p.budget})")
            protecting = True
        elif isinstance(p, SubsetPolicy) and p.protectable:
            parts.append(f"{label} protects nothing")
    if not protecting:
        return None
    return "Boundary protection (arXiv 2605.18053): " + "; ".join(parts) + "."


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
    """One row per (run, prompt): label, selection, tokens_per_head, full_fraction, selection_seed, full_heads, variant,
    length, depth, seed, key, n_tokens, answer, correct, bytes_per_token. A run with `lengths` answers
    the prompts of those lengths only."""
    check_runs(model, runs, min(_cache_len(p, max_new_tokens) for p in prompts))
    rows = []
    for p in progress(prompts, desc="passkey prompts", enabled=progress_bar):
        mine = [r for r in runs if r.runs_on(p)]
        for a, run in zip(answer(model, p, mine, max_new_tokens), mine):
            rows.append(dict(policy=run.label, selection=run.selection, tokens_per_head=run.tokens_per_head,
                             full_fraction=run.full_fraction, selection_seed=run.seed, full_heads=run.full_heads, variant=p.variant, length=p.length, depth=p.depth,
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
    keys = ["policy", "selection", "tokens_per_head", "full_fraction", "selection_seed", "full_heads", "seed", "variant",
            "length", "depth"]
    optional = ("tokens_per_head", "full_fraction", "selection_seed", "full_heads")
    frame = answers.assign(**{c: (answers[c] if c in answers else None) for c in optional})
    frame = frame.astype({c: "float" for c in optional})
    cells = (frame.groupby(keys, dropna=False, sort=False)
             .agg(correct=("correct", "sum"), n=("correct", "size"), bytes_per_token=("bytes_per_token", "mean"))
             .reset_index())
    cells["correct"] = cells["correct"].astype(int)
    cells["accuracy"] = cells["correct"] / cells["n"]
    cells["perplexity"] = [perplexity.get(p, (math.nan, math.nan))[0] for p in cells["policy"]]
    return cells[COLUMNS + ["selection_seed", "full_heads"]]


# ---- the study ----------------------------------------------------------------------------------
def measure_runs(model, runs: Sequence[PolicyRun], prompts: Sequence[RetrievalPrompt], text_tokens: torch.Tensor, *,
                 max_new_tokens: int = 8, chunk: int = 32, progress_bar: bool | None = None,
                 stage: Callable | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every run's passkey answers and perplexity: (answers, cells as kv_policies.parquet, one summary row
    per run: policy, selection, tokens_per_head, full_fraction, perplexity, bytes_per_token). `stage`: a study's stage timer
    (`study.run`; default: `_common.stages` printing)."""
    stage = stage or stages({})
    answers = stage(f"passkey over {len(prompts)} prompts x {len(runs)} caches",
                    lambda: passkey_table(model, prompts, runs, max_new_tokens=max_new_tokens, progress_bar=progress_bar),
                    key="passkey")
    ppl = stage(f"perplexity over {text_tokens.shape[1]} tokens",
                lambda: policy_perplexity(model, text_tokens, runs, chunk=chunk, progress_bar=progress_bar),
                key="perplexity")
    summary = pd.DataFrame([dict(policy=r.label, selection=r.selection, tokens_per_head=r.tokens_per_head,
                                 full_fraction=r.full_fraction, perplexity=ppl[r.label][0],
                                 bytes_per_token=ppl[r.label][1]) for r in runs])
    return answers, cell_table(answers, ppl), summary


DEFAULT_LENGTHS = (1024, 2048)  # prompt lengths of `interp kv passkey` (fitted to a shorter model's context)
ANSWER_COLUMNS = ("policy", "selection", "tokens_per_head", "full_fraction", "selection_seed", "full_heads", "variant",
                  "length", "depth", "seed", "key", "n_tokens", "answer", "correct", "bytes_per_token")


@dataclass(frozen=True, kw_only=True, eq=False)
class RetrievalSettings(StudySettings):
    """What the retrieval studies share: the prompts (`tasks.retrieval_prompts`: `prompts` per (length,
    depth), keys from `seed`, `variant` passkey or needle; or `prompt_list`, built already) and the
    perplexity text (`data`, one sequence). `lengths` None: the study's defaults, each fitted to the
    model's context (a length asked for past it is refused)."""

    lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    prompts: int = 2
    seed: int = 0
    variant: str = "passkey"
    max_new_tokens: int = 8
    chunk: int = 32
    prompt_list: tuple[RetrievalPrompt, ...] | None = None


def check_retrieval(cfg, s: RetrievalSettings, default_lengths: Sequence[int]) -> tuple[RetrievalSettings, list[str]]:
    """The prompts and the perplexity text against a model's config, before it loads (both studies)."""
    for depth in s.depths:  # nan fails both comparisons
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"--depths {depth:g}: a depth is the fraction of the filler before the needle, "
                             "between 0 (the start) and 1 (right before the question)")
    check_int("--prompts", s.prompts, minimum=1)
    check_int("--new-tokens", s.max_new_tokens, minimum=1)
    check_int("--seed", s.seed, minimum=0)
    if s.variant not in VARIANTS:
        raise ValueError(f"unknown retrieval task {s.variant!r}; choose from {', '.join(VARIANTS)}")
    notes, room = [], cfg.n_ctx - s.max_new_tokens
    lengths = s.lengths
    if lengths is None:
        lengths = tuple(sorted({min(n, room) for n in default_lengths}))
        if max(default_lengths) > room:
            notes.append(fit_note("--lengths", ",".join(map(str, default_lengths)), ",".join(map(str, lengths)),
                                  cfg.n_ctx) + f" (and {s.max_new_tokens} answer tokens)")
    for length in lengths:
        if not 1 <= length <= room:
            raise ValueError(f"--lengths {length}: prompts plus {s.max_new_tokens} answer tokens must fit this model's "
                             f"context (n_ctx={cfg.n_ctx}): use lengths up to {room}")
    s.placement.check_fits(cfg, 1, max(lengths) + s.max_new_tokens, what="--lengths")
    data, note = fit_default(s.data, cfg.n_ctx)
    notes += [note] if note else []
    if data.length > cfg.n_ctx:
        where = f"{data.file}'s rows" if data.file else "--seq-len"
        raise ValueError(f"the perplexity text of {data.length} tokens ({where}) is longer than this model's context "
                         f"(n_ctx={cfg.n_ctx}); use --seq-len {cfg.n_ctx} or shorter rows")
    data.check(cfg.d_vocab)
    return dataclasses.replace(s, lengths=tuple(lengths), data=data), notes


def prompts_of(model, s: RetrievalSettings) -> list[RetrievalPrompt]:
    if s.prompt_list is not None:
        return list(s.prompt_list)
    with as_user_errors(ValueError):  # a tokenizer that cannot hold the prompt: one line
        return retrieval_prompts(model, s.lengths or DEFAULT_LENGTHS, s.depths, s.prompts, s.seed, variant=s.variant)


def prompts_record(prompts: Sequence[RetrievalPrompt]) -> dict:
    """What settings.json says of the prompts."""
    return dict(prompts=len(prompts), lengths=sorted({p.length for p in prompts}),
                depths=sorted({p.depth for p in prompts}))


@dataclass(frozen=True, kw_only=True, eq=False)
class PolicySettings(RetrievalSettings):
    """policies: comma-separated names (`policy_runs`); `runs` settles them (`PolicyStudy.check`: plus
    "window" on a model with sliding-window layers when the policies are the default), or gives them."""

    policies: str = DEFAULT_POLICIES
    runs: tuple[PolicyRun, ...] | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class PolicyMeasured(Measured):
    """Beside the tables: one row per policy (`summary`: perplexity and bytes per token on the text), the runs
    measured and the prompts asked."""

    summary: pd.DataFrame
    runs: list[PolicyRun]
    prompts: list[RetrievalPrompt]


class PolicyStudy(Study):
    """Passkey (or needle) accuracy and perplexity for every policy; writes kv_policies (one row per
    (policy, length, depth)) and kv_passkey_answers (one row per answer)."""

    name = "kv-policies"
    title = "KV-cache policies"
    tables = (Table("kv_policies", (*COLUMNS, "selection_seed", "full_heads")),
              Table("kv_passkey_answers", ANSWER_COLUMNS))

    def uses_kv_cache(self, settings) -> bool:
        return True

    def check(self, cfg, s: PolicySettings):
        runs = list(s.runs) if s.runs is not None else policy_runs(s.policies)
        s, notes = check_retrieval(cfg, s, DEFAULT_LENGTHS)
        if s.runs is None and s.policies == DEFAULT_POLICIES and any(w is not None for w in cfg.windows()):
            runs.insert(1, PolicyRun(WINDOW, WINDOW))  # a windowed model (Gemma): the cache its layers ask for
        for run_ in runs:  # a window or budget beyond the shortest prompt or the text is refused here
            for max_len in (min(s.lengths) + s.max_new_tokens, s.data.length):
                run_.grid_for(cfg, max_len)
        return dataclasses.replace(s, runs=tuple(runs)), notes

    def measure(self, model, s: PolicySettings, stage):
        runs = list(s.runs) if s.runs is not None else policy_runs(s.policies)
        prompts = prompts_of(model, s)
        answers, cells, summary = measure_runs(model, runs, prompts, s.data.tokens(model), chunk=s.chunk,
                                               max_new_tokens=s.max_new_tokens, progress_bar=s.progress, stage=stage)
        return PolicyMeasured(tables={"kv_policies": cells, "kv_passkey_answers": answers}, summary=summary, runs=runs,
                              prompts=prompts)

    def record(self, s: PolicySettings, m: PolicyMeasured) -> dict:
        prompts = m.prompts
        cells = max(1, len({(p.length, p.depth) for p in prompts}))
        return dict(policies=[r.label for r in m.runs], **prompts_record(prompts),
                    prompts_per_cell=max(1, len(prompts) // cells),
                    seeds=sorted({p.seed for p in prompts if p.seed is not None}),
                    variant=sorted({p.variant for p in prompts}), max_new_tokens=s.max_new_tokens,
                    perplexity_tokens=s.data.length, chunk=s.chunk, protected=protected_counts(m.runs))

    def sections(self, s: PolicySettings, m: PolicyMeasured, record) -> list[Section]:
        return policy_sections(s.model, m["kv_policies"], m.summary, m["kv_passkey_answers"],
                               record["data_description"])


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


def policy_sections(name, cells, summary, answers, data) -> list[Section]:
    s = Section("summary", "Summary").add(*headline(name, cells, summary),
                                         protect_sentence(list(summary["policy"])),
                                         f"Perplexity on {data}." if data else None)
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
