"""Loading at the checkpoint's cost (DESIGN.md, "Models at the size researchers study"): safetensors
shards are memory-mapped and each tensor adopted in place where its layout allows, with the same state
dict as reading every tensor into memory first; dtype="auto"; the memory estimate that refuses a load
before any weight is read. Small models only: the 1.2B measurement is `interp bench --sections scale`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import interp
from interp.errors import CheckpointError
from interp.models.placement import memory, tensor_files
from interp.models.families import get_family
from interp.models.formats import hf as format_hf
from interp.models.formats.build import build_model, convert_weights
from hf_cases import build_hf
from smol import SMOL, needs_smol

FAMILIES = ["llama-gqa", "gpt2", "neox", "gemma3-text", "qwen3-qknorm-window", "mixtral-window", "opt"]


def _save(name, folder, dtype=torch.float32, shard="20KB"):
    hf = build_hf(name).to(dtype)
    hf.save_pretrained(folder, max_shard_size=shard)
    return hf


def _old_path(folder, dtype):
    """The loader as it was: every tensor of every shard read into memory, converted, then copied in."""
    raw = json.loads((folder / "config.json").read_text())
    family = get_family(raw["model_type"])
    cfg = family.config(raw)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors = {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    return build_model(cfg, convert_weights(family, cfg, tensors, str(folder)), str(folder), dtype, None).state_dict()


def _file_backed(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return tensor_files._in_live_mapping(storage.data_ptr(), storage.nbytes())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mapped_load_gives_the_old_state_dict_exactly(name, dtype, tmp_path):
    folder = tmp_path / name
    _save(name, folder, dtype=dtype)
    assert len(list(folder.glob("*.safetensors"))) > 1, "the test means a sharded checkpoint"
    old = _old_path(folder, dtype)
    new = interp.load(folder, dtype=dtype).state_dict()
    assert old.keys() == new.keys()
    for k in old:
        assert new[k].dtype == old[k].dtype and torch.equal(new[k], old[k]), k


def test_weights_in_the_files_layout_stay_the_files_memory(tmp_path):
    """Accounting, not timing: in the checkpoint's dtype, every weight whose layout is the file's (the
    embedding, the norms, the MLP's up and gate projections, stored out-major as the file is) shares the
    mapped file's storage; only the transposed ones (W_qkv, W_O, W_out, W_U) were copied."""
    folder = tmp_path / "llama"
    _save("llama-gqa", folder, dtype=torch.bfloat16)
    model = interp.load(folder, dtype="auto")
    copied = {k for k, v in model.state_dict().items() if not _file_backed(v)}
    assert {"embed.W_E", "blocks.0.mlp.W_in", "blocks.0.mlp.W_gate", "blocks.1.ln1.w", "ln_final.w"}.isdisjoint(copied)
    assert {k.rsplit(".", 1)[-1] for k in copied} <= {"W_qkv", "W_O_flat", "W_out", "W_U"}, copied
    params = dict(model.named_parameters())
    anon = sum(p.numel() * p.element_size() for k, p in params.items() if not _file_backed(p))
    total = sum(p.numel() * p.element_size() for p in params.values())
    assert anon < 0.6 * total
    # A weight written in place after the load (weight processing) is copied on write; the file is unchanged.
    before = {f.name: f.read_bytes() for f in folder.glob("*.safetensors")}
    with torch.no_grad():
        model.embed.W_E.mul_(2)
    assert before == {f.name: f.read_bytes() for f in folder.glob("*.safetensors")}
    assert torch.equal(interp.load(folder, dtype="auto").embed.W_E * 2, model.embed.W_E)


def test_dtype_auto_keeps_the_checkpoints_and_the_cpu_default_is_float32(tmp_path):
    folder = tmp_path / "llama"
    _save("llama-gqa", folder, dtype=torch.bfloat16)
    assert interp.load(folder, dtype="auto").embed.W_E.dtype == torch.bfloat16
    assert interp.load(folder).embed.W_E.dtype == torch.float32  # CPU default: exact numbers
    assert interp.load(folder, dtype=torch.float16).embed.W_E.dtype == torch.float16


def test_a_missing_shard_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "llama"
    _save("llama-gqa", folder)
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    assert shard.name in str(e.value) and "\n" not in str(e.value)


def test_an_index_naming_an_absent_tensor_is_one_line(tmp_path):
    folder = tmp_path / "llama"
    _save("llama-gqa", folder)
    index = folder / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    shard = sorted(set(raw["weight_map"].values()))[0]
    raw["weight_map"]["model.layers.0.extra.weight"] = shard
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        interp.load(folder)
    assert "model.layers.0.extra.weight" in str(e.value) and shard in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_shard_is_refused_not_mapped_past_its_end(tmp_path):
    folder = tmp_path / "llama"
    _save("llama-gqa", folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        interp.load(folder)
    assert shard.name in str(e.value)


def test_nan_in_a_mapped_shard_is_refused_naming_the_tensor(tmp_path):
    folder = tmp_path / "llama"
    hf = build_hf("llama-gqa")
    with torch.no_grad():
        hf.model.layers[1].mlp.up_proj.weight[3, 4] = float("nan")
    hf.save_pretrained(folder, max_shard_size="20KB")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.W_in \(1 of"):
        interp.load(folder)


def test_a_load_that_cannot_fit_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    folder = tmp_path / "llama"
    _save("llama-gqa", folder, dtype=torch.bfloat16)
    n = interp.load(folder).cfg.n_params()
    monkeypatch.setattr(format_hf, "read_state_dict", lambda *a, **k: pytest.fail("the weights were read"))
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 3 * n)  # float32 (4 n) does not fit, bf16 does
    with pytest.raises(memory.WeightsDoNotFit) as e:
        interp.load(folder)
    message = str(e.value)
    assert "\n" not in message and "float32" in message and "dtype=torch.bfloat16" in message
    assert 'offload="disk"' in message  # what else would fit: one block at a time
    monkeypatch.undo()
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 3 * n)
    assert interp.load(folder, offload="disk").offload.kind == "disk"  # and it does
    monkeypatch.setattr(format_hf, "read_state_dict", lambda *a, **k: pytest.fail("the weights were read"))
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": n)  # nothing fits
    with pytest.raises(memory.WeightsDoNotFit, match="no dtype interp loads in fits"):
        interp.load(folder, dtype="auto")


def test_gguf_still_loads_one_tensor_at_a_time(tmp_path):
    """GGUF dequantizes (it cannot be zero copy); it still goes through the same build."""
    if SMOL is None:
        pytest.skip("no SmolLM2 GGUF")
    model = interp.load(SMOL)
    assert model.embed.W_E.dtype == torch.float32 and torch.isfinite(model.embed.W_E).all()


@pytest.mark.slow
@needs_smol
def test_smollm2s_headline_heads_are_the_same_in_bf16_and_float32():
    """The atlas's headline heads (the five strongest previous-token, duplicate-token and induction heads
    per kind, and the sink heads) of SmolLM2-135M in bf16 weights are float32's; scores accumulate in
    float32 either way. Measured (4 sequences of 48 random tokens repeated once, seed 0): the largest
    detection-score difference 0.0047 (streaming 0.0044), the largest sink alpha difference 0.016; one
    duplicate-token pair swaps ranks (the set of five is the same), and a sink head whose alpha sits within
    0.02 of the threshold (0.3) may fall either side. bf16 ran 3x slower than float32 on this CPU (no AMX)."""
    from interp.analyses.heads import detect_heads
    from interp.analyses.sinks import attention_sinks

    torch.manual_seed(0)
    half = torch.randint(100, 20000, (4, 48))
    tokens = torch.cat([half, half], dim=1)
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = interp.load(SMOL, dtype=dtype)
        assert model.embed.W_E.dtype == dtype
        found[dtype] = detect_heads(model, tokens, method="streaming"), attention_sinks(model, tokens)
    (heads32, sinks32), (heads16, sinks16) = found[torch.float32], found[torch.bfloat16]
    assert heads16.score.dtype == torch.float32 or str(heads16.score.dtype) == "float32"
    assert (heads32.score - heads16.score).abs().max() < 0.01
    for kind in heads32.kind.unique():
        top = lambda frame: {tuple(r) for r in frame[frame.kind == kind].nlargest(5, "score")[["layer", "head"]].values}  # noqa: E731
        assert top(heads32) == top(heads16), kind
    assert (sinks32.alpha - sinks16.alpha).abs().max() < 0.03
    clear = (sinks32.alpha - 0.3).abs() > 0.02
    assert (sinks32.is_sink[clear] == sinks16.is_sink[clear]).all()


def test_a_mapping_that_is_gone_is_never_released_again(tmp_path):
    """Once the last tensor over a file's mapping is freed, its addresses may be reused by anonymous memory;
    `release_pages` (MADV_DONTNEED) would zero that memory, so a freed mapping is no longer one it touches."""
    import gc

    folder = tmp_path / "m"
    interp.save_model(interp.HookedTransformer(interp.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11,
                                                                  n_ctx=8), seed=0), folder)
    mapped = tensor_files.mapped_safetensors(folder / "model.safetensors")
    t = next(v for v in mapped.values() if v.numel() > 64)
    storage = t.untyped_storage()
    where = (storage.data_ptr(), storage.nbytes())
    assert tensor_files._in_live_mapping(*where)
    del mapped, t, storage
    gc.collect()
    assert not tensor_files._in_live_mapping(*where)
    anonymous = torch.arange(4096, dtype=torch.float32)
    tensor_files.release_pages([anonymous])
    assert torch.equal(anonymous, torch.arange(4096, dtype=torch.float32))


def test_a_wrapped_load_that_cannot_fit_is_refused_before_transformers_reads_a_weight(tmp_path, monkeypatch):
    """transformers builds a wrapped architecture: its parameters are counted on the meta device, exactly."""
    import transformers

    from arch_cases import builder

    hf = builder("phi")()
    hf.save_pretrained(tmp_path / "w")
    n = sum(p.numel() for p in hf.parameters())
    assert format_hf.wrapped_n_params(json.loads((tmp_path / "w" / "config.json").read_text())) == n
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("transformers read the weights"))
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 4 * n - 1)  # float32 misses by a byte
    with pytest.raises(memory.WeightsDoNotFit, match="dtype=torch.bfloat16") as e:
        interp.load(tmp_path / "w")
    assert "offload" not in str(e.value)  # a wrapped model cannot be offloaded: not offered
