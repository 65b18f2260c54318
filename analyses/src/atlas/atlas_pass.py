"""One forward for the atlas's per-layer head analyses, where they used to run one each.

Head detection (`detect_heads`: previous-token, duplicate-token, induction), attention sinks
(`attention_sinks`, Gu et al.'s alpha for key 0) and the in-context-learning score (`icl_score`, which
needs the final residual stream at two positions) each ran their own forward over the sweep's tokens:
at long context three forwards and two statistics passes per layer. Here one fused forward computes
each layer's streaming statistics once (`attention_stats`, n_sink = 1: the mass on key 0, on the
previous token, on duplicates and on induction targets) and hands them to both consumers, the same
`DetectStream` and `SinkStream` that `detect_heads(method="streaming")` and `attention_sinks(n_sink=1)`
run alone, so the numbers are theirs; the forward's output is the residual stream `icl_score` reads.

Short sequences keep the materialised-pattern detection (`detect_heads(method="auto")` picks it where
it is faster); there the analyses run as before, each on its own (they are cheap).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
from torch import Tensor

from .._common import head_frame, token_input, valid_mask
from ..heads import DetectStream, detect_heads, layer_pass, resolve_method
from ..sinks import SinkStream


@dataclass
class AtlasPass:
    """What one pass gives: `detect_heads`' frame, and where they shared its forward, `attention_sinks`'
    frame (n_sink = 1) and the residual stream after the last layer (None: not shared, run them alone)."""

    detect: pd.DataFrame
    sinks: pd.DataFrame | None = None
    resid: Tensor | None = None


def atlas_pass(model, tokens, kinds, *, epsilon: float = 0.3, backend: str = "auto") -> AtlasPass:
    """`detect_heads(model, tokens, kinds, method="auto")`, and where that streams, `attention_sinks(model,
    tokens, n_sink=1, epsilon)` and the final residual stream from the same forward."""
    tokens, _ = token_input(model, tokens)
    if resolve_method(model, tokens, "auto") != "streaming":
        return AtlasPass(detect_heads(model, tokens, kinds=kinds, method="auto", backend=backend))
    valid = valid_mask(tokens, None, right_padded_only=True)
    detect = DetectStream(model, tokens, valid, list(kinds), False, False, "mul")
    sinks = SinkStream(model, tokens, 1, epsilon)
    resid = layer_pass(model, tokens, [detect, sinks], valid=valid, backend=backend)
    settings = dict(method="streaming", exclude_bos=False, exclude_current_token=False, error_measure="mul",
                    n_sequences=tokens.shape[0], seq_len=tokens.shape[1])
    scores = detect.scores()
    frame = pd.concat([head_frame(scores[k], "score", kind=k, **settings) for k in kinds], ignore_index=True)
    native = getattr(model, "native", True)
    return AtlasPass(frame[["layer", "head", "kind", "score", *settings]], sinks.frame(),
                     resid if native and isinstance(resid, Tensor) else None)
