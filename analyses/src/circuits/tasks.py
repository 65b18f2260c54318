"""The tasks circuits are found for, offline: induction on repeated random tokens, indirect-object
identification (IOI, Wang et al. 2022) with names drawn from the model's own single tokens,
greater-than on years (Hanna et al. 2023), a user's JSON lines (`read_task_file`, `file_task`) and a
user's tensors (`tensor_task`). Each builds a `circuit.Task`: clean and corrupted prompts of equal token
length, the (prompt, position) pairs where the logits are read, and a per-position metric.

Metrics: each is read at every answer position (the logits there, which predict the token after it) and
the task's metric is their mean over all positions of all prompts (a prompt with more positions weighs
more). Which way each goes, for the clean run against a corrupted one that destroys the behaviour:
  logit-diff  mean logit of the answer token(s) - mean logit of the wrong one(s); higher is more of the
              behaviour (the clean run's is higher)
  logit       mean logit of the answer token(s); higher is more
  prob        probability of the answer token(s) (summed); higher is more
  loss        -log of that probability; LOWER is more (the clean run's is lower)
  prob-diff   probability of the answers - probability of the wrong ones (greater-than: years after
              the start year minus years up to it); higher is more
  kl          KL(clean || run): the KL divergence of this run's next-token distribution from the clean
              run's at the same position, in nats; 0 on the clean run and HIGHER is further from it. It
              needs no answers. Its gradient at the clean run is 0 (KL is least there), so EAP, which takes
              the gradient there, scores every edge 0 and is refused; EAP-IG and exact patching read it.
Scores are metric(patched) - metric(clean) whatever the metric, so their sign follows the metric's
direction (an edge that carries the behaviour scores negative under logit, prob and logit-diff, positive
under loss and kl); faithfulness is signless (1 the model, 0 the corrupted run).
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
METRICS = ("logit-diff", "logit", "prob", "loss", "prob-diff", "kl")
NEEDS_WRONG = ("logit-diff", "prob-diff")  # the metrics that read wrong answers

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
    for answers[i] (token ids) and, for logit-diff and prob-diff, wrongs[i]. (kl reads the clean run, not
    answers: `kl_metric`.)"""
    if kind not in METRICS:
        raise ValueError(f"unknown metric {kind!r}: choose one of {', '.join(METRICS)}")
    if kind == "kl":
        raise ValueError("the kl metric compares with the clean run, not with answers: build it with kl_metric(model, "
                         "clean, rows, positions)")
    if kind in NEEDS_WRONG and (wrongs is None or not all(wrongs)):
        raise ValueError(f"the {kind} metric needs wrong answers for every prompt")
    a_ids, a_on = _padded(answers)
    w_ids, w_on = _padded(wrongs) if wrongs is not None and all(wrongs) else (None, None)

    def metric(logits: Tensor, index: Tensor) -> Tensor:
        logits = logits.float()  # scores in float32 whatever the weights' dtype (bf16 models)
        index = index.to(a_ids.device)
        ai, ao = a_ids[index].to(logits.device), a_on[index].to(logits.device)
        mean = lambda ids, on: (logits.gather(1, ids) * on).sum(1) / on.sum(1)  # noqa: E731
        if kind == "logit":
            return mean(ai, ao)
        if kind == "logit-diff":
            wi, wo = w_ids[index].to(logits.device), w_on[index].to(logits.device)
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


