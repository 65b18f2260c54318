"""Hostile and careless input (issue 24): a checkpoint folder never runs its code, non-finite weights
and metadata are refused on load, impossible sizes and arguments are refused before any work, and text
is read only as far as it is used. Each case is built here, as an attacker or a careless user would."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import interp
from interp import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


# ---- 1. no code from a checkpoint folder, ever ----------------------------------------------------
def _folder_with_code(folder: Path, where: str) -> Path:
    """A tiny Llama checkpoint folder with a tokenizer, whose config.json or tokenizer_config.json maps
    a class to a Python file in the folder; importing that file writes the marker RAN."""
    pytest.importorskip("transformers")
    from hf_cases import build_hf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_hf("llama-gqa").save_pretrained(folder)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(40)}, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t0", eos_token="t0", unk_token="t1").save_pretrained(folder)
    payload = f"import pathlib\npathlib.Path({str(folder / 'RAN')!r}).write_text('ran')\n"
    (folder / "tokenization_evil.py").write_text(
        payload + "from transformers import PreTrainedTokenizerFast\nclass EvilTok(PreTrainedTokenizerFast):\n    pass\n")
    (folder / "modeling_evil.py").write_text(payload)
    file = folder / where
    raw = json.loads(file.read_text())
    if where == "config.json":
        raw["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    else:
        raw["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTok"]}
        raw["tokenizer_class"] = "EvilTok"
    file.write_text(json.dumps(raw))
    return folder


def _run_in_terminal(code: str, answer: bytes = b"y\n", timeout: float = 120) -> tuple[str, float]:
    """Run python -c `code` under a pseudo-terminal, answering `answer` to any [y/N] prompt, as a user
    at a terminal would. Returns (what it printed, seconds)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a fresh interpreter on the terminal
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", code])
    out, start = b"", time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
        if b"[y/N]" in data:
            os.write(fd, answer)
    os.waitpid(pid, 0)
    return out.decode(errors="replace"), time.monotonic() - start


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_folder_that_maps_classes_to_its_own_code_is_refused_without_a_prompt(tmp_path, where):
    folder = _folder_with_code(tmp_path / "ckpt", where)
    code = ("import interp, sys\n"
            f"try:\n    interp.load({str(folder)!r})\nexcept interp.CheckpointError as e:\n    print('REFUSED', e)\n"
            "else:\n    print('LOADED')\n")
    out, seconds = _run_in_terminal(code)
    assert "REFUSED" in out and "LOADED" not in out, out
    assert "[y/N]" not in out  # no prompt, no wait
    assert "never runs a checkpoint's code" in out and "auto_map" in out and where in out
    assert not (folder / "RAN").exists()
    # and through the CLI: one line, exit 2, before any output folder is made
    out_dir = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "interp", "analyze", str(folder), "--out", str(out_dir),
                           "--analyses", "induction", "--no-progress"], capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "never runs a checkpoint's code" in proc.stderr
    assert not (folder / "RAN").exists() and not out_dir.exists()


def test_a_tokenizer_with_its_own_code_loads_when_the_caller_brings_a_tokenizer(tmp_path):
    folder = _folder_with_code(tmp_path / "ckpt", "tokenizer_config.json")
    model = interp.load(folder, tokenizer=object())  # the folder's tokenizer is never read
    assert model.cfg.n_layers > 0 and not (folder / "RAN").exists()


def test_the_tokenizer_reader_itself_never_imports_the_folders_code(tmp_path):
    """The second lock: even called directly (past refuse_own_code), transformers is asked with
    trust_remote_code=False, so it neither prompts nor imports."""
    from interp.models.formats.checkpoint import local_tokenizer

    folder = _folder_with_code(tmp_path / "ckpt", "tokenizer_config.json")
    out, seconds = _run_in_terminal(
        f"from interp.models.formats.checkpoint import local_tokenizer\nfrom pathlib import Path\n"
        f"print('TOKENIZER', type(local_tokenizer(Path({str(folder)!r}))).__name__)\n")
    assert "[y/N]" not in out and "TOKENIZER" in out and "EvilTok" not in out, out
    assert not (folder / "RAN").exists()
    del local_tokenizer


# ---- 3. non-finite weights are refused on load ------------------------------------------------------
def _saved(tmp_path, name="ckpt"):
    from core_models import own

    from interp.models.formats.checkpoint import save_model

    return save_model(own("learned-layernorm"), tmp_path / name)


