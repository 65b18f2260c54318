"""Max-activating contexts, streamed: equal to a brute-force top-k over every activation of a small corpus computed
at once (values, places, windows and the activations in them), in memory that does not grow with the corpus (the
running state's size fixed from the first batch, the SAE shown one batch at a time, the batches read lazily)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp.analyses.features import max_activating
from interp.analyses.features.contexts import RunningTopK, context_text
from interp.analyses.features.site import activations, site_of

HOOK_Z = "blocks.1.attn.hook_z"


def brute_force(model, sae, corpus, k: int, before: int, after: int) -> dict:
    """{(feature, rank): (value, document, position, window tokens, window activations)} from every activation of
    the corpus at once, sorted here with numpy."""
    with torch.no_grad():
        acts = sae.encode(activations(model, corpus, site_of(sae.cfg.hook_name, model.cfg))).numpy()  # [n, p, F]
    tokens = corpus.numpy()
    n, p, F = acts.shape
    out = {}
    for f in range(F):
        flat = acts[:, :, f].reshape(-1)
        order = np.argsort(-flat, kind="stable")[:k]
        for r, i in enumerate(order):
            if flat[i] <= 0:
                break
            d, q = divmod(int(i), p)
            spots = range(max(0, q - before), min(p, q + after + 1))
            out[(f, r)] = (float(flat[i]), d, q, [int(tokens[d, s]) for s in spots],
                           [float(acts[d, s, f]) for s in spots])
    return out


@pytest.mark.parametrize("arch", ["standard", "topk"])
def test_the_streamed_top_k_is_the_brute_force_one(model, make_sae, corpus, arch):
    sae = make_sae(arch=arch, seed=11)
    want = brute_force(model, sae, corpus, k=4, before=5, after=2)
    batches = [corpus[:3], corpus[3:5], corpus[5:]]  # uneven batches: documents counted across them
    frame = max_activating(model, sae, batches, k=4, window=(5, 2))
    got = {}
    for (f, r), part in frame.groupby(["feature", "rank"]):
        part = part.sort_values("offset")
        got[(f, r)] = (float(part["activation"].iloc[0]), int(part["document"].iloc[0]), int(part["position"].iloc[0]),
                       part["token"].tolist(), part["token_activation"].tolist())
    assert got.keys() == want.keys() and len(want) > 100
    for key, (value, doc, pos, toks, acts) in want.items():
        g = got[key]
        assert g[0] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert (g[1], g[2], g[3]) == (doc, pos, toks), key  # random weights: no ties among the positive values
        np.testing.assert_allclose(g[4], acts, rtol=1e-5, atol=1e-6)
    assert set(frame["offset"]) <= set(range(-5, 3))


def test_memory_stays_one_batch_plus_k_contexts_a_feature(model, make_sae, corpus, monkeypatch):
    """The running state never grows past [k, F] values and places and [k, F, W] windows, the SAE encodes one
    batch at a time, and the batches are read as they are needed (a generator of any length will do)."""
    sae = make_sae(seed=2)
    seen, read = [], []
    encode = sae.encode
    monkeypatch.setattr(sae, "encode", lambda x: (seen.append(tuple(x.shape)), encode(x))[1])
    sizes = []
    update = RunningTopK.update

    def watched(self, first, tokens, x, acts):
        update(self, first, tokens, x, acts)
        sizes.append(self.nbytes)

    monkeypatch.setattr(RunningTopK, "update", watched)

    def corpus_batches():
        for i in range(20):  # 20 batches of 2 rows: 40 documents
            read.append(i)
            assert len(seen) == i, "a batch is read only once the one before it is encoded"
            yield corpus[(2 * i) % 8:(2 * i) % 8 + 2]

    frame = max_activating(model, sae, corpus_batches(), k=3, window=(4, 4))
    assert read == list(range(20)) and all(s[:2] == (2, 48) for s in seen) and len(seen) == 20
    k, F, W = 3, 48, 9
    assert sizes == [sizes[0]] * 20 and sizes[0] == k * F * (4 + 8 + 8) + k * F * W * (8 + 4)
    assert frame["document"].max() >= 8  # documents past the first pass over the 8 rows: counted across batches


def test_the_contexts_read_as_text(model, make_sae, corpus):
    sae = make_sae(seed=4)
    frame = max_activating(model, sae, [corpus], k=2, window=(3, 1), features=[0, 5, 9])
    assert set(frame["feature"]) <= {0, 5, 9}
    strings = {i: chr(65 + i % 26) for i in range(257)}
    text = context_text(frame, strings)
    one = text.iloc[0]
    part = frame[(frame["feature"] == one["feature"]) & (frame["rank"] == one["rank"])].sort_values("offset")
    assert one["token_text"] == strings[int(part[part["offset"] == 0]["token"].iloc[0])]
    assert len(one["before"]) == (part["offset"] < 0).sum() and len(one["after"]) == (part["offset"] > 0).sum()


def test_bad_arguments_are_one_line(model, make_sae, corpus):
    sae = make_sae()
    with pytest.raises(ValueError, match="k must be at least 1"):
        max_activating(model, sae, [corpus], k=0)
    with pytest.raises(ValueError, match="window takes"):
        max_activating(model, sae, [corpus], window=(-1, 2))