def kl_metric(model, clean: Tensor, rows: Tensor, positions: Tensor, *, batch_size: int = 16):
    """The per-answer metric (logits [n, vocab], index [n]) -> [n] KL(clean || run) at each answer position
    (rows[i], positions[i]) of the `clean` prompts [batch, pos], in nats. It keeps the clean run's final
    residual stream at those positions ([n, d_model], from a plain forward now) and unembeds it when it
    compares, rather than holding [n, vocab] log-probabilities."""
    L = model.cfg.n_layers
    kept = []
    with torch.no_grad():
        for start in range(0, clean.shape[0], batch_size):
            on = (rows >= start) & (rows < start + batch_size)
            final = model(clean[start:start + batch_size].to(model.device), stop_at_layer=L)
            kept.append(final[(rows[on] - start).to(final.device), positions[on].to(final.device)])
    reference = torch.cat(kept)  # in chunk order; put back in the answers' order
    order = torch.cat([((rows >= s) & (rows < s + batch_size)).nonzero().flatten()
                       for s in range(0, clean.shape[0], batch_size)])
    reference = reference[order.argsort().to(reference.device)]

    def metric(logits: Tensor, index: Tensor) -> Tensor:
        with torch.no_grad():
            ref = model(reference[index.to(reference.device)][:, None], "logits", start_at_layer=L)[:, 0]
            ref = ref.float().log_softmax(-1).to(logits.device)
        logp = logits.float().log_softmax(-1)
        return (ref.exp() * (ref - logp)).sum(-1)

    return metric


def task_metric(model, kind: str, clean: Tensor, rows: Tensor, positions: Tensor, answers=None, wrongs=None):
    """`kl_metric` for "kl", else `token_metric`: the metric of any kind for a task's answer positions."""
    if kind == "kl":
        return kl_metric(model, clean, rows, positions)
    if answers is None or not all(a is not None for a in answers):
        raise ValueError(f"the {kind} metric needs an answer at every position (only kl reads none)")
    return token_metric(kind, answers, wrongs)


def context(cfg) -> int:
    """The longest prompt the model of `cfg` reads: its n_ctx, or, under a RoPE scaling that stretches it (a factor f
    on an original length L, `interp.models.rope.choice`: f * L), that, when longer. A checkpoint whose n_ctx is its
    scaled context already (Llama 3.1: 131,072 from 8 x 8,192) keeps it."""
    s = getattr(cfg, "rope_scaling", None)
    if s is None or cfg.positional != "rotary":
        return cfg.n_ctx
    return max(cfg.n_ctx, int(s.factor * (s.original_max_position or cfg.n_ctx)))


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
    """A task from texts, answered at each prompt's last token: tokenised whole (the model's BOS rule), then
    `_token_task`. `where` names each pair in a refusal ("pair 3", "tasks.jsonl:7")."""
    spots = [[(-1, answers[i], wrongs[i] if wrongs else None)] for i in range(len(clean))]
    return _token_task(model, name, [_encode(model, t) for t in clean], [_encode(model, t) for t in corrupted], spots,
                       metric, description, where, texts=list(zip(clean, corrupted)))


def _check_prompts(at: str, c: list[int], x: list[int], n_ctx: int | None, vocab: int | None, texts=None) -> None:
    """One line for a pair of token-id prompts that cannot be read: longer than the context (refused, never
    cut: the metric would be read at the wrong token), of other lengths, or holding ids outside the vocabulary."""
    if n_ctx is not None and max(len(c), len(x)) > n_ctx:
        which, n = ("clean", len(c)) if len(c) >= len(x) else ("corrupted", len(x))
        raise ValueError(f"{at}: the {which} prompt is {n} tokens, longer than the model's context of {n_ctx} "
                         "tokens: shorten it (nothing is cut for you: the metric would be read at the wrong token)")
    if len(c) != len(x):
        shown = f" ({texts[0]!r} vs {texts[1]!r})" if texts else ""
        raise ValueError(f"{at}: the corrupted prompt is {len(x)} tokens and the clean one {len(c)}{shown}; corrupted "
                         "prompts must have the clean ones' token lengths")
    if vocab is not None:
        for which, ids in (("clean", c), ("corrupted", x)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{at}: the {which} prompt's token id {bad[0]} is outside the model's vocabulary "
                                 f"(ids 0 to {vocab - 1})")


