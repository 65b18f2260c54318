"""Training pipeline: the corpus, batches, copy-span augmentation, the schedule, the probes, determinism."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import interp
from interp.errors import UserError
from interp.models.formats.tokenizer import ByteTokenizer
from interp.models.zoo.training import (
    BOS,
    BatchSampler,
    Recipe,
    copy_span,
    icl_score,
    load_corpus,
    probe_scores,
    repeated_random_tokens,
    stdlib_files,
    train,
)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def tiny_recipe(**changes) -> Recipe:
    cfg = interp.ModelConfig(n_layers=2, d_model=32, n_heads=2, d_vocab=257, n_ctx=64, d_mlp=None)
    base = Recipe(name="tiny", model=cfg, steps=4, checkpoints=(0, 2), batch_size=4, warmup_steps=2,
                  eval_windows=8, probe_len=20, probe_batch=2, threads=1)
    return dataclasses.replace(base, **changes)


def test_stdlib_files_sorted_and_without_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert not any("site-packages" in r for r in rel)
    assert "os.py" in rel and "json/__init__.py" in rel


def test_corpus_holds_the_files_bytes(corpus):
    root = Path(corpus.root)
    files = stdlib_files(root)
    # file 1 is the first training file: the stream starts <bos> + its bytes (file 0 is held out)
    first = np.frombuffer(files[1].read_bytes(), dtype=np.uint8)
    assert corpus.train[0] == BOS
    assert np.array_equal(corpus.train[1:1 + first.size], first)
    assert np.array_equal(corpus.eval_docs[0], np.frombuffer(files[0].read_bytes(), dtype=np.uint8))
    assert corpus.n_bytes == sum(f.stat().st_size for f in files)
    assert corpus.train.size == corpus.n_bytes - sum(d.size for d in corpus.eval_docs) + (corpus.n_files - len(corpus.eval_docs))


def test_copy_span_copies_an_earlier_span_later():
    for seed in range(50):
        row = np.arange(1000, 1256)  # all distinct, so the copy is visible
        copy_span(row, np.random.Generator(np.random.PCG64(seed)), 16, 96)
        changed = np.flatnonzero(row != np.arange(1000, 1256))
        dst, length = changed[0], changed.size
        assert 16 <= length <= 96 and np.array_equal(changed, np.arange(dst, dst + length))
        src = row[dst] - 1000
        assert 1 <= src and src + length <= dst  # earlier, not overlapping, never the <bos> slot
        assert np.array_equal(row[dst:dst + length], np.arange(1000 + src, 1000 + src + length))


def test_copy_span_randomized_repeats_random_bytes():
    rng = np.random.Generator(np.random.PCG64(0))
    seen = set()
    for _ in range(50):
        row = np.arange(1000, 1256)
        copy_span(row, rng, 16, 96, randomize=True)
        changed = np.flatnonzero(row < 1000)  # positions now holding random bytes
        assert changed.size % 2 == 0
        half = changed.size // 2
        src, dst = changed[:half], changed[half:]
        assert np.array_equal(src, np.arange(src[0], src[0] + half)) and np.array_equal(dst, np.arange(dst[0], dst[0] + half))
        assert np.array_equal(row[src], row[dst]) and src[-1] < dst[0] and 16 <= half <= 96
        seen.update(row[src].tolist())
    assert seen == set(range(256))  # uniform over every byte, not only the ones source code uses


def test_batch_sampler_windows_come_from_the_stream():
    stream = np.arange(10_000, dtype=np.int16) % 200
    batch, weights = next(BatchSampler(stream, n_ctx=32, batch_size=16, seed=0))
    assert batch.shape == (16, 32) and (batch[:, 0] == BOS).all() and (weights == 1).all()
    for row in batch:
        start = int(row[1])
        # consecutive values mod 200: the window is a contiguous slice of the stream
        assert torch.equal(row[1:], (torch.arange(31) + start) % 200)
    again = next(BatchSampler(stream, n_ctx=32, batch_size=16, seed=0)).tokens
    other = next(BatchSampler(stream, n_ctx=32, batch_size=16, seed=1)).tokens
    assert torch.equal(batch, again) and not torch.equal(batch, other)


def test_random_spans_are_left_out_of_the_loss_where_unpredictable():
    stream = (300 + np.arange(10_000) % 200).astype(np.int16)  # text >= 300, so random bytes (< 256) stand out
    tokens, weights = next(BatchSampler(stream, n_ctx=256, batch_size=8, seed=0, copy_prob=1.0, random_span_prob=1.0))
    for row, w in zip(tokens, weights):
        pos = torch.nonzero(row < 256)[:, 0]
        pos = pos[pos > 0]  # not the <bos>
        half = pos.numel() // 2
        src, dst = pos[:half], pos[half:]
        assert torch.equal(row[src], row[dst])
        expected = torch.ones(255)
        expected[src - 1] = 0  # the first copy cannot be predicted...
        expected[dst[0] - 1] = 0  # ...nor where its repeat starts; the rest of the repeat can
        assert torch.equal(w, expected)


def test_lr_schedule_hand_computed():
    r = tiny_recipe(lr=1e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert r.lr_at(0, 110) == pytest.approx(1e-4)
    assert r.lr_at(9, 110) == pytest.approx(1e-3)
    assert r.lr_at(60, 110) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half-way: cos = 0
    assert r.lr_at(110, 110) == pytest.approx(1e-4)
    assert dataclasses.replace(r, schedule="constant").lr_at(100, 110) == pytest.approx(1e-3)


def test_checkpoint_steps():
    r = tiny_recipe(checkpoints=(0, 10, 100, 1000))
    assert r.checkpoint_steps() == [0, 4] and r.checkpoint_steps(150) == [0, 10, 100, 150]


def test_icl_score_hand_computed():
    class FakeModel:  # per-token loss = position of the predicted token / 100
        def __call__(self, w, return_type, loss_per_token):
            return (torch.arange(1, w.shape[1]) / 100).expand(w.shape[0], -1)

    out = icl_score(FakeModel(), torch.zeros(5, 300, dtype=torch.long), early=50, late=500)
    assert out["late_token"] == 299
    assert out["icl"] == pytest.approx((299 - 50) / 100)


def test_probe_scores_match_hand_built_patterns():
    """Replace every layer's pattern by a known one: exact induction stripe / exact previous token."""
    cfg = interp.ModelConfig(n_layers=2, d_model=32, n_heads=2, d_vocab=257, n_ctx=64, d_mlp=None)
    model = interp.HookedTransformer(cfg)
    L = 10
    tokens = repeated_random_tokens(3, L)
    n = 2 * L + 1
    induction, previous = torch.zeros(n, n), torch.zeros(n, n)
    induction[0, 0] = previous[0, 0] = 1
    for q in range(1, n):
        previous[q, q - 1] = 1
        induction[q, q - L + 1 if q > L else q] = 1  # second copy: the token after the earlier occurrence

    def set_pattern(layer_pattern):
        def hook(pattern, hook):
            return layer_pattern.expand_as(pattern).clone()
        return hook

    with model.hooks([("blocks.0.attn.hook_pattern", set_pattern(previous)),
                      ("blocks.1.attn.hook_pattern", set_pattern(induction))]):
        scores = probe_scores(model, tokens, L)
    assert torch.allclose(scores["previous"][0], torch.ones(2)) and torch.allclose(scores["induction"][1], torch.ones(2))
    # the two stripes never overlap (L > 2), so each pattern scores 0 on the other's measure
    assert torch.allclose(scores["induction"][0], torch.zeros(2)) and torch.allclose(scores["previous"][1], torch.zeros(2))
    # only the previous-token pattern's row 1 looks at key 0
    assert torch.allclose(scores["sink"], torch.tensor([[1 / (n - 1)] * 2, [0.0] * 2]))


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_training_is_deterministic(tmp_path, corpus):
    r = tiny_recipe()
    a = train(r, tmp_path / "a", corpus=corpus, progress=False, log=lambda s: None)
    b = train(r, tmp_path / "b", corpus=corpus, progress=False, log=lambda s: None)
    c = train(r, tmp_path / "c", seed=1, corpus=corpus, progress=False, log=lambda s: None)
    for step in ("step_00000", "step_00002", "step_00004"):
        assert _digest(a / step) == _digest(b / step)
    assert _digest(a / "step_00004") != _digest(c / "step_00004")
    assert _digest(a / "step_00000") != _digest(a / "step_00004")  # it did train
    ma = interp.load(a / "step_00004")
    assert isinstance(ma.tokenizer, ByteTokenizer)
    meta = json.loads((a / "step_00004" / "meta.json").read_text())
    run = json.loads((a / "run.json").read_text())
    assert meta["step"] == 4 and meta["tokens_seen"] == 4 * 4 * 64 and meta["run"] == "tiny" and meta["seed"] == 0
    assert [c["dir"] for c in run["checkpoints"]] == ["step_00000", "step_00002", "step_00004"]
    assert run["recipe"]["batch_size"] == 4 and run["threads"] == 1 and "train_seconds" in run


