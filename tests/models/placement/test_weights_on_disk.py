"""A checkpoint file changed under a live model (`interp.models.placement.tensor_files`: `MappedFile`, checked by
`HookedModel.check_weight_files` before each native forward and by `offload.Unit.enter` before each offloaded
block). The weights are the file's memory-mapped pages: written over in place, the next forward computed with
the new bytes and returned rc 0; truncated, it died of SIGBUS. Now both are one line naming the file. A file
replaced by a new one (os.replace) leaves the old pages mapped: the model keeps its weights and warns once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import interp
from interp.errors import CheckpointError
from interp.models.placement import tensor_files
from interp.models.placement.tensor_files import CheckpointChanged, CheckpointReplaced

CFG = interp.ModelConfig(n_layers=3, d_model=24, n_heads=3, d_vocab=29, n_ctx=64, d_mlp=None)
TOKENS = torch.arange(12)[None] % CFG.d_vocab


def _saved(folder, seed: int, fmt: str = "safetensors"):
    """Our checkpoint of a seeded model in `folder`; fmt "bin": its weights as a zip-format pytorch_model.bin
    (mapped by torch.load(mmap=True)) instead of model.safetensors. Returns the weights file."""
    model = interp.HookedTransformer(CFG, seed=seed)
    interp.save_model(model, folder)
    if fmt == "bin":
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        return folder / "pytorch_model.bin"
    return folder / "model.safetensors"


def _pair(tmp_path, fmt: str = "safetensors"):
    """(the model's weights file, another model's weights file of the same size)."""
    file, other = _saved(tmp_path / "a", 1, fmt), _saved(tmp_path / "b", 2, fmt)
    assert file.stat().st_size == other.stat().st_size
    return file, other


def _load(file, **kw):
    model = interp.load(str(file.parent), **kw)
    # meaningful only if the weights are the file's pages: a resident weight that is a view of the mapping
    w = model.ln_final.w if kw.get("offload") else model.embed.W_E
    storage = w.untyped_storage()
    assert _mapped(storage.data_ptr(), storage.nbytes(), file)
    # the mtime a write sets is the kernel's coarse clock: let it move past the save's before anything writes
    time.sleep(0.05)
    return model


def _mapped(start: int, nbytes: int, file) -> bool:
    if file.suffix == ".safetensors":
        return tensor_files._in_live_mapping(start, nbytes)
    with open("/proc/self/maps") as maps:  # torch's mapping of the .bin: ask the kernel
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= start and start + nbytes <= hi:
                return len(parts) > 5 and os.path.samefile(parts[5], file)
    return False


def _overwrite(file, other) -> None:
    with open(file, "r+b") as fh:  # in place: the same inode, the same size, other weights
        fh.write(other.read_bytes())


def _forward(model):
    with torch.no_grad():
        return model(TOKENS)


def _one_line(err: BaseException, file, *words) -> None:
    text = str(err)
    assert "\n" not in text and str(file) in text, text
    for w in ("changed on disk", "reload the model", "interp.load", "never write over", *words):
        assert w.lower() in text.lower(), (w, text)


# ---- (a) written over in place -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_file_written_over_in_place_is_refused_naming_it(fmt, tmp_path):
    """Before: the forward read the other model's bytes and returned its logits, rc 0."""
    file, other = _pair(tmp_path, fmt)
    model = _load(file)
    before = _forward(model)
    _overwrite(file, other)
    with pytest.raises(CheckpointChanged) as caught:
        _forward(model)
    assert isinstance(caught.value, CheckpointError)  # a UserError: the CLI's one line, exit 2
    _one_line(caught.value, file, "written over in place")
    with pytest.raises(CheckpointChanged):  # and on every later forward: the file stays changed
        model.run_with_cache(TOKENS)
    assert torch.isfinite(before).all()


