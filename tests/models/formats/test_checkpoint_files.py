"""A checkpoint reads its own files only (issue 65, security 2): a `model.safetensors.index.json` whose
`weight_map` names `../elsewhere/x.safetensors` or an absolute path made interp load, compute with and report on
any file the user could read, exit 0. Every file a folder names (the index's shards, config.json's and
tokenizer_config.json's `..._file` entries) must lie inside it, refused in one line before any weight is read,
by `interp.load`, the dtype probe, the commands and transformers' own loader of a wrapped folder alike. A shard
that is itself a symbolic link stays allowed: that is the Hugging Face cache's layout. A tensor two shards hold
is refused too (the later copy was used silently)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import CheckpointError
from interp.models.formats.checkpoint import checkpoint_dtype, load_checkpoint

transformers = pytest.importorskip("transformers")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Llama saved in several shards, and its logits."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, max_position_embeddings=32)
    hf = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("sharded") / "llama"
    hf.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    toks = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        return folder, toks, hf(toks).logits


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def _point_a_shard_at(copy: Path, target: str) -> str:
    """Edit the copy's index so that the tensors of its first shard are read from `target`; the shard's name."""
    index = json.loads((copy / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (target if v == first else v) for k, v in index["weight_map"].items()}
    (copy / INDEX).write_text(json.dumps(index))
    return first


def _one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_a_sharded_folder_loads_and_equals_transformers(sharded):
    folder, toks, ref = sharded
    with torch.no_grad():
        torch.testing.assert_close(interp.load(str(folder))(toks), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["parent", "absolute", "dotted"])
def test_an_index_that_names_a_file_outside_the_folder_is_refused_before_any_weight(sharded, tmp_path, where,
                                                                                     monkeypatch):
    folder, _, _ = sharded
    copy = _copy(folder, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    first = sorted(set(json.loads((copy / INDEX).read_text())["weight_map"].values()))[0]
    shutil.copy(copy / first, elsewhere / "x.safetensors")  # the same tensors: before, they loaded with rc 0
    target = {"parent": "../elsewhere/x.safetensors", "absolute": str(elsewhere / "x.safetensors"),
              "dotted": f"./sub/../../elsewhere/x.safetensors"}[where]
    _point_a_shard_at(copy, target)
    import interp.models.placement.tensor_files as tensor_files

    monkeypatch.setattr(tensor_files, "mapped_safetensors", lambda *a: pytest.fail("a shard was read"))
    with pytest.raises(CheckpointError) as e:
        interp.load(str(copy))
    _one_line(e.value, INDEX, repr(target), "not a file inside")
    with pytest.raises(CheckpointError):
        checkpoint_dtype(None, copy, {})  # the dtype probe reads no header outside the folder either


def test_the_commands_refuse_it_in_one_line(sharded, tmp_path, capsys):
    folder, _, _ = sharded
    copy = _copy(folder, tmp_path)
    _point_a_shard_at(copy, "../elsewhere/x.safetensors")
    out = tmp_path / "out"
    rc = cli(["analyze", str(copy), "--out", str(out), "--analyses", "previous_token", "--data", "repeated_random",
              "--n-seqs", "1", "--seq-len", "8", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and "not a file inside" in err, err
    assert not out.exists() or not any(out.iterdir())


def test_a_folder_on_the_way_that_links_out_is_refused(sharded, tmp_path):
    folder, _, _ = sharded
    copy = _copy(folder, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    first = _point_a_shard_at(copy, "sub/x.safetensors")
    shutil.copy(copy / first, elsewhere / "x.safetensors")
    (copy / "sub").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError) as e:
        interp.load(str(copy))
    _one_line(e.value, "'sub/x.safetensors'")


def test_shards_that_are_links_as_in_the_hub_cache_load(sharded, tmp_path):
    """snapshots/<rev>/model-00001-of-0000n.safetensors -> ../../blobs/<hash>: allowed, and the same logits."""
    folder, toks, ref = sharded
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        blob = blobs / f"{abs(hash(f.name)):x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    with torch.no_grad():
        torch.testing.assert_close(interp.load(str(snap))(toks), ref, rtol=1e-4, atol=1e-4)


def test_a_tensor_two_shards_hold_is_refused(sharded, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _, _ = sharded
    copy = _copy(folder, tmp_path)
    shards = sorted(set(json.loads((copy / INDEX).read_text())["weight_map"].values()))
    first, second = load_file(copy / shards[0]), load_file(copy / shards[1])
    name = next(iter(first))
    save_file({**second, name: first[name] + 1}, copy / shards[1])  # a second, different copy
    with pytest.raises(CheckpointError) as e:
        interp.load(str(copy))
    _one_line(e.value, "both hold tensor", repr(name))


@pytest.mark.parametrize("entry", ["/etc/hostname", "../elsewhere/tokenizer.json"])
def test_a_tokenizer_config_naming_a_file_outside_is_refused_unless_a_tokenizer_is_given(sharded, tmp_path, entry):
    folder, toks, ref = sharded
    copy = _copy(folder, tmp_path)
    (copy / "tokenizer_config.json").write_text(json.dumps({"tokenizer_file": entry}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(copy)
    _one_line(e.value, "tokenizer_config.json's tokenizer_file", repr(entry))
    with torch.no_grad():  # the folder's tokenizer is never read when the caller brings one
        torch.testing.assert_close(load_checkpoint(copy, tokenizer=object())(toks), ref, rtol=1e-4, atol=1e-4)


def test_a_wrapped_folder_is_refused_before_transformers_follows_its_index(tmp_path, monkeypatch):
    """transformers' own from_pretrained joins the folder and the index's entry, so it would read an absolute
    path: the check comes first."""
    cfg = transformers.Starcoder2Config(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=2, intermediate_size=64, max_position_embeddings=32)
    folder = tmp_path / "starcoder"
    transformers.Starcoder2ForCausalLM(cfg).save_pretrained(folder, max_shard_size="20KB")
    assert (folder / INDEX).is_file()
    _point_a_shard_at(folder, str(tmp_path / "x.safetensors"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("transformers was asked to load it"))
    with pytest.raises(CheckpointError) as e:
        interp.load(str(folder))
    _one_line(e.value, "not a file inside")
