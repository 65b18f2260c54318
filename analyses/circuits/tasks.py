"""The tasks circuits are found for, offline: induction on repeated random tokens, indirect-object
identification (IOI, Wang et al. 2022) with names drawn from the model's own single tokens,
greater-than on years (Hanna et al. 2023), and a user's JSON lines. Each builds a `circuit.Task`:
clean and corrupted prompts of equal token length and a per-answer metric.

Metrics (mean over prompts and answer positions):
  logit-diff  mean logit of the answer token(s) - mean logit of the wrong one(s)
  prob        probability of the answer token(s) (summed)
  loss        -log of that probability
  prob-diff   probability of the answers - probability of the wrong ones (greater-than: years after
              the start year minus years up to it)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .graph import Task
from ..heads import repeated_random_tokens

TASKS = ("ioi", "induction", "greater-than")
METRICS = ("logit-diff", "prob", "loss", "prob-diff")

# First names (common in English text); a model keeps those that are one token after a space.
NAMES = ("Mary John Alice Bob Sarah James Emma Michael Anna David Laura Daniel Kate Paul Lisa Mark Susan Peter Linda "
         "Tom Jane Chris Amy Steve Rachel Kevin Emily Brian Julia Jason Helen Eric Grace Adam Sophie Ryan Claire Sam "
         "Lucy Jack Anne Ben Rose Dan Ellen Joe Ruth Tim Maria Matt Karen Max Diana Luke Nancy Carl Jessica Henry "
         "Victoria Frank Martha George Olivia Harry Alex Leo Nina Oscar Eve Paula Ian Clara Owen Irene Roger Ella "
         "Scott Amber Sean Ivy Neil Fiona Joan Bill Greg Jim Alan Tony Andrew Simon Robert William").split()
PLACES = ("store", "park", "school", "office", "beach", "station", "market", "library", "garden", "hospital",
          "restaurant", "museum")
OBJECTS = ("drink", "book", "ball", "letter", "gift", "key", "ring", "bag", "pen", "card", "snack", "note")
# {A} the indirect object, {B} the subject, {S} the subject again (B in a clean prompt); the answer is A
IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {obj} to",
    "When {B} and {A} went to the {place}, {S} gave a {obj} to",
    "After {A} and {B} arrived at the {place}, {S} handed the {obj} to",
    "After {B} and {A} arrived at the {place}, {S} handed the {obj} to",
    "Then, {A} and {B} were working at the {place}. {S} decided to give a {obj} to",
    "Then, {B} and {A} were working at the {place}. {S} decided to give a {obj} to",
    "While {A} and {B} were at the {place}, {S} passed a {obj} to",
    "While {B} and {A} were at the {place}, {S} passed a {obj} to",
)
NOUNS = ("war", "expedition", "project", "reign", "drought", "strike", "dynasty", "campaign", "study", "construction")
GT_TEMPLATE = "The {noun} lasted from the year {century}{yy} to the year {century}"


def token_metric(kind: str, answers: Sequence[Sequence[int]], wrongs: Sequence[Sequence[int]] | None = None):
    """The per-answer metric (logits [n, vocab], index [n]) -> [n] of `kind` (see the module docstring)
    for answers[i] (token ids) and, for logit-diff and prob-diff, wrongs[i]."""
    if kind not in METRICS:
        raise ValueError(f"unknown metric {kind!r}: choose one of {', '.join(METRICS)}")
    if kind in ("logit-diff", "prob-diff") and (wrongs is None or not all(wrongs)):
        raise ValueError(f"the {kind} metric needs wrong answers for every prompt")
    a_ids, a_on = _padded(answers)
    w_ids, w_on = _padded(wrongs) if wrongs is not None and all(wrongs) else (None, None)

    def metric(logits: Tensor, index: Tensor) -> Tensor:
        logits = logits.float()  # scores in float32 whatever the weights' dtype (bf16 models)
        index = index.to(a_ids.device)
        ai, ao = a_ids[index].to(logits.device), a_on[index].to(logits.device)
        if kind == "logit-diff":
            wi, wo = w_ids[index].to(logits.device), w_on[index].to(logits.device)
            mean = lambda ids, on: (logits.gather(1, ids) * on).sum(1) / on.sum(1)
            return mean(ai, ao) - mean(wi, wo)
        logp = logits.log_softmax(-1)
        answer = (logp.gather(1, ai) + (ao - 1) * 1e30).logsumexp(1)  # log of the answers' summed probability
        if kind == "loss":
            return -answer
        if kind == "prob":
            return answer.exp()
        wi, wo = w_ids[index].to(logits.device), w_on[index].to(logits.device)
        return answer.exp() - (logp.gather(1, wi).exp() * wo).sum(1)

    return metric


def _padded(lists: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    k = max(len(x) for x in lists)
    ids = torch.zeros(len(lists), k, dtype=torch.long)
    on = torch.zeros(len(lists), k)
    for i, x in enumerate(lists):
        ids[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        on[i, : len(x)] = 1
    return ids, on


def _right_padded(rows: list[list[int]], pad: int) -> Tensor:
    n = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (n - len(r)) for r in rows], dtype=torch.long)


def _pad_id(model) -> int:
    tok = model.tokenizer
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if (v := getattr(tok, name, None)) is not None:
            return int(v)
    return 0


def _encode(model, text: str) -> list[int]:
    return model.to_tokens(text, truncate=False)[0].tolist()  # never cut here: a long prompt is refused whole


def single_tokens(model, words: Sequence[str]) -> dict[str, int]:
    """{word: id} for the words that are one token after a space (" Mary")."""
    out = {}
    for w in words:
        ids = model.to_tokens(" " + w, prepend_bos=False)[0]
        if ids.numel() == 1:
            out[w] = int(ids)
    return out


def _pairs_task(model, name: str, clean: list[str], corrupted: list[str], answers, wrongs, metric: str,
                description: str, where: Sequence[str] | None = None) -> Task:
    """A task from texts: tokenised whole (the model's BOS rule), lengths checked pair by pair against each
    other and against the model's context (a longer prompt is refused, never cut: its metric would be read at
    the wrong token), right-padded. `where` names each pair in a refusal ("pair 3", "tasks.jsonl:7")."""
    c_rows, x_rows = [_encode(model, t) for t in clean], [_encode(model, t) for t in corrupted]
    n_ctx = model.cfg.n_ctx
    for i, (c, x) in enumerate(zip(c_rows, x_rows)):
        at = where[i] if where else f"pair {i + 1}"
        if max(len(c), len(x)) > n_ctx:
            which, n = ("clean", len(c)) if len(c) >= len(x) else ("corrupted", len(x))
            raise ValueError(f"{at}: the {which} prompt is {n} tokens, longer than the model's context of {n_ctx} "
                             "tokens: shorten it (nothing is cut for you: the metric would be read at the wrong token)")
        if len(c) != len(x):
            raise ValueError(f"{at}: the corrupted prompt is {len(x)} tokens and the clean one {len(c)} "
                             f"({clean[i]!r} vs {corrupted[i]!r}); corrupted prompts must have the clean ones' "
                             "token lengths")
    pad = _pad_id(model)
    rows = torch.arange(len(c_rows))
    positions = torch.tensor([len(c) - 1 for c in c_rows])
    return Task(name, _right_padded(c_rows, pad), _right_padded(x_rows, pad), rows, positions,
                token_metric(metric, answers, wrongs), metric, description, prompts=list(clean),
                answer_tokens=torch.tensor([a[0] for a in answers]),
                wrong_tokens=torch.tensor([w[0] for w in wrongs]) if wrongs else None)


def ioi_task(model, n_prompts: int = 64, *, seed: int = 0, metric: str = "logit-diff") -> Task:
    """IOI: "When Mary and John went to the store, John gave a drink to" -> " Mary" (not " John"), in 8
    templates (ABBA and BABA orders); corrupted (ABC): the same sentence with three other names, so the
    subject no longer repeats. Names are those of `NAMES` that are single tokens of the model."""
    names = list(single_tokens(model, NAMES))
    if len(names) < 5:
        raise ValueError(f"IOI needs at least 5 first names that are single tokens of this model's vocabulary, "
                         f"found {len(names)}")
    ids = single_tokens(model, names)
    rng = random.Random(seed)
    clean, corrupted, answers, wrongs = [], [], [], []
    for i in range(n_prompts):
        a, b, c, d, e = rng.sample(names, 5)
        t = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
        place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
        clean.append(t.format(A=a, B=b, S=b, place=place, obj=obj))
        corrupted.append(t.format(A=c, B=d, S=e, place=place, obj=obj))
        answers.append([ids[a]])
        wrongs.append([ids[b]])
    return _pairs_task(model, "ioi", clean, corrupted, answers, wrongs, metric,
                       f"IOI, {n_prompts} prompts in {len(IOI_TEMPLATES)} templates, {len(names)} single-token names; "
                       "corrupted: three other names (ABC)")


def induction_task(model, n_prompts: int = 64, seq_len: int = 20, *, seed: int = 0, metric: str = "logit-diff") -> Task:
    """Induction on repeated random tokens: BOS (when the model prepends one), a random sequence of
    `seq_len` tokens, and the same sequence again; the answers are the second copy's next tokens.
    Corrupted: another repeated random sequence. The wrong answer (logit-diff) is the corrupted
    sequence's next token at the same position."""
    bos = getattr(model.tokenizer, "bos_token_id", None) if model.cfg.default_prepend_bos else None
    clean = repeated_random_tokens(model.cfg.d_vocab, seq_len, 2, n_prompts, seed=seed, bos_token_id=bos)
    corrupted = repeated_random_tokens(model.cfg.d_vocab, seq_len, 2, n_prompts, seed=seed + 10_000, bos_token_id=bos)
    off = int(bos is not None)
    pos = torch.arange(off + seq_len, off + 2 * seq_len - 1)
    rows = torch.arange(n_prompts).repeat_interleave(len(pos))
    positions = pos.repeat(n_prompts)
    answers = clean[rows, positions + 1][:, None].tolist()
    wrongs = corrupted[rows, positions + 1][:, None].tolist()
    return Task("induction", clean, corrupted, rows, positions, token_metric(metric, answers, wrongs), metric,
                f"induction: {n_prompts} x (a random sequence of {seq_len} tokens, twice); corrupted: another "
                "repeated random sequence", answer_tokens=torch.tensor([a[0] for a in answers]),
                wrong_tokens=torch.tensor([w[0] for w in wrongs]))