def test_a_killed_run_resumes_bit_identically(tmp_path, corpus, monkeypatch):
    r = tiny_recipe(steps=6, checkpoints=(0, 2, 4))
    whole = train(r, tmp_path / "whole", corpus=corpus, progress=False, log=lambda s: None)

    calls = {"n": 0}
    real_next = BatchSampler.__next__

    def dies_at_step_3(self):
        calls["n"] += 1
        if calls["n"] == 4:  # steps 0, 1, 2 ran; the process "dies" in step 3, after checkpoint 2
            raise KeyboardInterrupt
        return real_next(self)

    monkeypatch.setattr(BatchSampler, "__next__", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(r, tmp_path / "killed", corpus=corpus, progress=False, log=lambda s: None)
    assert (tmp_path / "killed" / "resume.pt").exists() and not (tmp_path / "killed" / "step_00004").exists()
    monkeypatch.setattr(BatchSampler, "__next__", real_next)
    messages = []
    resumed = train(r, tmp_path / "killed", corpus=corpus, progress=False, log=messages.append)
    assert "resuming tiny from step 2" in messages[0]
    for step in ("step_00000", "step_00002", "step_00004", "step_00006"):
        assert _digest(whole / step) == _digest(resumed / step)
    run = json.loads((resumed / "run.json").read_text())
    assert [c["step"] for c in run["checkpoints"]] == [0, 2, 4, 6] and not (resumed / "resume.pt").exists()
    with pytest.raises(UserError, match="other settings"):  # one line on the command line, not a traceback
        monkeypatch.setattr(BatchSampler, "__next__", dies_at_step_3)
        calls["n"] = 0
        with pytest.raises(KeyboardInterrupt):
            train(r, tmp_path / "other", corpus=corpus, progress=False, log=lambda s: None)
        monkeypatch.setattr(BatchSampler, "__next__", real_next)
        train(r, tmp_path / "other", seed=5, corpus=corpus, progress=False, log=lambda s: None)