def _edit_safetensors(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"interp_format": "1"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_on_load_naming_the_tensor(tmp_path, value):
    folder = _saved(tmp_path)

    def poison(t):
        t["blocks.1.attn.W_qkv"][0, 3] = value

    _edit_safetensors(folder, poison)
    with pytest.raises(CheckpointError, match=r"non-finite weights.*blocks\.1\.attn\.W_qkv \(1 of"):
        interp.load(folder)


def test_non_finite_gguf_tensors_are_refused(tmp_path):
    from core_models import tiny_gguf

    def poison(name, array):
        if name == "blk.0.attn_v.weight":
            array[1, 2] = float("nan")

    with pytest.raises(CheckpointError, match="non-finite weights"):
        interp.load(tiny_gguf(tmp_path / "nan.gguf", edit=poison))


# ---- 5. sizes and numbers that cannot be are refused before anything is built ---------------------
@pytest.mark.parametrize("n_layers", [100_000, 10**7])
def test_a_config_that_lies_about_its_size_is_refused_at_once(tmp_path, n_layers):
    folder = _saved(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["config"]["n_layers"] = n_layers
    (folder / "config.json").write_text(json.dumps(raw))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"n_layers={n_layers} but .*model.safetensors holds 2 blocks"):
        interp.load(folder)
    assert time.monotonic() - start < 5  # was 160 s and 5 GB for 100000, unbounded for 10^7


def test_a_config_whose_widths_disagree_with_the_header_is_refused(tmp_path):
    folder = _saved(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["config"]["d_mlp"] = 10**9
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\..* has shape .* the config implies"):
        interp.load(folder)


@pytest.mark.parametrize("metadata, message", [
    (dict(head_count=0), r"head_count = 0 is not a size"),
    (dict(block_count=0), r"block_count = 0 is not a size"),
    (dict(layer_norm_rms_eps=float("nan")), r"layer_norm_rms_epsilon = nan is not a finite number > 0"),
    (dict(layer_norm_rms_eps=-1e-5), r"layer_norm_rms_epsilon = -[0-9.e-]+ is not a finite number > 0"),
    (dict(rope_freq_base=float("nan")), r"rope.freq_base = nan is not a finite number > 0"),
    (dict(rope_freq_base=float("inf")), r"rope.freq_base = inf is not a finite number > 0"),
], ids=["heads-0", "blocks-0", "eps-nan", "eps-negative", "rope-nan", "rope-inf"])
def test_gguf_metadata_numbers_are_validated(tmp_path, metadata, message):
    from core_models import tiny_gguf

    with pytest.raises(CheckpointError, match=message):
        interp.load(tiny_gguf(tmp_path / "bad.gguf", **metadata))


@pytest.mark.parametrize("field, value", [("norm_eps", float("nan")), ("norm_eps", -1.0), ("rotary_base", float("nan")),
                                          ("rotary_base", 0.0), ("attn_scale", float("inf"))])
def test_config_reals_must_be_finite_and_positive(field, value):
    from interp import ModelConfig

    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=11, n_ctx=8, positional="rotary", **{field: value})


@pytest.fixture(scope="module")
def learned():
    from core_models import own

    return own("learned-layernorm")  # learned positions, n_ctx 32, no tokenizer


def test_generate_past_a_learned_position_table_is_refused_before_decoding(learned, monkeypatch):
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])  # 10 tokens, n_ctx 32: room for 23 new ones
    calls = []
    forward = type(learned).forward
    monkeypatch.setattr(type(learned), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    with pytest.raises(ValueError, match=r"10-token prompt plus max_new_tokens=30 runs past .* learned position "
                                         r"table \(n_ctx=32\): pass max_new_tokens=23 or less"):
        learned.generate(prompt, max_new_tokens=30)
    assert not calls  # nothing was decoded (and lost)
    assert learned.generate(prompt, max_new_tokens=23, stop_at_eos=False).shape == (1, 33)  # exactly the limit works
    long = torch.ones(1, 33, dtype=torch.long)
    with pytest.raises(ValueError, match="shorten the prompt to 32 tokens or fewer"):
        learned.generate(long, max_new_tokens=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), r"max_new_tokens must be >= 0, got -1"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer, got 2.5"),
    (dict(temperature=-0.5, do_sample=True), r"temperature must be >= 0, got -0.5"),
    (dict(temperature=float("nan"), do_sample=True), r"temperature must be a finite number, got nan"),
    (dict(top_p=0.0, do_sample=True), r"top_p must be > 0"),
    (dict(top_p=1.5, do_sample=True), r"top_p must lie in \(0, 1\]"),
    (dict(top_k=-2, do_sample=True), r"top_k must be >= 0"),
])
def test_generate_settings_that_cannot_work(learned, kwargs, message):
    from interp.errors import UserError

    with pytest.raises(UserError, match=message):
        learned.generate(torch.tensor([[1, 2, 3]]), **kwargs)