def _resolve(at: str, position: int, n: int) -> int:
    """A position as Python indexes (negative: from the end) -> 0 .. n - 1, or one line naming `at`."""
    if not -n <= position < n:
        raise ValueError(f"{at}: position {position} is outside the prompt of {n} tokens (0 to {n - 1}, or -{n} to "
                         "-1 from the end)")
    return position % n


def _refuse_same_position(at: str, given: list[int], n: int | None) -> None:
    """One line when two answer entries of a prompt are at one position (as written, or once resolved against
    the prompt's `n` tokens: -1 and n - 1), which would weigh that position double in the mean."""
    seen: dict[int, int] = {}
    for j, p in enumerate(given):
        key = p % n if n is not None and -n <= p < n else p
        if key in seen:
            k = seen[key]
            same = (f"position {p}" if given[k] == p
                    else f"positions {given[k]} and {p} (one token of this {n}-token prompt)")
            raise ValueError(f"{at}: answers[{k}] and answers[{j}] are both at {same}: give each position once (list "
                             'several answer tokens in one entry: "answer_ids": [..]), or the position weighs double '
                             "in the mean")
        seen[key] = j


def _check_spot(at: str, position: int, answer, wrong, metric: str, vocab: int) -> None:
    """One line for an answer position that `metric` cannot read: no answer (only kl reads none), no wrong
    answer (logit-diff, prob-diff), or answer ids outside the vocabulary."""
    if metric != "kl" and not answer:
        raise ValueError(f"{at}: position {position} has no answer; the {metric} metric needs one at every position "
                         "(kl alone reads none)")
    if metric in NEEDS_WRONG and not wrong:
        raise ValueError(f"{at}: position {position} has no wrong answer; the {metric} metric needs one at every "
                         "position (or choose --metric logit, prob, loss or kl)")
    for which, ids in (("answer", answer), ("wrong answer", wrong)):
        bad = [t for t in ids or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{at}: the {which} id {bad[0]} at position {position} is outside the model's "
                             f"vocabulary (ids 0 to {vocab - 1})")
        _refuse_repeats(f"{at}: the {which} ids at position {position}", list(ids or ()))


def _refuse_repeats(what: str, ids: list) -> None:
    """One line when a position lists a token twice: its probability would be summed twice (prob past 1, loss
    below 0) and its logit weigh double in the mean."""
    twice = [t for i, t in enumerate(ids) if t in ids[:i]]
    if twice:
        raise ValueError(f"{what}: {twice[0]!r} is listed {ids.count(twice[0])} times: give each token once (a "
                         "position's probability sums its answers, so a repeat would count twice)")


