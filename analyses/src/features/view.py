"""The features study's offline view (`interp.drawing.features`): for each feature shown, its contexts with every
token shaded by the feature's activation, its heads, and the tokens it raises and lowers, built from the study's
tables alone (so a report can be drawn again from a folder)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from interp.drawing import View, b64, codes_u8
from interp.drawing.features import features_page

from ..document import head_name


def _heads(heads: pd.DataFrame | None, feature: int) -> list:
    if heads is None:
        return []
    part = heads[heads["feature"] == feature].sort_values("share", ascending=False)
    return [[head_name(int(r.layer), int(r.head)), round(float(r.share), 4)] for r in part.itertuples()]


def _logits(logits: pd.DataFrame, feature: int, direction: str) -> list:
    part = logits[(logits["feature"] == feature) & (logits["direction"] == direction)].sort_values("rank")
    return [[str(t), round(float(v), 4)] for t, v in zip(part["token_text"], part["effect"])]


def _contexts(contexts: pd.DataFrame, strings: dict) -> tuple[list, str, float]:
    """(the contexts' entries, the base64 codes of their windows one after another, the largest activation)."""
    top = float(contexts["token_activation"].max()) if len(contexts) else 0.0
    entries, codes = [], []
    for _, part in contexts.groupby("rank", sort=True):
        part = part.sort_values("offset")
        offsets = part["offset"].tolist()
        entries.append(dict(act=round(float(part["activation"].iloc[0]), 4), doc=int(part["document"].iloc[0]),
                            pos=int(part["position"].iloc[0]), at=offsets.index(0),
                            tokens=[strings.get(int(t), str(int(t))) for t in part["token"]]))
        codes.append(part["token_activation"].to_numpy(np.float32) / (top if top > 0 else 1.0))
    packed = codes_u8(np.concatenate(codes)) if codes else np.zeros(0, np.uint8)
    return entries, b64(packed), top


def feature_view(shown: list[int], summary: pd.DataFrame, contexts: pd.DataFrame, logits: pd.DataFrame,
                 strings: dict, heads: pd.DataFrame | None = None, title: str = "features") -> View:
    """The view of the features `shown` (in that order): `summary` (the study's features table), `contexts`
    (`max_activating`'s rows), `logits` (`logit_effect`'s), `strings` {token id: text}, `heads` (rows feature, layer,
    head, share: the attribution's shares, or None for an SAE that does not split by head)."""
    rows = summary.set_index("feature")
    features = []
    for f in shown:
        s = rows.loc[f]
        entries, codes, top = _contexts(contexts[contexts["feature"] == f], strings)
        facts = (f"active on {int(s['n_active']):,} of {int(s['positions']):,} tokens ({s['frequency']:.2%}); "
                 f"largest activation {s['max_activation']:.3f}, mean when active {s['mean_activation']:.3f}")
        features.append(dict(id=int(f), label=f"feature {f}", name=f"feature {f}", facts=facts, heads=_heads(heads, f),
                             raises=_logits(logits, f, "top"), lowers=_logits(logits, f, "bottom"), top=top,
                             codes=codes, contexts=entries))
    legend = ("each head's share of the feature's direct attribution, |attribution| over the sum across heads "
              "(Kissane et al. 2024)" if heads is not None else "")
    return features_page(dict(features=features, head_legend=legend), title)


__all__ = ["feature_view"]
