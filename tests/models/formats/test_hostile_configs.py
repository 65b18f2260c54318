"""Configs that cannot be a model (issue 56: D5 and the minor cases): a NaN or absurd RoPE parameter, in a
config.json, in GGUF metadata or in `interp.load(rope_scaling=)`, and sizes no model has, in native and wrapped
configs. Each is one line naming what is wrong, before a weight is read; before, a NaN attention factor loaded
and made every logit NaN, and zero heads or 20,000 layers were tracebacks (the latter after 100 s)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import CheckpointError, UserError

transformers = pytest.importorskip("transformers")
NAN = float("nan")


def _one_line(error: BaseException, *needles: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, max_position_embeddings=32,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture
def no_weights(monkeypatch):
    import interp.models.formats.hf as format_hf
    from interp.models.formats import build

    monkeypatch.setattr(format_hf, "read_state_dict", lambda *a, **k: pytest.fail("the weights were read"))
    monkeypatch.setattr(build, "convert_weights", lambda *a, **k: pytest.fail("the weights were converted"))


def _with_config(folder, tmp_path, edit) -> "Path":
    """A copy of `folder` (its files linked) whose config.json `edit` changed."""
    out = tmp_path / "edited"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


ROPE_IN_CONFIG = [
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "attention_factor": NAN},
     "rope_scaling.attention_factor must be a finite number > 0, got nan"),
    ({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 16, "low_freq_factor": NAN,
      "high_freq_factor": 4.0}, "rope_scaling.low_freq_factor must be a finite number > 0, got nan"),
    ({"rope_type": "yarn", "factor": 1e30, "original_max_position_embeddings": 16},
     "rope_scaling.factor must be a finite number from 0.0001 to 10000"),
    ({"rope_type": "linear", "factor": 1e-30}, "rope_scaling.factor must be a finite number from 0.0001 to 10000"),
    ({"rope_type": "default", "rope_theta": NAN}, "rotary_base must be a finite number > 0, got nan"),
]


@pytest.mark.parametrize("params, message", ROPE_IN_CONFIG, ids=["yarn-nan", "llama3-nan", "yarn-1e30", "linear-1e-30",
                                                                 "theta-nan"])
def test_a_config_json_with_a_nan_or_absurd_rope_parameter_is_one_line(params, message, llama_folder, tmp_path,
                                                                        no_weights):
    bad = _with_config(llama_folder, tmp_path, lambda c: c.update(rope_parameters={"rope_theta": 1e4, **params}))
    with pytest.raises(CheckpointError) as e:
        interp.load(bad)
    _one_line(e.value, str(bad / "config.json"), message)


@pytest.mark.parametrize("given, message", [
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": NAN}, "rope_scaling's attention_factor must be a finite"),
    ({"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 16, "low_freq_factor": NAN},
     "rope_scaling's low_freq_factor must be a finite"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": math.inf}, "rope_scaling's beta_fast must be a finite"),
    ("yarn:1e30", "rope_scaling's factor 1e+30 is outside 0.0001 to 10000"),
    ("linear:1e-30", "rope_scaling's factor 1e-30 is outside 0.0001 to 10000"),
])
def test_rope_scaling_given_at_load_is_checked_before_a_weight(given, message, llama_folder, no_weights):
    with pytest.raises(UserError) as e:
        interp.load(llama_folder, rope_scaling=given)
    _one_line(e.value, message)


@pytest.mark.parametrize("spelling", ["yarn:1e30", "linear:1e-30", "yarn:nan"])
def test_absurd_factors_on_the_command_line_are_refused_before_loading(spelling, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    assert cli(["lengths", "rope-gqa-4l", "--lengths", "32", "--no-progress", "--rope-scaling", spelling,
                "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "rope_scaling" in err, err
    assert not out.exists()


# ---- sizes no model has ------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_attention_heads=0), "n_heads=0"),
    (lambda c: c.update(num_hidden_layers="2"), "n_layers='2'"),
], ids=["zero-heads", "string-layers"])
def test_a_native_config_with_sizes_no_model_has_is_one_line(edit, message, llama_folder, tmp_path, no_weights):
    with pytest.raises(CheckpointError) as e:
        interp.load(_with_config(llama_folder, tmp_path, edit))
    _one_line(e.value, "config.json does not describe a model interp can build", message)


@pytest.fixture(scope="module")
def starcoder_folder(tmp_path_factory):
    """A wrapped architecture (no native family): transformers' Starcoder2."""
    torch.manual_seed(0)
    config = transformers.Starcoder2Config(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64,
                                           bos_token_id=0, eos_token_id=0)
    folder = tmp_path_factory.mktemp("starcoder2")
    transformers.Starcoder2ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a whole number >= 1, got 0"),
    (lambda c: c.update(num_hidden_layers="2"), "num_hidden_layers must be a whole number >= 1, got '2'"),
    (lambda c: c.update(num_hidden_layers=20_000), "num_hidden_layers=20000 is more layers than any model has"),
    (lambda c: c["rope_parameters"].update(rope_theta=NAN), "rope_theta must be a finite number > 0, got nan"),
], ids=["zero-heads", "string-layers", "20000-layers", "theta-nan"])
def test_a_wrapped_config_with_sizes_no_model_has_is_one_line_and_quick(edit, message, starcoder_folder, tmp_path):
    bad = _with_config(starcoder_folder, tmp_path, edit)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as e:
        interp.load(bad)
    assert time.perf_counter() - start < 20  # 20,000 layers were built on the meta device first: over 100 s
    _one_line(e.value, str(bad / "config.json"), message)


# ---- code in the folder, in any shape ---------------------------------------------------------------------------
@pytest.mark.parametrize("auto_map, named", [
    (["modeling_evil.EvilForCausalLM"], "modeling_evil.EvilForCausalLM"),
    ("modeling_evil.EvilForCausalLM", "'modeling_evil.EvilForCausalLM'"),
], ids=["list", "string"])
@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_an_auto_map_that_is_a_list_or_a_string_is_refused_in_one_line(auto_map, named, where, llama_folder,
                                                                        tmp_path, no_weights):
    """Was a traceback (a dict was expected); an `auto_map` in any shape names code, and code never runs."""
    from interp.errors import OwnCodeRefused

    bad = _with_config(llama_folder, tmp_path, lambda c: c.update(auto_map=auto_map) if where == "config.json" else None)
    if where == "tokenizer_config.json":
        (bad / where).write_text(json.dumps({"auto_map": auto_map}))
    with pytest.raises(OwnCodeRefused) as e:
        interp.load(bad)
    _one_line(e.value, f"{bad / where} maps {named} to code in the checkpoint folder (auto_map)")