def _token_task(model, name: str, c_rows: list[list[int]], x_rows: list[list[int]], spots, metric: str,
                description: str, where: Sequence[str] | None = None, texts=None) -> Task:
    """A task from token ids: `spots[i]` lists prompt i's answer positions as (position, answer ids or None,
    wrong ids or None), a position as Python indexes the prompt (negative: from its own end). Every pair and
    position is checked first (`_check_prompts`, `_resolve`, `_check_spot`: one line naming `where[i]`, default
    "pair i + 1"); prompts are right-padded; the metric is `task_metric`'s."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    n_ctx, vocab = context(model.cfg), model.cfg.d_vocab
    rows, positions, answers, wrongs = [], [], [], []
    for i, (c, x) in enumerate(zip(c_rows, x_rows)):
        at = where[i] if where else f"pair {i + 1}"
        _check_prompts(at, c, x, n_ctx, vocab, texts[i] if texts else None)
        _refuse_same_position(at, [p for p, _, _ in spots[i]], len(c))
        for position, answer, wrong in spots[i]:
            _check_spot(at, position, answer, wrong, metric, vocab)
            rows.append(i)
            positions.append(_resolve(at, position, len(c)))
            answers.append(list(answer) if answer else None)
            wrongs.append(list(wrong) if wrong else None)
    pad = _pad_id(model)
    clean, rows, positions = _right_padded(c_rows, pad), torch.tensor(rows), torch.tensor(positions)
    has_wrong = all(w is not None for w in wrongs)
    fn = task_metric(model, metric, clean, rows, positions, answers, wrongs if has_wrong else None)

    def first(lists):  # each answer's first token, where every position has one
        return torch.tensor([a[0] for a in lists]) if all(a is not None for a in lists) else None

    return Task(name, clean, _right_padded(x_rows, pad), rows, positions, fn, metric, description,
                prompts=[t[0] if t else "" for t in texts] if texts else [], answer_tokens=first(answers),
                wrong_tokens=first(wrongs))


def tensor_task(model, clean: Tensor, corrupted: Tensor, positions, answers=None, wrongs=None, *,
                metric: str = "logit", name: str = "tensors", description: str = "") -> Task:
    """A task from tensors. clean, corrupted: [batch, pos] token ids (the model's input exactly: nothing is
    prepended); positions: [k] (the same for every prompt) or [batch, k], Python-style (-1 the last token);
    answers, wrongs: None, [batch, k] (one token each) or [batch, k, a] (several: a mean of logits, a sum of
    probabilities). Refusals name the row ("row 3: position 9 is outside the prompt of 8 tokens ...")."""
    clean, corrupted = torch.as_tensor(clean), torch.as_tensor(corrupted)
    if clean.dim() != 2 or clean.shape != corrupted.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} token ids must both be "
                         "[batch, pos]")
    b = clean.shape[0]
    pos = torch.as_tensor(positions).long()
    pos = pos.expand(b, -1) if pos.dim() == 1 else pos
    if pos.shape[0] != b:
        raise ValueError(f"positions {tuple(pos.shape)}: give [k] or [batch={b}, k]")

    def per_spot(t, what: str):
        if t is None:
            return [[None] * pos.shape[1] for _ in range(b)]
        t = torch.as_tensor(t).long()
        shape = tuple(t.shape)
        t = t[..., None] if t.dim() == 2 else t
        if t.dim() != 3 or t.shape[:2] != pos.shape:
            raise ValueError(f"{what} {shape}: give [batch, k] or [batch, k, a] to match positions "
                             f"{tuple(pos.shape)}")
        return t.tolist()

    a, w = per_spot(answers, "answers"), per_spot(wrongs, "wrongs")
    spots = [list(zip(pos[i].tolist(), a[i], w[i])) for i in range(b)]
    return _token_task(model, name, clean.tolist(), corrupted.tolist(), spots, metric,
                       description or f"{b} prompts of {clean.shape[1]} tokens, {pos.shape[1]} positions each",
                       [f"row {i}" for i in range(b)])


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
    task = _pairs_task(model, "ioi", clean, corrupted, answers, wrongs, metric,
                       f"IOI, {n_prompts} prompts in {len(IOI_TEMPLATES)} templates, {len(names)} single-token names; "
                       "corrupted: three other names (ABC)")
    task.position_classes = ioi_classes(task.clean, [a[0] for a in answers], [w[0] for w in wrongs], task.rows,
                                        task.positions)
    return task


IOI_CLASSES = ("S1", "S2", "IO", "END")


def ioi_classes(clean: Tensor, io: Sequence[int], subject: Sequence[int], rows: Tensor, ends: Tensor) -> dict:
    """Each IOI prompt's named positions (the position classes of `positions`): S1 and S2 the subject's first
    and second token, IO the indirect object's, END the answer position (the last token)."""
    out: dict[str, list[int]] = {name: [] for name in IOI_CLASSES}
    end = dict(zip(rows.tolist(), ends.tolist()))
    for i, prompt in enumerate(clean.tolist()):
        s_at = [p for p, t in enumerate(prompt) if t == subject[i]]
        io_at = [p for p, t in enumerate(prompt) if t == io[i]]
        if len(s_at) != 2 or len(io_at) != 1:
            raise ValueError(f"IOI prompt {i}: the subject's token appears {len(s_at)} times and the indirect "
                             f"object's {len(io_at)} (2 and 1 expected)")
        for name, at in zip(IOI_CLASSES, (s_at[0], s_at[1], io_at[0], end[i])):
            out[name].append(at)
    return out


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
    return Task("induction", clean, corrupted, rows, positions,
                task_metric(model, metric, clean, rows, positions, answers, wrongs), metric,
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
NEEDS = ('each line needs "clean", "corrupted" and "answer" (or "clean_ids", "corrupted_ids" and "answer_ids"; '
         '"answers" for several positions)')
ONE_POSITION = ("position", "answer", "answer_ids", "wrong", "wrong_ids")


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _prompt(row: dict, key: str, at: str):
    """A line's clean or corrupted prompt: its text (str) or its token ids (list of int)."""
    ids = f"{key}_ids"
    if key in row and ids in row:
        raise ValueError(f'{at}: give "{key}" (text) or "{ids}" (token ids), not both')
    if key not in row and ids not in row:
        raise ValueError(f"{at}: {NEEDS}")
    if key in row:
        if not isinstance(row[key], str):
            raise ValueError(f'{at}: "clean" and "corrupted" must be strings (token ids go in "clean_ids", '
                             '"corrupted_ids")')
        return row[key]
    v = row[ids]
    if not (isinstance(v, list) and v and all(_is_id(t) for t in v)):
        raise ValueError(f'{at}: "{ids}" must be a non-empty list of token ids (integers from 0)')
    return v


def _answer(entry: dict, key: str, at: str):
    """An answer (or wrong answer) of a position: ("text", [str]), ("ids", [int]) or None when not given."""
    ids = f"{key}_ids"
    if key in entry and ids in entry:
        raise ValueError(f'{at}: give "{key}" (text) or "{ids}" (token ids), not both')
    if key in entry:
        v = [entry[key]] if isinstance(entry[key], str) else entry[key]
        if not (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
            raise ValueError(f'{at}: "{key}" must be a string or a list of strings')
        _refuse_repeats(f'{at}: "{key}"', v)
        return "text", v
    if ids in entry:
        v = [entry[ids]] if _is_id(entry[ids]) else entry[ids]
        if not (isinstance(v, list) and v and all(_is_id(x) for x in v)):
            raise ValueError(f'{at}: "{ids}" must be a token id or a non-empty list of them (integers from 0)')
        _refuse_repeats(f'{at}: "{ids}"', v)
        return "ids", v
    return None


def _spot(entry, at: str, default: int | None):
    """(position, answer, wrong) of one answer position (`_answer`'s forms)."""
    if not isinstance(entry, dict):
        raise ValueError(f'{at}: each of "answers" must be an object: {{"position": -1, "answer": " Paris"}}')
    position = entry.get("position", default)
    if position is None:
        raise ValueError(f'{at}: each of "answers" needs a "position"')
    if not isinstance(position, int) or isinstance(position, bool):
        raise ValueError(f'{at}: "position" must be an integer (negative: from the end, as Python indexes)')
    return position, _answer(entry, "answer", at), _answer(entry, "wrong", at)


def parse_pair(row: dict, at: str) -> tuple:
    """One line (or a Python dict of the same form) -> (clean, corrupted, spots): each prompt its text or its
    ids, spots a list of `_spot`s. What needs no model is checked here: the fields' forms, and, where both
    prompts are ids, their lengths and the positions."""
    if not isinstance(row, dict):
        raise ValueError(f"{at}: {NEEDS}")
    clean, corrupted = _prompt(row, "clean", at), _prompt(row, "corrupted", at)
    if "answers" in row:
        if any(k in row for k in ONE_POSITION):
            raise ValueError(f'{at}: give "answers" (several positions) or "answer" at one "position", not both')
        if not (isinstance(row["answers"], list) and row["answers"]):
            raise ValueError(f'{at}: "answers" must be a non-empty list of {{"position": ..., "answer": ...}}')
        spots = [_spot(e, f"{at}: answers[{j}]", None) for j, e in enumerate(row["answers"])]
    elif "answer" in row or "answer_ids" in row:
        spots = [_spot(row, at, -1)]
    else:
        raise ValueError(f"{at}: {NEEDS}")
    if isinstance(clean, list) and isinstance(corrupted, list):
        _check_prompts(at, clean, corrupted, None, None)
        for position, _, _ in spots:
            _resolve(at, position, len(clean))
    _refuse_same_position(at, [p for p, _, _ in spots], len(clean) if isinstance(clean, list) else None)
    return clean, corrupted, spots


def read_task_file(path) -> list[dict]:
    """The pairs of a JSON-lines file (the format: `parse_pair`, docs/circuits.md). Checked before any model
    loads; one line says what is wrong and where ("tasks.jsonl:7: ...")."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file (a JSON-lines file, or one of {', '.join(TASKS)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the task file as UTF-8") from None
    pairs, first = [], None  # first: whether the file's first position has a wrong answer
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        except RecursionError:  # [[[[...]]]] a hundred thousand deep
            raise ValueError(f"{path}:{n}: JSON nested too deeply to be a pair (one object per line)") from None
        spots = parse_pair(row, f"{path}:{n}")[2]
        row[LINE] = f"{path.name}:{n}"
        pairs.append(row)
        wrong = [w is not None for _, _, w in spots]
        first = wrong[0] if first is None else first
        if any(w != first for w in wrong):
            raise ValueError(f'{path}:{n}: a position {"without" if first else "with"} a wrong answer, where the '
                             f'first has {"one" if first else "none"}: give "wrong" at every position or at none')
    if not pairs:
        raise ValueError(f"{path} holds no pairs")
    return pairs


def default_metric(pairs: list[dict]) -> str:
    """A file's metric when none is asked for: logit-diff when every position has wrong answers, else loss
    when every one has answers, else kl."""
    spots = [s for n, p in enumerate(pairs, 1) for s in parse_pair(p, p.get(LINE, f"pair {n}"))[2]]
    return "logit-diff" if all(w for _, _, w in spots) else "loss" if all(a for _, a, _ in spots) else "kl"


def file_task(model, pairs: list[dict], *, metric: str | None = None, name: str = "file") -> Task:
    """A task from `read_task_file`'s pairs (or dicts of the same form); metric default `default_metric`."""
    where = [p.get(LINE, f"pair {n}") if isinstance(p, dict) else f"pair {n}" for n, p in enumerate(pairs, 1)]
    parsed = [parse_pair(p, at) for p, at in zip(pairs, where)]
    metric = metric or default_metric(pairs)
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")

    def ids(answer, at: str, key: str):
        if answer is None or answer[0] == "ids":
            return None if answer is None else answer[1]
        return [_single(model, s, at, key) for s in answer[1]]

    def tokens(prompt):
        return _encode(model, prompt) if isinstance(prompt, str) else list(prompt)

    spots = [[(p, ids(a, at, "answer"), ids(w, at, "wrong answer")) for p, a, w in ss]
             for (_, _, ss), at in zip(parsed, where)]
    texts = [(c, x) if isinstance(c, str) and isinstance(x, str) else None for c, x, _ in parsed]
    n = sum(len(s) for s in spots)
    description = f"{len(pairs)} pairs from {name}" + (f", {n} answer positions" if n > len(pairs) else "")
    return _token_task(model, name, [tokens(c) for c, _, _ in parsed], [tokens(x) for _, x, _ in parsed], spots,
                       metric, description, where, texts=texts)


def _single(model, s: str, at: str, key: str) -> int:
    ids = model.to_tokens(s, prepend_bos=False)[0]
    if ids.numel() != 1:
        raise ValueError(f'{at}: the {key} {s!r} is {ids.numel()} tokens; answers must be single tokens (often with a '
                         'leading space: " Paris"; or give their ids: "answer_ids")')
    return int(ids)


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