def test_nan_written_over_the_weights_is_refused_not_computed(tmp_path):
    """NaN weights are refused at load; written into the file afterwards they used to reach the logits."""
    file = _saved(tmp_path / "a", 1)
    model = _load(file)
    header, start = tensor_files.safetensors_header(file)
    begin, end = header["embed.W_E"]["data_offsets"]
    with open(file, "r+b") as fh:
        fh.seek(start + begin)
        fh.write(torch.full(((end - begin) // 4,), float("nan")).numpy().tobytes())
    with pytest.raises(CheckpointChanged) as caught:
        _forward(model)
    _one_line(caught.value, file)


# ---- (b) truncated in place: SIGBUS before, one line now ------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, sys, time, torch, interp
    from interp.errors import UserError
    from pathlib import Path
    file, offload = Path(sys.argv[1]), (sys.argv[2] or None)
    model = interp.load(str(file.parent), offload=offload)
    tokens = torch.arange(12)[None] % model.cfg.d_vocab
    with torch.no_grad():
        model(tokens)
    time.sleep(0.05)
    if sys.argv[3] == "before":
        os.truncate(file, 100)
    else:  # between blocks: after block 0 has run, before block 1 brings its weights in
        def cut(x, hook):
            os.truncate(file, 100)
        model.add_hook("blocks.0.hook_resid_post", cut)
    try:
        with torch.no_grad():
            model(tokens)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print("ran on")
""")


def _run_child(tmp_path, file, offload: str, when: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(file), offload, when], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("offload", ["", "disk"])
def test_a_truncated_file_is_one_line_not_sigbus(offload, tmp_path):
    """Before: the child died of SIGBUS (return code -7), no message."""
    file = _saved(tmp_path / "a", 1)
    proc = _run_child(tmp_path, file, offload, "before")
    assert proc.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: "), proc.stderr
    assert str(file) in proc.stderr and "truncated from" in proc.stderr and "SIGBUS" in proc.stderr, proc.stderr


# ---- (c) offloaded to disk: checked between blocks -----------------------------------------------------------
def test_offloaded_blocks_check_the_file_before_reading_it_again(tmp_path):
    """An offloaded model re-reads each block from the file in every forward: written over after block 0 ran,
    block 1 refuses before reading. Before: the rest of the forward ran on the other weights."""
    file, other = _pair(tmp_path)
    model = _load(file, offload="disk")
    ref = _forward(model)
    model.add_hook("blocks.0.hook_resid_post", lambda x, hook: _overwrite(file, other))
    with pytest.raises(CheckpointChanged) as caught:
        _forward(model)
    model.reset_hooks()
    _one_line(caught.value, file, "written over in place")
    units = model.offload.units.values()
    assert all(u.holds == 0 and u.hooked == 0 for u in units)  # the refused entry took nothing, gave nothing back
    assert all(p.device.type == "meta" for b in model.blocks for p in b.parameters())
    with pytest.raises(CheckpointChanged):
        with model.holding(0, 1):  # outside a forward too; nothing left held after the refusal
            pass
    assert all(u.holds == 0 for u in units) and torch.isfinite(ref).all()


def test_offloaded_blocks_refuse_a_truncation_between_blocks_in_one_line(tmp_path):
    """Truncated while block 0 runs: block 1 would fault its pages in from past the new end (SIGBUS before)."""
    file = _saved(tmp_path / "a", 1)
    proc = _run_child(tmp_path, file, "disk", "between")
    assert proc.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and str(file) in proc.stderr and "truncated" in proc.stderr


# ---- (d) replaced by a new file: the old pages stay mapped; the model runs on and warns once ------------------
@pytest.mark.parametrize("offload", [None, "disk"])
def test_a_replaced_file_keeps_the_loaded_weights_and_warns_once(offload, tmp_path):
    """os.replace gives the path a new inode; the mapping keeps the old one's pages (an offloaded block reads
    them again after its pages were handed back), so the numbers stay the loaded weights'. Before: silent."""
    file, other = _pair(tmp_path)
    model = _load(file, offload=offload)
    before = _forward(model)
    os.replace(other, file)
    new = _forward(interp.load(str(file.parent)))
    assert not torch.equal(new, before)  # the file at the path now holds other weights
    with pytest.warns(CheckpointReplaced) as told:
        after = _forward(model)
    assert torch.equal(after, before)
    assert len(told) == 1 and str(file) in str(told[0].message) and "reload the model" in str(told[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file, not every forward
        assert torch.equal(_forward(model), before)


def test_a_removed_file_keeps_the_loaded_weights_and_warns_once(tmp_path):
    file = _saved(tmp_path / "a", 1)
    model = _load(file)
    before = _forward(model)
    file.unlink()
    with pytest.warns(CheckpointReplaced, match="was removed"):
        assert torch.equal(_forward(model), before)


# ---- (e) an unchanged file: many forwards, one stat per mapped file each ---------------------------------------
@pytest.mark.parametrize("offload", [None, "disk"])
def test_an_unchanged_file_runs_many_forwards_with_one_check_per_file_each(offload, tmp_path, monkeypatch):
    file = _saved(tmp_path / "a", 1)
    model = _load(file, offload=offload)
    ref = _forward(model)
    checks = []
    real = tensor_files.MappedFile.check
    monkeypatch.setattr(tensor_files.MappedFile, "check", lambda self: checks.append(self.path) or real(self))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(200):
            assert torch.equal(_forward(model), ref)
    units = 0 if offload is None else len(model.offload.units)  # each offloaded unit checks as it comes in
    assert checks and set(checks) == {str(file)} and len(checks) == 200 * (1 + units)


def test_a_model_whose_weights_were_copied_checks_nothing(tmp_path):
    file, other = _pair(tmp_path)
    model = interp.load(str(file.parent), dtype=torch.float64)  # a cast: every weight is a copy
    before = _forward(model)
    assert model._weight_files == ()
    _overwrite(file, other)
    assert torch.equal(_forward(model), before)
