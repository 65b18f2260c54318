"""RoPE scaling chosen at inference (`interp.load(..., rope_scaling=...)`, `--rope-scaling TYPE:FACTOR[:LEN]`
on `interp analyze`, `interp kv`, `interp lengths`): every type equal to transformers' own (its
`ROPE_INIT_FUNCTIONS` for the frequencies, its `LlamaForCausalLM` with the same `rope_parameters` for the
logits, past the original length), static NTK to its formula written out, a checkpoint's own scaling
replaced, the flag in settings.json and the report, and every bad input refused in one line before a
weight loads. Tiny random models; SmolLM2 in one slow test."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import UserError
from interp.models.config import ModelConfig, RopeScaling
from interp.models.positions import Rotary, rope_frequencies
from interp.models.rope.choice import ROPE_TYPES, as_hf, choose, parse_rope_scaling, rope_spec
from smol import SMOL, needs_smol

transformers = pytest.importorskip("transformers")

N_CTX, BASE, VOCAB = 32, 10000.0, 97
LONG = 80  # tokens of the logit checks: past N_CTX and past every original length below
# A realistic head for the frequencies (64 dims, base 500000: every regime of YaRN and Llama 3 is reached;
# the tiny model's 4 frequencies are too few), on a config read without weights.
FREQ_CFG = ModelConfig(n_layers=1, d_model=256, n_heads=4, d_vocab=10, n_ctx=1024, positional="rotary",
                       rotary_base=500000.0)
LONGROPE_64 = {"rope_type": "longrope", "original_max_position_embeddings": 256,
               "short_factor": [1.0 + 0.05 * i for i in range(32)], "long_factor": [1.0 + 0.4 * i for i in range(32)]}

# (what a user gives, the same scaling in transformers' rope_parameters, written out by hand)
FREQ_CASES = [
    ("linear:3", {"rope_type": "linear", "factor": 3.0}),
    ("linear:0.5", {"rope_type": "linear", "factor": 0.5}),
    ("dynamic:2", {"rope_type": "dynamic", "factor": 2.0}),
    ("yarn:4", {"rope_type": "yarn", "factor": 4.0}),  # transformers' original length: max_position_embeddings
    ("yarn:8:256", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
     {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5},
     {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}),
    ("llama3:8", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    (RopeScaling("llama3", 32.0, 512, low_freq_factor=2.0, high_freq_factor=8.0),
     {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
      "original_max_position_embeddings": 512}),
    (LONGROPE_64, LONGROPE_64),
]


def _hf_config(params: dict, **sizes):
    sizes = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 64,
             "vocab_size": 10, "max_position_embeddings": 1024, **sizes}
    return transformers.LlamaConfig(**sizes, rope_parameters={**params, "rope_theta": sizes.pop("theta", 500000.0)})


def test_the_types_are_transformers_own_and_ntk():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from interp.commands.choices import ROPE_TYPES as SHOWN

    assert SHOWN == ROPE_TYPES
    assert set(ROPE_TYPES) - {"default", "ntk"} <= set(ROPE_INIT_FUNCTIONS)  # "ntk" is interp's own
    assert "ntk" not in ROPE_INIT_FUNCTIONS


# ---- frequencies and cos / sin against transformers ----------------------------------------------------------
@pytest.mark.parametrize("case", FREQ_CASES, ids=["linear:3", "linear:0.5", "dynamic:2", "yarn:4", "yarn:8:256",
                                                  "yarn-betas-dict", "yarn-mscale-dict", "llama3:8",
                                                  "llama3-RopeScaling", "longrope-dict"])
def test_frequencies_and_cos_sin_equal_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    given, params = case
    cfg = FREQ_CFG.replace(rope_scaling=choose(FREQ_CFG, given))
    hf_cfg = _hf_config(params)
    kind = params["rope_type"]
    for seq_len in [None, 2048] if kind in ("dynamic", "longrope") else [None]:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", seq_len=seq_len)
        inv, scale = rope_frequencies(cfg, seq_len)
        torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale, rel=1e-6)
    positions = torch.arange(2048)[None]  # past the original length (1024, or 256 / 512 where given)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions)
    cos, sin = Rotary(cfg).cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:, :, 0], ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, :, 0], ref_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_static_ntk_is_the_base_rescaled_once(factor):
    """No transformers type to compare with: its formula written out, at every length (never by the sequence)."""
    d = FREQ_CFG.rot_dim
    cfg = FREQ_CFG.replace(rope_scaling=choose(FREQ_CFG, f"ntk:{factor:g}"))
    base = 500000.0 * factor ** (d / (d - 2))
    by_hand = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    for seq_len in (None, 4096):
        inv, scale = rope_frequencies(cfg, seq_len)
        torch.testing.assert_close(inv.double(), by_hand, rtol=1e-6, atol=0)
        assert scale == 1.0


# ---- logits against transformers' Llama, past the original length ----------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama trained without scaling (its n_ctx 32), saved as transformers saves it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, max_position_embeddings=N_CTX,
                                      rope_parameters={"rope_type": "default", "rope_theta": BASE},
                                      initializer_range=0.2)  # weights large enough that positions show in the logits
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))


def _ntk_base(factor: float, d: int = 8) -> float:
    return BASE * factor ** (d / (d - 2))


LOGIT_CASES = [
    ("linear:2", {"rope_type": "linear", "factor": 2.0}),
    ("linear:0.5", {"rope_type": "linear", "factor": 0.5}),
    ("dynamic:2", {"rope_type": "dynamic", "factor": 2.0}),
    ("yarn:2", {"rope_type": "yarn", "factor": 2.0}),
    ("yarn:4:16", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ({"rope_type": "yarn", "factor": 3.0, "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.1},
     {"rope_type": "yarn", "factor": 3.0, "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.1}),
    ("llama3:4:16", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16}),
    ({"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0, 1.2, 1.7, 2.4],
      "long_factor": [1.1, 2.3, 4.7, 9.5]},
     {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0, 1.2, 1.7, 2.4],
      "long_factor": [1.1, 2.3, 4.7, 9.5]}),
    # static NTK: transformers' plain RoPE at the rescaled base is the same model
    ("ntk:2", {"rope_type": "default", "rope_theta": _ntk_base(2.0)}),
    ("ntk:0.5", {"rope_type": "default", "rope_theta": _ntk_base(0.5)}),
]


def _reference(folder, params: dict):
    return transformers.LlamaForCausalLM.from_pretrained(folder, rope_parameters={"rope_theta": BASE, **params}).eval()


@pytest.mark.parametrize("case", LOGIT_CASES, ids=lambda c: c[0] if isinstance(c[0], str) else c[0]["rope_type"])
def test_logits_equal_transformers_llama_with_the_same_rope_parameters(case, llama, tokens):
    given, params = case
    model = interp.load(llama, rope_scaling=given)
    plain = interp.load(llama)
    with torch.no_grad():
        logits, unscaled = model(tokens), plain(tokens)
        ref = _reference(llama, params)(tokens).logits
    assert model.runtime.rope_chosen and not plain.runtime.rope_chosen
    assert float((logits - ref).abs().max()) < 1e-4, float((logits - ref).abs().max())
    assert float((logits - unscaled)[:, N_CTX:].abs().max()) > 0.5  # the scaling is there to be seen (about 5)


def test_every_spelling_is_one_scaling(llama, tokens):
    spellings = ["yarn:2:16", {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 16},
                 {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": BASE},
                 RopeScaling("yarn", 2.0, 16)]
    models = [interp.load(llama, rope_scaling=s) for s in spellings]
    assert len({m.cfg.rope_scaling for m in models}) == 1
    with torch.no_grad():
        first = models[0](tokens)
        for m in models[1:]:
            torch.testing.assert_close(m(tokens), first, rtol=0, atol=0)
    assert rope_spec(as_hf(models[0].cfg.rope_scaling)) == as_hf(models[0].cfg.rope_scaling)  # as recorded, read back
    assert parse_rope_scaling("default") == {"rope_type": "default"}


def test_from_hf_takes_the_scaling_as_load_does(llama, tokens):
    """`interp.from_hf(hf_model, rope_scaling=...)` is the same model as `interp.load(folder, rope_scaling=...)`,
    and transformers' own with those rope_parameters; a bad one is refused before a weight is converted."""
    hf = transformers.LlamaForCausalLM.from_pretrained(llama).eval()
    model = interp.from_hf(hf, rope_scaling="yarn:2")
    assert model.runtime.rope_chosen and model.cfg.rope_scaling == interp.load(llama, rope_scaling="yarn:2").cfg.rope_scaling
    with torch.no_grad():
        ref = _reference(llama, {"rope_type": "yarn", "factor": 2.0})(tokens).logits
        assert float((model(tokens) - ref).abs().max()) < 1e-4
    with pytest.raises(UserError, match="rope_scaling type 'wavy' is not one of"):
        interp.from_hf(hf, rope_scaling="wavy:2")


