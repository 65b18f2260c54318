"""Each feature's max-activating contexts over a corpus, streamed: a running top-k per feature, never the
activations of the whole corpus.

`RunningTopK` holds, per feature, its k largest activations so far, where each was (document, position), and a
window of tokens around each with the feature's activation at every token of the window (what the feature view
shades). A batch's own top k per feature is found with one `topk` over its positions, its windows gathered from the
batch, and merged with the running k by a second `topk` over the 2k: memory is one batch of activations plus
2k contexts a feature, whatever the corpus's length. Windows do not cross documents (rows); the positions of a
window outside its document hold token -1.
"""

from __future__ import annotations

from typing import Iterable

import pandas as pd
import torch
from torch import Tensor

from interp.models.placement.device import to_numpy

from .passes import feature_pass

WINDOW = (12, 4)  # tokens kept before and after each context's position
CONTEXT_COLUMNS = ("feature", "rank", "document", "position", "activation", "offset", "token", "token_activation")


class RunningTopK:
    """Each of `d_sae` features' `k` largest activations seen so far (`update` batch by batch), with their
    document, position and window (`window` = tokens before, after). `features`: the feature ids kept (all by
    default). Its state is [k, F] values and places and [k, F, W] window tokens and activations, whatever the
    number of batches (`nbytes`)."""

    def __init__(self, k: int, d_sae: int, device, window: tuple[int, int] = WINDOW, features=None) -> None:
        self.k, self.before, self.after = int(k), int(window[0]), int(window[1])
        self.features = None if features is None else torch.as_tensor(features, device=device, dtype=torch.long)
        F, W = (d_sae if features is None else len(self.features)), self.before + self.after + 1
        self.values = torch.full((self.k, F), -torch.inf, device=device)
        self.document = torch.full((self.k, F), -1, dtype=torch.long, device=device)
        self.position = torch.full((self.k, F), -1, dtype=torch.long, device=device)
        self.tokens = torch.full((self.k, F, W), -1, dtype=torch.long, device=device)
        self.window_acts = torch.zeros((self.k, F, W), device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state())

    def _state(self) -> tuple[Tensor, ...]:
        return self.values, self.document, self.position, self.tokens, self.window_acts

    def update(self, first: int, tokens: Tensor, x: Tensor, acts: Tensor) -> None:
        """Take a batch: `first` its first document's index, tokens [b, pos], acts [b, pos, d_sae]."""
        b, n = tokens.shape
        flat = acts.reshape(b * n, -1)
        if self.features is not None:
            flat = flat[:, self.features]
        k = min(self.k, b * n)
        values, where = flat.topk(k, dim=0)  # [k, F]
        offsets = torch.arange(-self.before, self.after + 1, device=flat.device)
        pos = where % n
        spots = pos[..., None] + offsets  # [k, F, W]
        inside = (spots >= 0) & (spots < n)
        index = (where - pos)[..., None] + spots.clamp(0, n - 1)  # the window's flat positions in the batch
        window_tokens = tokens.reshape(-1)[index].masked_fill(~inside, -1)
        F, W = flat.shape[1], offsets.numel()
        window_acts = flat.gather(0, index.transpose(1, 2).reshape(k * W, F)).reshape(k, W, F).transpose(1, 2)
        batch = (values, where // n + first, pos, window_tokens, window_acts.masked_fill(~inside, 0.0))
        self._merge(batch)

    def _merge(self, batch: tuple[Tensor, ...]) -> None:
        both = [torch.cat([old, new]) for old, new in zip(self._state(), batch)]
        values, order = both[0].topk(self.k, dim=0)
        keep = [values] + [t.gather(0, order) for t in both[1:3]]
        keep += [t.gather(0, order[..., None].expand(-1, -1, t.shape[-1])) for t in both[3:]]
        self.values, self.document, self.position, self.tokens, self.window_acts = keep

    def frame(self) -> pd.DataFrame:
        """One row per (feature, rank, window offset) of the contexts whose activation is > 0: `CONTEXT_COLUMNS`
        (`activation` the context's, `token_activation` the feature's at that token of the window)."""
        k, F, W = self.tokens.shape
        ids = torch.arange(F, device=self.values.device) if self.features is None else self.features
        keep = torch.nonzero(self.values > 0)  # [m, 2] (rank, feature column), by rank then feature
        keep = keep[torch.argsort(keep[:, 1] * k + keep[:, 0])]  # by feature, then rank
        r, f = keep[:, 0], keep[:, 1]
        inside = self.tokens[r, f] >= 0  # [m, W]
        rows, offs = torch.nonzero(inside, as_tuple=True)
        each = lambda t: to_numpy(t[rows])  # noqa: E731
        return pd.DataFrame({
            "feature": each(ids[f]), "rank": each(r), "document": each(self.document[r, f]),
            "position": each(self.position[r, f]), "activation": each(self.values[r, f]),
            "offset": to_numpy(offs) - self.before, "token": to_numpy(self.tokens[r, f][rows, offs]),
            "token_activation": to_numpy(self.window_acts[r, f][rows, offs])})


def max_activating(model, sae, token_batches: Iterable, k: int = 10, *, window: tuple[int, int] = WINDOW,
                   features=None) -> pd.DataFrame:
    """Each feature's `k` max-activating contexts over `token_batches` (an iterable of [b, pos] token ids, or of
    texts of one length: read one batch at a time, so a generator over a corpus of any length will do), in memory
    of one batch plus 2k contexts a feature (`RunningTopK`).

    One row per (feature, rank, window token): the context's `document` (its row, counted across the batches),
    `position`, `activation`, and each token of the window (`window` = tokens before, after) with its `offset` from
    the position and the feature's `token_activation` there. Only activations > 0 are contexts: a feature that never
    fires has no rows. `features`: the feature ids to keep (all by default)."""
    if int(k) < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if min(window) < 0:
        raise ValueError(f"window takes (tokens before, tokens after), each >= 0; got {window}")
    top = RunningTopK(k, sae.cfg.d_sae, sae.W_enc.device, window, features)
    feature_pass(model, sae, token_batches, [top])
    return top.frame()


def context_text(frame: pd.DataFrame, strings) -> pd.DataFrame:
    """One row per context (feature, rank, document, position, activation) with its window as text: `before`, the
    token at the position (`token_text`) and `after`, each token turned to a string by `strings[id]`."""
    rows = []
    for (f, r), part in frame.groupby(["feature", "rank"], sort=True):
        part = part.sort_values("offset")
        text = lambda p: "".join(strings[int(t)] for t in p["token"])  # noqa: E731
        at = part[part["offset"] == 0]
        rows.append(dict(feature=int(f), rank=int(r), document=int(part["document"].iloc[0]),
                         position=int(part["position"].iloc[0]), activation=float(part["activation"].iloc[0]),
                         before=text(part[part["offset"] < 0]), token_text=text(at),
                         after=text(part[part["offset"] > 0])))
    return pd.DataFrame(rows, columns=["feature", "rank", "document", "position", "activation", "before", "token_text",
                                       "after"])


__all__ = ["CONTEXT_COLUMNS", "RunningTopK", "WINDOW", "context_text", "max_activating"]