def _cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "interp", *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def _one_line(proc, pattern: str) -> None:
    import re

    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("error: "), err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("argv, pattern, wrote", [
    (["train", "attn-only-2l", "--threads", "0", "--steps", "5"], r"threads must be between 1 and \d+, got 0", "OUT"),
    (["train", "attn-only-2l", "--threads", "100000", "--steps", "5"], r"got 100000; this machine has \d+ CPU", "OUT"),
    (["train", "attn-only-2l", "--steps", "-1"], r"steps must be >= 1, got -1", "OUT"),
    (["train", "attn-only-2l", "--seed", "-1", "--steps", "5"], r"seed must be >= 0, got -1", "OUT"),
    (["bench", "--quick", "--threads", "0", "--sections", "forward"], r"threads must be between 1 and", "BENCH.md"),
    (["bench", "--quick", "--threads", "100000", "--sections", "forward"], r"got 100000", "BENCH.md"),
    (["info", "attn-only-2l", "--context", "-5"], r"context must be >= 1, got -5", None),
    (["sweep", "attn-only-2l", "--seed", "-1", "--analyses", "induction"], r"seed must be between 0 and", "OUT"),
    (["analyze", "attn-only-2l", "--n-seqs", "0", "--analyses", "induction"], r"n_seqs must be >= 1, got 0", "OUT"),
], ids=["train-threads-0", "train-threads-huge", "train-steps", "train-seed", "bench-threads-0", "bench-threads-huge",
        "info-context", "sweep-seed", "analyze-n-seqs"])
def test_cli_settings_that_cannot_work_are_one_line_and_write_nothing(tmp_path, argv, pattern, wrote):
    out = tmp_path / "OUT"
    if wrote == "OUT":
        argv = [*argv, "--out", str(out)]
    elif wrote:
        argv = [*argv, "--out", str(tmp_path / wrote)]
    _one_line(_cli(*argv, cwd=tmp_path), pattern)
    assert not list(tmp_path.iterdir())  # nothing written, no empty folder left behind


def test_a_token_file_with_negative_ids_is_refused_before_anything_is_written(tmp_path):
    import numpy as np

    ids = np.arange(64 * 2, dtype=np.int64).reshape(2, 64) % 50
    ids[1, 7] = -1
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "out"
    _one_line(_cli("sweep", "attn-only-2l", "--data", "file", "--data-file", str(tmp_path / "ids.npy"), "--n-seqs", "2",
                   "--seq-len", "64", "--analyses", "induction", "--out", str(out)), r"negative token id -1")
    assert not out.exists()


# ---- 6. text is read as far as it is used -----------------------------------------------------------
class CountingTokenizer:
    """A whitespace tokenizer that counts the characters it was asked to encode."""

    bos_token_id = 0

    def __init__(self):
        self.chars = 0

    def encode(self, text, add_special_tokens=False):
        self.chars += len(text)
        return [1 + len(w) % 40 for w in text.split()]


def test_a_big_text_file_is_tokenized_only_as_far_as_the_windows_reach(tmp_path):
    from interp.analyses import data as sweep_data
    from interp.analyses.data import DataSpec, check_data

    big = tmp_path / "big.txt"
    line = "the quick brown fox jumps over the lazy dog again and again\n"
    with open(big, "w") as f:
        for _ in range(50 * 2**20 // (len(line) * 1000)):
            f.write(line * 1000)  # 50 MB
    spec = DataSpec(kind="text", n_seqs=2, seq_len=64, seed=0, path=str(big))
    check_data(spec)  # reads only n_seqs * seq_len characters
    assert sum(len(p) for p in sweep_data._text_pieces(str(big), limit=128)) < 2 * sweep_data._PIECE_CHARS
    tok = CountingTokenizer()
    windows = sweep_data._text_windows(spec, tok)
    assert windows.shape == (2, 64) and (windows[:, 0] == 0).all()
    assert tok.chars < 2 * sweep_data._PIECE_CHARS  # was all 50 MB (148 s and 8 GB on SmolLM2's tokenizer)
    # the windows are consecutive stretches of the text's first pool of windows, and reproducible
    body = CountingTokenizer().encode(big.read_text()[: 4 * sweep_data._PIECE_CHARS])
    for row in windows[:, 1:].tolist():
        assert any(body[i : i + 63] == row for i in range(0, sweep_data.TEXT_POOL * 2 * 63, 63))
    assert torch.equal(windows, sweep_data._text_windows.__wrapped__(spec, CountingTokenizer()))