def test_a_checkpoints_own_scaling_is_replaced(tmp_path, tokens):
    """A checkpoint with YaRN in its config: rope_scaling replaces it (default: plain RoPE), as transformers'
    Llama with the replacing rope_parameters computes."""
    torch.manual_seed(2)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, max_position_embeddings=N_CTX,
                                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": BASE,
                                                       "original_max_position_embeddings": 8})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert interp.load(tmp_path).cfg.rope_scaling.kind == "yarn"
    for given, params in [("default", {"rope_type": "default"}), ("linear:2", {"rope_type": "linear", "factor": 2.0})]:
        model = interp.load(tmp_path, rope_scaling=given)
        assert model.cfg.rope_scaling == (None if given == "default" else RopeScaling("linear", 2.0))
        with torch.no_grad():
            assert float((model(tokens) - _reference(tmp_path, params)(tokens).logits).abs().max()) < 1e-4


def test_a_rescaled_model_saves_and_loads_with_its_scaling(llama, tmp_path, tokens):
    model = interp.load(llama, rope_scaling="llama3:4:16")
    model.save(tmp_path / "saved")
    again = interp.load(tmp_path / "saved")
    assert again.cfg.rope_scaling == model.cfg.rope_scaling
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)


# ---- the commands: the flag, settings.json, the report ---------------------------------------------------------
def _loads_with(monkeypatch) -> list:
    """Every rope_scaling a checkpoint is loaded with, by interp.load or the sweep's worker."""
    import interp.loading
    import interp.models.formats.checkpoint as checkpoint

    seen, original = [], checkpoint.load_checkpoint

    def spy(*a, **k):
        seen.append(k.get("rope_scaling"))
        return original(*a, **k)

    monkeypatch.setattr(checkpoint, "load_checkpoint", spy)
    monkeypatch.setattr(interp.loading, "load_checkpoint", spy)
    return seen


