"""Loading's minor hostile cases (issue 65): quantized checkpoints interp cannot dequantize, memory refusals
that read parameters as bytes or offer what would not fit, dtype strings, `device_map="auto"` without a GPU,
and `interp generate`'s long prompts and sampling options. Each is one line that says what was wrong and what
to do (or one note line where nothing is wrong), before any weight is read where a weight could be.

Before: int8 weights failed deep in `load_state_dict`, float8 ones with torch's `"sum_cpu" not implemented`,
and a bitsandbytes config loaded its (here unquantized) weights as if nothing were said; memory refusals said
`128000.00B weights` and advised a smaller dtype that fit no better; `dtype="float16"` was refused; `--device-map
auto` on a CPU-only machine said nothing; a long prompt was cut unsaid and the advice (`--max-new-tokens 1`)
was refused again; `--temperature` without `--sample` was dropped."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import CheckpointError, UserError
from interp.models.placement import memory
from interp.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _one_line(error: BaseException, *needles: str) -> str:
    text = str(error)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


def _cli_error(capsys, argv) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ---- quantized checkpoints --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=72, max_position_embeddings=32)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def _variant(folder, out, *, tensors=None, config=None):
    """A copy of `folder` with its weights (`tensors`: edits the state dict) or config.json edited."""
    shutil.copytree(folder, out)
    if tensors is not None:
        sd = safetensors_torch.load_file(out / "model.safetensors")
        tensors(sd)
        safetensors_torch.save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        config(raw)
        (out / "config.json").write_text(json.dumps(raw))
    return out


def _codes(dtype, scales: str | None = None):
    """Every projection weight as `dtype` codes (x100, clamped to int8's range), with a `scales` tensor beside each."""
    def edit(sd):
        for k in [k for k in sd if k.endswith("proj.weight")]:
            sd[k] = (sd[k] * 100).clamp(-127, 127).to(dtype)
            if scales is not None:
                sd[k[:-len("weight")] + scales] = torch.ones(1)
    return edit


@pytest.fixture
def no_weights(monkeypatch):
    import interp.models.formats.hf as format_hf

    monkeypatch.setattr(format_hf, "read_state_dict", lambda *a, **k: pytest.fail("the weights were read"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_integer_or_float8_weights_without_scales_are_refused_from_the_header(llama_folder, tmp_path, dtype,
                                                                               no_weights, capsys):
    folder = _variant(llama_folder, tmp_path / "q", tensors=_codes(dtype))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    _one_line(e.value, f"stored as {name}", "proj.weight", "no scale tensors beside them", "unquantized copy")
    assert f"stored as {name}" in _cli_error(capsys, ["info", str(folder)])


@pytest.mark.parametrize("dtype, scales, layout", [
    (torch.float8_e4m3fn, "weight_scale_inv", "block-wise FP8 (weight_scale_inv)"),
    (torch.int8, "weight_scale", "scaled FP8/INT8"),
    (torch.int8, "weight.SCB", "bitsandbytes 8-bit (SCB)"),
])
def test_a_quantized_layout_with_its_scales_is_refused_naming_it(llama_folder, tmp_path, dtype, scales, layout,
                                                                 no_weights):
    folder = _variant(llama_folder, tmp_path / "q", tensors=_codes(dtype, scales))
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    _one_line(e.value, f"is quantized, {layout}", "cannot dequantize", "interp.from_hf")


@pytest.mark.parametrize("method, library", [("bitsandbytes", "bitsandbytes"), ("gptq", "gptqmodel"),
                                             ("awq", "autoawq"), ("fp8", "fp8"), ("some-new-method", "some-new-method")])
def test_a_quantization_config_is_refused_naming_the_method(llama_folder, tmp_path, method, library, no_weights,
                                                            capsys):
    """The folder's weights are plain float32 here: what config.json says is what transformers would act on."""
    folder = _variant(llama_folder, tmp_path / "q",
                      config=lambda raw: raw.update(quantization_config={"quant_method": method, "bits": 4}))
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    _one_line(e.value, f"quant_method '{method}'", "cannot dequantize", library, "interp.from_hf")
    assert f"quant_method '{method}'" in _cli_error(capsys, ["info", str(folder)])


def test_integer_weights_in_a_pytorch_model_bin_are_refused_before_conversion(llama_folder, tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    for f in llama_folder.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    sd = safetensors_torch.load_file(llama_folder / "model.safetensors")
    _codes(torch.int8)(sd)
    torch.save(sd, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    _one_line(e.value, "stored as int8", "no scale tensors beside them")
    # Not every integer tensor is a quantized weight: a buffer that holds no weight (rotary frequencies, a causal
    # mask) may be one, and still loads.
    sd = safetensors_torch.load_file(llama_folder / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(4, dtype=torch.int64)
    torch.save(sd, folder / "pytorch_model.bin")
    assert interp.load(folder).blocks[0].mlp.W_in.dtype == torch.float32


def test_from_hf_refuses_a_model_holding_integer_weights(llama_folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    layer = hf.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter((layer.weight * 100).to(torch.int8), requires_grad=False)
    with pytest.raises(CheckpointError) as e:
        interp.from_hf(hf)
    _one_line(e.value, "LlamaForCausalLM state_dict holds 1 weight tensor(s) stored as int8",
              "'model.layers.0.mlp.up_proj.weight'")


def test_our_format_with_an_integer_weight_is_refused(tmp_path):
    model = interp.HookedTransformer(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8), seed=0)
    folder = interp.save_model(model, tmp_path / "m")
    file = folder / "model.safetensors"
    sd = safetensors_torch.load_file(file)
    sd["blocks.0.attn.W_qkv"] = sd["blocks.0.attn.W_qkv"].to(torch.int8)
    safetensors_torch.save_file(sd, file)
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    _one_line(e.value, "stored as int8 ('blocks.0.attn.W_qkv')")


# ---- memory messages --------------------------------------------------------------------------------------
BIG = ModelConfig(n_layers=24, d_model=2048, n_heads=16, d_mlp=8192, d_vocab=32000, n_ctx=64)  # 1.3 billion parameters


def test_parameters_are_said_as_parameters_and_bytes_as_gib():
    n = BIG.n_params()
    assert memory.parameters_text(n) == f"{n / 1e9:.1f} billion parameters"
    assert memory.parameters_text(128 * 10**12) == "128.0 trillion parameters"
    assert memory.parameters_text(135_000_000) == "135.0 million parameters"
    with pytest.raises(memory.WeightsDoNotFit) as e:
        memory.check_weights_fit(BIG, torch.float32, "cpu", source="m", available=2**30)
    text = _one_line(e.value, f"{n / 1e9:.1f} billion parameters in float32", "GiB")
    assert not re.search(r"\d B weights|\dB weights", text), text
    with pytest.raises(ValueError) as e:
        memory.check_fits(BIG, 1, 8, "cpu", available=memory.FIXED_BYTES + 2**30)
    text = _one_line(e.value, f"{n / 1e9:.1f} billion parameters of 4 bytes each")
    assert not re.search(r"\dB in ", text), text


def test_an_offload_refusal_offers_a_smaller_dtype_only_where_it_fits():
    block32 = memory.largest_unit_bytes(BIG, 4)
    with pytest.raises(memory.WeightsDoNotFit) as e:  # bfloat16 halves the block: it fits
        memory.check_weights_fit(BIG, torch.float32, "cpu", source="m", available=block32 - 1, offload="disk")
    _one_line(e.value, "in bfloat16 it takes", "which fits (dtype=torch.bfloat16)")
    for dtype, available in ((torch.float32, block32 // 4), (torch.bfloat16, block32 // 2 - 1)):
        with pytest.raises(memory.WeightsDoNotFit) as e:  # nothing smaller fits (or nothing is smaller)
            memory.check_weights_fit(BIG, dtype, "cpu", source="m", available=available, offload="disk")
        text = _one_line(e.value, "no smaller dtype interp loads makes it fit", "a device with more memory")
        assert "dtype=torch." not in text and "use a smaller dtype" not in text, text


def test_a_whole_model_refusal_offers_offload_only_where_a_block_fits():
    block32 = memory.largest_unit_bytes(BIG, 4)
    with pytest.raises(memory.WeightsDoNotFit) as e:
        memory.check_weights_fit(BIG, torch.float32, "cpu", source="m", available=block32 // 4)
    text = _one_line(e.value, "no dtype interp loads in fits")
    assert "offload" not in text, text
    with pytest.raises(memory.WeightsDoNotFit) as e:  # a bfloat16 block fits: offload in bfloat16 is offered
        memory.check_weights_fit(BIG, torch.float32, "cpu", source="m", available=block32 // 2)
    _one_line(e.value, 'offload="disk"', "in bfloat16 (dtype=torch.bfloat16)")
    with pytest.raises(ValueError) as e:  # the length check's weights-alone refusal, likewise
        memory.check_fits(BIG, 1, 8, "cpu", available=memory.FIXED_BYTES + block32 - 1)
    text = _one_line(e.value, "not even one block")
    assert "--offload disk (" not in text, text


# ---- dtype strings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dtype", [("float16", torch.float16), ("fp16", torch.float16),
                                         ("torch.float16", torch.float16), ("bfloat16", torch.bfloat16),
                                         ("bf16", torch.bfloat16), ("float32", torch.float32), ("FP32", torch.float32)])
def test_dtype_names_load_as_transformers_takes_them(name, dtype):
    assert interp.load("attn-only-2l", dtype=name).embed.W_E.dtype == dtype


def test_dtype_auto_is_the_checkpoint_own(llama_folder, tmp_path):
    folder = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.bfloat16).save_pretrained(folder)
    assert interp.load(folder, dtype="auto").embed.W_E.dtype == torch.bfloat16
    assert interp.from_hf(transformers.AutoModelForCausalLM.from_pretrained(llama_folder),
                          dtype="bf16").embed.W_E.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", ["fp17", "int8", "float8_e4m3fn", torch.int8, torch.float8_e4m3fn, 16])
def test_other_dtypes_are_refused_listing_the_accepted_ones(bad, monkeypatch):
    from interp import loading

    monkeypatch.setattr(loading, "resolve", lambda *a, **k: pytest.fail("the name was resolved"))
    with pytest.raises(UserError) as e:
        interp.load("attn-only-2l", dtype=bad)
    _one_line(e.value, f"dtype {bad!r} is not one interp loads weights in", "'auto'", "'float16' ('fp16')",
              "'bfloat16' ('bf16')")


# ---- device_map="auto" without a GPU ------------------------------------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    from interp.models.placement import device

    monkeypatch.setattr(device, "available_devices", lambda: ["cpu"])


def test_device_map_auto_without_a_gpu_says_so_in_python(no_gpu):
    import warnings

    from interp import errors

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = interp.load("attn-only-2l", device_map="auto")
    notes = [str(w.message) for w in caught if w.category is getattr(errors, "Note", None)]
    assert notes and all("torch sees no GPU on this machine, so no GPU took the map and the whole model runs on cpu"
                         in n for n in notes), [str(w.message) for w in caught]
    assert model.device.type == "cpu"
    with warnings.catch_warnings(record=True) as caught:  # a map that names the CPU did what it says: no note
        warnings.simplefilter("always")
        interp.load("attn-only-2l", device_map={0: "cpu"})
    assert not [w for w in caught if w.category is errors.Note]


def test_device_map_auto_without_a_gpu_is_one_note_line_in_the_cli(no_gpu, capsys):
    assert cli(["info", "attn-only-2l", "--device-map", "auto"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "no GPU took the map" in notes[0], out


# ---- interp generate -----------------------------------------------------------------------------------------
LONG = "abc " * 300  # 1,200 byte tokens: past attn-only-2l's context (n_ctx 256)


def test_generate_says_when_it_cuts_a_long_prompt_and_generates(capsys):
    assert cli(["generate", "attn-only-2l", LONG, "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "cut to its first 251 tokens" in notes[0] and "n_ctx=256" in notes[0], out
    assert "5 new tokens in" in out


def test_generate_advice_on_a_context_overrun_works(capsys):
    """Whatever overruns the context (a long prompt with too many new tokens, a prompt that fits with too many),
    the --max-new-tokens the refusal names runs. Before, a long prompt was advised --max-new-tokens 1, refused again."""
    for prompt, new in ((LONG, "300"), (LONG, "256"), ("abc " * 60, "40"), ("def f(x):", "1000")):
        err = _cli_error(capsys, ["generate", "attn-only-2l", prompt, "--max-new-tokens", new])
        advised = re.search(r"use --max-new-tokens (\d+)", err)
        assert advised, err
        rc = cli(["generate", "attn-only-2l", prompt, "--max-new-tokens", advised.group(1)])
        out = capsys.readouterr()
        assert rc == 0 and f"{advised.group(1)} new tokens in" in out.out, (prompt[:20], new, err, out.err)


@pytest.mark.parametrize("extra, flags", [(["--temperature", "0.5"], "--temperature applies"),
                                          (["--top-k", "3"], "--top-k applies"),
                                          (["--top-p", "0.9", "--seed", "2"], "--top-p and --seed apply")])
def test_sampling_options_without_sample_are_refused(extra, flags, capsys, monkeypatch):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    err = _cli_error(capsys, ["generate", "attn-only-2l", "hi", *extra])
    assert f"{flags} to sampling" in err and "add --sample" in err, err
    monkeypatch.undo()
    assert cli(["generate", "attn-only-2l", "hi", "--sample", "--max-new-tokens", "3", *extra]) == 0  # applied
    assert "sampled" in capsys.readouterr().out