def greater_than_task(model, n_prompts: int = 64, *, seed: int = 0, metric: str = "prob-diff") -> Task:
    """Greater-than: "The war lasted from the year 1732 to the year 17" -> a year after 32. The answers
    are the next tokens that make a later year, the wrong ones those that make it the same or earlier:
    two-digit tokens ("33".."99" vs "00".."32") where the tokenizer has them, else the tens digit
    ("4".."9" vs "0".."2"; the equal digit is left out). Corrupted: the start year ..01 (Hanna et al.)."""
    century = "17"
    probe = GT_TEMPLATE.format(noun="war", century=century, yy="00")  # ends "... to the year 17"
    prefix = _encode(model, probe)
    nxt = {}
    for yy in range(100):  # how the end year continues the prompt
        full = _encode(model, probe + f"{yy:02d}")
        if full[: len(prefix)] != prefix or len(full) <= len(prefix):
            raise ValueError("greater-than: this tokenizer does not continue the prompt with the year's digits")
        nxt[yy] = full[len(prefix)]
    strings = {yy: model.to_string([t]).strip() for yy, t in nxt.items()}
    if all(strings[yy] == f"{yy:02d}" for yy in range(100)):
        mode, choices = "two-digit", list(range(2, 99))
        greater = lambda yy: [nxt[y] for y in range(yy + 1, 100)]
        lesser = lambda yy: [nxt[y] for y in range(0, yy + 1)]
    elif all(strings[yy] == f"{yy:02d}"[0] for yy in range(100)):
        mode, choices = "tens digit", [y for y in range(10, 90) if y % 10 != 0]
        digit = {d: nxt[10 * d] for d in range(10)}
        greater = lambda yy: [digit[d] for d in range(yy // 10 + 1, 10)]
        lesser = lambda yy: [digit[d] for d in range(0, yy // 10)]
    else:
        raise ValueError("greater-than: this tokenizer splits years neither into two-digit tokens nor into digits")
    rng = random.Random(seed)
    clean, corrupted, answers, wrongs = [], [], [], []
    while len(clean) < n_prompts:
        yy, noun = rng.choice(choices), rng.choice(NOUNS)
        c = GT_TEMPLATE.format(noun=noun, century=century, yy=f"{yy:02d}")
        x = GT_TEMPLATE.format(noun=noun, century=century, yy="01")
        if len(_encode(model, c)) != len(_encode(model, x)):
            continue
        clean.append(c)
        corrupted.append(x)
        answers.append(greater(yy))
        wrongs.append(lesser(yy))
    return _pairs_task(model, "greater-than", clean, corrupted, answers, wrongs, metric,
                       f"greater-than, {n_prompts} prompts ({mode} answers); corrupted: the start year ..01")


# ---- a user's file ------------------------------------------------------------------------------------
LINE = "_line"  # where a pair of a task file stands ("tasks.jsonl:7"), named by a refusal


def read_task_file(path) -> list[dict]:
    """The pairs of a JSON-lines file: one object per line with "clean", "corrupted", "answer" (a string or
    a list of strings) and optionally "wrong" (the same). Checked before any model loads; one line says
    what is wrong and where."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file (a JSON-lines file, or one of {', '.join(TASKS)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the task file as UTF-8") from None
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        except RecursionError:  # [[[[...]]]] a hundred thousand deep
            raise ValueError(f"{path}:{n}: JSON nested too deeply to be a pair (one object per line)") from None
        if not isinstance(row, dict) or not {"clean", "corrupted", "answer"} <= row.keys():
            raise ValueError(f'{path}:{n}: each line needs "clean", "corrupted" and "answer" (and may give "wrong")')
        for key in ("answer", "wrong"):
            if key in row:
                v = row[key]
                if isinstance(v, str):
                    row[key] = [v]
                elif not (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
                    raise ValueError(f'{path}:{n}: "{key}" must be a string or a list of strings')
        if not all(isinstance(row[k], str) for k in ("clean", "corrupted")):
            raise ValueError(f'{path}:{n}: "clean" and "corrupted" must be strings')
        row[LINE] = f"{path.name}:{n}"
        pairs.append(row)
    if not pairs:
        raise ValueError(f"{path} holds no pairs")
    if len({"wrong" in p for p in pairs}) > 1:
        raise ValueError(f'{path}: give "wrong" on every line or on none')
    return pairs


def file_task(model, pairs: list[dict], *, metric: str | None = None, name: str = "file") -> Task:
    """A task from `read_task_file`'s pairs. Metric default: logit-diff when wrong answers are given,
    else loss."""
    has_wrong = "wrong" in pairs[0]
    metric = metric or ("logit-diff" if has_wrong else "loss")

    def one(s: str, n: int, key: str) -> int:
        ids = model.to_tokens(s, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise ValueError(f'pair {n}: the {key} {s!r} is {ids.numel()} tokens; answers must be single tokens '
                             f'(often with a leading space: " Paris")')
        return int(ids)

    answers = [[one(s, n, "answer") for s in p["answer"]] for n, p in enumerate(pairs, 1)]
    wrongs = [[one(s, n, "wrong answer") for s in p["wrong"]] for n, p in enumerate(pairs, 1)] if has_wrong else None
    return _pairs_task(model, name, [p["clean"] for p in pairs], [p["corrupted"] for p in pairs], answers, wrongs,
                       metric, f"{len(pairs)} pairs from {name}",
                       where=[p.get(LINE, f"pair {n}") for n, p in enumerate(pairs, 1)])


def build_task(model, task: str, *, n_prompts: int | None = None, seed: int = 0, metric: str | None = None) -> Task:
    """One of `TASKS`, or the path of a JSON-lines file."""
    if task == "ioi":
        return ioi_task(model, n_prompts or 64, seed=seed, metric=metric or "logit-diff")
    if task == "induction":
        return induction_task(model, n_prompts or 64, seed=seed, metric=metric or "logit-diff")
    if task == "greater-than":
        return greater_than_task(model, n_prompts or 64, seed=seed, metric=metric or "prob-diff")
    pairs = read_task_file(task)
    return file_task(model, pairs[:n_prompts] if n_prompts else pairs, metric=metric, name=Path(task).name)