def test_lengths_records_the_scaling_in_settings_and_report(tmp_path, monkeypatch):
    seen = _loads_with(monkeypatch)
    out = tmp_path / "lengths"
    assert cli(["lengths", "rope-gqa-4l", "--lengths", "32,64", "--no-progress", "--rope-scaling", "yarn:2:128",
                "--out", str(out)]) == 0
    assert seen == [{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}]
    record = json.loads((out / "settings.json").read_text())
    assert record["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    assert ("RoPE scaling chosen at inference: YaRN, factor 2, from an original length of 128 tokens"
            in (out / "report.md").read_text())


def test_kv_records_the_scaling_and_its_default_original_length(tmp_path, monkeypatch):
    seen = _loads_with(monkeypatch)
    out = tmp_path / "kv"
    assert cli(["kv", "precision", "rope-gqa-4l", "--precisions", "fp32,int8", "--seq-len", "64",
                "--sensitivity-tokens", "32", "--seeds", "1", "--no-progress", "--rope-scaling", "dynamic:2",
                "--out", str(out)]) == 0
    assert seen == [{"rope_type": "dynamic", "factor": 2.0}]
    record = json.loads((out / "settings.json").read_text())
    assert record["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256}
    assert "dynamic NTK, factor 2, from an original length of 256 tokens" in (out / "report.md").read_text()
    plain = tmp_path / "plain"
    assert cli(["kv", "precision", "rope-gqa-4l", "--precisions", "fp32", "--seq-len", "32", "--sensitivity-tokens",
                "32", "--seeds", "1", "--no-progress", "--out", str(plain)]) == 0
    assert json.loads((plain / "settings.json").read_text())["rope_scaling"] is None
    assert "RoPE scaling" not in (plain / "report.md").read_text()


def test_analyze_records_the_scaling_and_a_rerun_must_match(tmp_path, monkeypatch, capsys):
    seen = _loads_with(monkeypatch)
    out = tmp_path / "atlas"
    base = ["analyze", "rope-gqa-4l", "--analyses", "sinks", "--n-seqs", "2", "--seq-len", "32", "--no-progress",
            "--out", str(out)]
    assert cli([*base, "--rope-scaling", "ntk:0.5"]) == 0
    assert seen == [{"rope_type": "ntk", "factor": 0.5}]
    record = json.loads((out / "settings.json").read_text())
    assert record["rope_scaling"] == {"rope_type": "ntk", "factor": 0.5}
    assert record["runs"]["rope-gqa-4l"]["rope_scaling"] == {"rope_type": "ntk", "factor": 0.5}
    assert "RoPE scaling chosen at inference: static NTK-aware, factor 0.5" in (out / "report.md").read_text()
    capsys.readouterr()
    assert cli([*base, "--rope-scaling", "ntk:2"]) == 2  # other numbers: never one table
    err = capsys.readouterr().err
    assert "computed with other settings" in err and "rope_scaling" in err and err.count("\n") == 1
    assert cli(base) == 2  # nor without the scaling
    capsys.readouterr()
    assert cli([*base, "--rope-scaling", "ntk:0.5"]) == 0 and len(seen) == 1  # the same: resumed, nothing to run


# ---- bad input: one line, before anything loads ------------------------------------------------------------------
BAD = [
    ("bogus:2", "rope_scaling type 'bogus' is not one of default, linear, dynamic, ntk, yarn, llama3, longrope"),
    ("proportional:2", "rope_scaling type 'proportional' is not one of"),  # transformers has it; interp does not
    ("linear:0", "rope_scaling's factor must be > 0, got 0.0"),
    ("ntk:-1", "rope_scaling's factor must be > 0, got -1.0"),
    ("yarn:nan", "rope_scaling's factor must be a finite number"),
    ("yarn:0.5", "rope_scaling 'yarn' stretches the context by its factor, which must be >= 1, got 0.5"),
    ("llama3:0.9", "which must be >= 1, got 0.9"),
    ("dynamic:0.5", "which must be >= 1, got 0.5"),
    ("yarn", "rope_scaling is TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_LEN"),
    ("yarn:two", "the factor is a number and the original length a whole number"),
    ("yarn:2:1.5", "the factor is a number and the original length a whole number"),
    ("yarn:2:0", "original_max_position_embeddings must be >= 1, got 0"),
    ("linear:2:128", "rope_scaling 'linear' does not read original_max_position_embeddings"),
    ("default:2", "rope_scaling 'default' does not read factor"),
    ("longrope:2", "rope_scaling 'longrope' needs short_factor and long_factor"),
]
COMMAND_LINES = {
    "lengths": ["lengths", "rope-gqa-4l", "--lengths", "32", "--no-progress"],
    "kv": ["kv", "passkey", "rope-gqa-4l", "--policies", "full", "--lengths", "64", "--no-progress"],
    "analyze": ["analyze", "rope-gqa-4l", "--analyses", "sinks", "--seq-len", "32", "--no-progress", "--no-report"],
}


@pytest.fixture
def no_loading(monkeypatch):
    import interp.models.formats.checkpoint as checkpoint

    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a checkpoint was loaded"))


def _refused(capsys, argv, message, out):
    assert cli([*argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1, captured.err
    assert not out.exists()


@pytest.mark.parametrize("spelling, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_scaling_is_one_line_before_loading(spelling, message, no_loading, tmp_path, capsys):
    _refused(capsys, [*COMMAND_LINES["lengths"], "--rope-scaling", spelling], message, tmp_path / "out")


@pytest.mark.parametrize("command", COMMAND_LINES)
def test_each_command_refuses_before_loading(command, no_loading, tmp_path, capsys):
    learned = [a.replace("rope-gqa-4l", "attn-only-2l") for a in COMMAND_LINES[command]]  # learned positions
    _refused(capsys, [*learned, "--rope-scaling", "yarn:2"],
             "rope_scaling rescales rotary positions, and this model's positions are learned", tmp_path / "a")
    _refused(capsys, [*COMMAND_LINES[command], "--rope-scaling", "bogus:2"], "rope_scaling type 'bogus'",
             tmp_path / "b")
    _refused(capsys, [*COMMAND_LINES[command], "--rope-scaling", "yarn:0.5"], "must be >= 1", tmp_path / "c")


def test_the_library_refuses_before_reading_a_weight(llama, tmp_path, monkeypatch):
    import interp.models.formats.hf as format_hf

    monkeypatch.setattr(format_hf, "load", lambda *a, **k: pytest.fail("the weights were read"))
    cases = [
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3.0}, "rope_scaling 'linear' does not read beta_fast"),
        ({"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0},
         "rope_scaling's rope_theta=500.0 is not the model's"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
         "longrope short_factor must be a tuple of rotary_dim / 2 = 4 numbers"),
        ({"factor": 2.0}, "rope_scaling type None is not one of"),
        (2.0, "rope_scaling is transformers' rope_parameters (a dict), a RopeScaling or 'TYPE:FACTOR'"),
        (RopeScaling("yarn", 0.0), "rope_scaling's factor must be > 0"),
        ("Yarn:2", "rope_scaling type 'Yarn' is not one of"),
    ]
    for given, message in cases:
        with pytest.raises(UserError) as e:
            interp.load(llama, rope_scaling=given)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    positions = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8)  # learned positions
    with pytest.raises(UserError, match="this model's positions are learned"):
        choose(positions, "yarn:2")


def test_a_wrapped_model_is_refused_in_one_line(tmp_path, monkeypatch):
    """transformers runs a wrapped model, rotary positions included: interp does not swap them under it (set
    rope_parameters in its config.json instead), and says so before loading."""
    import interp.models.formats.hf as format_hf

    config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=1, intermediate_size=72, head_dim=8)
    transformers.GemmaForCausalLM(config).save_pretrained(tmp_path)
    monkeypatch.setattr(format_hf, "load_wrapped", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(UserError, match="is a gemma model that transformers runs .wrapped.: set rope_parameters") as e:
        interp.load(tmp_path, rope_scaling="yarn:2")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="rope_scaling type 'bogus'"):  # a bad spelling is said as that first
        interp.load(tmp_path, rope_scaling="bogus:2")


# ---- SmolLM2's weights ----------------------------------------------------------------------------------------------
@needs_smol
@pytest.mark.slow
def test_smollm2_with_yarn_equals_transformers_llama_with_the_same_rope_parameters():
    """SmolLM2-135M (trained to 8,192 tokens) given YaRN from an original length of 64, on 96 tokens (short, so the
    test is: 30 layers), against transformers' Llama holding the same weights (read from the same GGUF file) and
    the same rope_parameters."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    params = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    plain_hf = AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32).eval()
    config = copy.deepcopy(plain_hf.config)
    config.rope_parameters = {**params, "rope_theta": config.rope_parameters["rope_theta"]}
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(plain_hf.state_dict())
    model = interp.load(SMOL, rope_scaling=params)
    assert model.cfg.rope_scaling == RopeScaling("yarn", 2.0, 64)
    toks = torch.randint(0, 49152, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(toks)
        diff = float((logits - hf(toks).logits).abs().max())  # 5.4e-5 here (unscaled: 5.3e-5)
        moved = float((logits - plain_hf(toks).logits).abs().max())  # about 7
    assert diff < 1e-4, diff
    assert moved > 1.0  # the scaling changed the logits


def test_choose_is_pure_data():
    """The checks read a config, never weights: and a scaling chosen twice is the same scaling."""
    assert choose(FREQ_CFG, "yarn:2") == choose(FREQ_CFG, {"rope_type": "yarn", "factor": 2.0})
    assert choose(FREQ_CFG, "yarn:2").original_max_position == FREQ_CFG.n_ctx
    assert choose(FREQ_CFG, "linear:2").original_max_position is None
    assert choose(FREQ_CFG, "default") is None
    assert math.isclose(choose(FREQ_CFG, "ntk:3").factor, 3.0)
