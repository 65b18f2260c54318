"""Several GPUs (`interp.load(..., device_map=...)`, `--device-map`, `interp.models.placement.device_map`), on the CPU: under
`simulated_gpu(devices=2)` the CPU plays cuda:0 and cuda:1, and any operation mixing them (or a device with the
host) raises, so a model split over the two runs only if every tensor crosses where it should. Its logits,
caches, statistics and atlas are then those of the model on one device, exactly. Bad maps are one line each,
before any weight is read."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import interp
from interp.cli import main as cli
from interp.errors import UserError
from interp.models.placement.device_map import DeviceMapRefused, parse_device_map, resolve_device_map
from interp.testing import DeviceMixError, simulated_gpu

from core_models import OWN_CONFIGS, build

SPLIT = ["rotary-rms-swiglu-gqa", "learned-layernorm", "alibi-6heads", "gemma3-like", "learned-tied-rms",
         "sinusoidal", "no-norm-mqa-window"]


def _tokens(cfg, n=2, p=12, seed=0):
    return torch.randint(cfg.d_vocab, (n, p), generator=torch.Generator().manual_seed(seed))


def _halves(n_layers: int) -> dict:
    return {l: "cuda:0" if l < max(1, n_layers // 2) else "cuda:1" for l in range(n_layers)}


def _same(a, b):
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _check(one, split, tokens):
    with torch.no_grad():
        _same(one(tokens.to(one.device)), split(tokens.to(split.device)))
        _same(one(tokens.to(one.device), return_type="loss"), split(tokens.to(split.device), return_type="loss"))
        _, a = one.run_with_cache(tokens.to(one.device))
        _, b = split.run_with_cache(tokens.to(split.device))
        assert list(a.keys()) == list(b.keys())
        for k in a.keys():
            _same(a[k], b[k])
        sa, sb = one.attention_stats(tokens.to(one.device)), split.attention_stats(tokens.to(split.device))
        assert sa.keys() == sb.keys()
        for k in sa:
            _same(sa[k].stack(), sb[k].stack())
        _same(torch.stack([sb[k].sink for k in sb]), torch.stack([sa[k].sink for k in sa]))  # one device: stackable
        _same(one.W_Q, split.W_Q)  # the weight views stack every layer on the first device
        mask = torch.ones_like(tokens)
        mask[0, :3] = 0  # a left-padded row: the AttentionMask's key_valid crosses with the residual stream
        _same(one(tokens.to(one.device), attention_mask=mask.to(one.device)),
              split(tokens.to(split.device), attention_mask=mask.to(split.device)))
    return b


@pytest.mark.parametrize("name", SPLIT)
def test_our_format_split_over_two_devices_gives_the_same_numbers(name, tmp_path):
    build(OWN_CONFIGS[name]).save(tmp_path / "m")
    n = OWN_CONFIGS[name].n_layers
    with simulated_gpu(devices=2):
        one = interp.load(tmp_path / "m", device="cuda:0")
        split = interp.load(tmp_path / "m", device_map=_halves(n))
        assert split.device == torch.device("cuda:0") and split.device_map[f"blocks.{n - 1}"] == torch.device("cuda:1")
        assert split.blocks[n - 1].attn.W_O_flat.device == torch.device("cuda:1")  # each weight straight to its device
        assert split.embed.W_E.device == torch.device("cuda:0")
        cache = _check(one, split, _tokens(one.cfg))
        assert cache[f"blocks.{n - 1}.hook_resid_post"].device == torch.device("cuda:1")  # hooks see their block's device
        assert cache["blocks.0.hook_resid_pre"].device == torch.device("cuda:0")


try:  # every native family a tiny transformers model covers (tests/support/arch_cases.py needs transformers)
    from arch_cases import COVERED, builder
    from interp.models.families import FAMILIES

    NATIVE = [t for t in COVERED if t in FAMILIES]
except ImportError:  # pragma: no cover - without transformers
    NATIVE = []


@pytest.mark.parametrize("model_type", NATIVE)
def test_every_native_family_split_over_two_devices_gives_the_same_numbers(model_type, tmp_path):

    builder(model_type)().save_pretrained(tmp_path / "m")
    with simulated_gpu(devices=2):
        one = interp.load(tmp_path / "m", device="cuda:0", dtype=torch.float32)
        split = interp.load(tmp_path / "m", device_map=_halves(one.cfg.n_layers), dtype=torch.float32)
        _check(one, split, _tokens(one.cfg))


@pytest.mark.parametrize("name", ["learned-layernorm", "learned-tied-rms"])
def test_weight_processing_of_a_split_model_is_that_of_the_model_on_one_device(name, tmp_path):
    build(OWN_CONFIGS[name]).save(tmp_path / "m")
    steps = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
    with simulated_gpu(devices=2):
        one = interp.load(tmp_path / "m", device="cuda:0", **steps)
        split = interp.load(tmp_path / "m", device_map={0: "cuda:0", 1: "cuda:1"}, **steps)
        assert split.blocks[1].attn.b_O.device == torch.device("cuda:1")  # a bias processing made, on its block's device
        with torch.no_grad():
            _same(one(_tokens(one.cfg).to(one.device)), split(_tokens(one.cfg).to(split.device)))


def test_units_named_apart_from_their_neighbours(tmp_path):
    """The position embedding, ln_final and the unembedding each on a device of their own."""
    build(OWN_CONFIGS["learned-layernorm"]).save(tmp_path / "m")
    with simulated_gpu(devices=2):
        one = interp.load(tmp_path / "m", device="cuda:0")
        split = interp.load(tmp_path / "m", device_map={"pos_embed": "cuda:1", 0: "cuda:0", 1: "cuda:1",
                                                        "ln_final": "cuda:0", "unembed": "cuda:1"})
        _check(one, split, _tokens(one.cfg))


def test_an_all_cpu_map_without_the_simulation_is_the_plain_model(tmp_path):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    plain = interp.load(tmp_path / "m")
    mapped = interp.load(tmp_path / "m", device_map={0: "cpu", 1: "cpu", "unembed": "cpu"})
    assert mapped.device_map["unembed"] == torch.device("cpu") and plain.device_map is None
    tokens = _tokens(plain.cfg)
    with torch.no_grad():
        _same(plain(tokens), mapped(tokens))
    auto = interp.load(tmp_path / "m", device_map="auto")  # no GPU here: everything on the CPU
    assert set(auto.device_map.values()) == {torch.device("cpu")}
    with torch.no_grad():
        _same(plain(tokens), auto(tokens))
        assert auto.generate(tokens[:1, :4], 3).shape == (1, 7)  # one device: the KV cache is fine


def test_auto_splits_evenly_over_the_devices_torch_sees():
    cfg = OWN_CONFIGS["gemma3-like"].replace(n_layers=5, layer_types=None)
    with simulated_gpu(devices=2):
        placed = resolve_device_map("auto", cfg)
    blocks = [placed[f"blocks.{l}"].index for l in range(5)]
    assert blocks == [0, 0, 0, 1, 1] and placed["embed"].index == 0
    assert placed["unembed"].index == 0  # tied: the unembedding reads the embedding's matrix
    assert placed["ln_final"].index == 1


def test_units_left_out_follow_the_block_before_them():
    cfg = OWN_CONFIGS["learned-layernorm"].replace(n_layers=4)
    with simulated_gpu(devices=2):
        placed = resolve_device_map({2: "cuda:1"}, cfg)
        assert [placed[f"blocks.{l}"].index for l in range(4)] == [1, 1, 1, 1]
        placed = resolve_device_map({0: "cuda:0", 2: "cuda:1"}, cfg)
        assert [placed[f"blocks.{l}"].index for l in range(4)] == [0, 0, 1, 1]
        assert placed["embed"].index == placed["pos_embed"].index == 0
        assert placed["ln_final"].index == placed["unembed"].index == 1
        placed = resolve_device_map({"blocks.0": "cuda:1", "unembed": "cuda:0"}, cfg)
        assert placed["embed"].index == 1 and placed["unembed"].index == 0
    assert parse_device_map("0-1:cuda:0,2-3:cuda:1,unembed:cuda:0") == {0: "cuda:0", 1: "cuda:0", 2: "cuda:1",
                                                                        3: "cuda:1", "unembed": "cuda:0"}
    assert parse_device_map(" auto ") == "auto"


def test_mixing_the_two_simulated_devices_raises(tmp_path):
    with simulated_gpu(devices=2):
        a, b, host = torch.ones(3, device="cuda:0"), torch.ones(3).to("cuda:1"), torch.ones(3)
        assert (a.device, b.device, host.device) == (torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu"))
        assert (a + torch.tensor(2.0)).tolist() == [3, 3, 3] and (b.to(a) + a).device == a.device
        assert torch.arange(3, device=b.device).device == b.device and b.cpu().device.type == "cpu"
        for mix in (lambda: a + b, lambda: torch.cat([a, b]), lambda: a + host,
                    lambda: a * torch.tensor(2.0, device="cuda:1"), lambda: b.numpy()):
            with pytest.raises(DeviceMixError):
                mix()
        build(OWN_CONFIGS["learned-layernorm"]).save(tmp_path / "m")
        split = interp.load(tmp_path / "m", device_map={0: "cuda:0", 1: "cuda:1"})
        tokens = _tokens(split.cfg).to("cuda:0")
        with torch.no_grad():
            split(tokens)
            handle = split.blocks[1]._forward_pre_hooks.popitem()  # the hook that brings block 1 its inputs, gone
            with pytest.raises(DeviceMixError, match="cuda:0, cuda:1"):
                split(tokens)
    assert handle is not None


@pytest.mark.parametrize("device_map, kwargs, says", [
    ({0: "cuda:2"}, {}, "not available"),
    ({5: "cuda:1"}, {}, "layers 0-1"),
    ({"blocks.9": "cuda:1"}, {}, "layers 0-1"),
    ({"lm_head": "cuda:1"}, {}, "does not have"),
    ({"pos_embed": "cuda:1"}, {}, "does not have"),  # rotary: no position embedding
    ({}, {}, "names no device"),
    ({0: "cuda:0", 1: "cuda:1"}, {"device": "cuda:1"}, "disagree"),
    ({0: "cuda:0", 1: "cuda:1"}, {"offload": "disk"}, "give one of the two"),
    ("everywhere", {}, "'auto'"),
])
def test_bad_maps_are_one_line_before_any_weight_is_read(device_map, kwargs, says, tmp_path, monkeypatch):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    from interp.models.formats import build as build_module

    monkeypatch.setattr(build_module, "build_model", lambda *a, **k: pytest.fail("a weight was read"))
    with simulated_gpu(devices=2):
        with pytest.raises(UserError, match=says) as e:
            interp.load(tmp_path / "m", device_map=device_map, **kwargs)
    assert len(str(e.value).splitlines()) == 1


def test_a_tied_unembedding_apart_from_the_embedding_and_a_kv_cache_are_refused(tmp_path):
    build(OWN_CONFIGS["learned-tied-rms"]).save(tmp_path / "m")
    with simulated_gpu(devices=2):
        with pytest.raises(DeviceMapRefused, match="ties them"):
            interp.load(tmp_path / "m", device_map={0: "cuda:0", 1: "cuda:1", "unembed": "cuda:1"})
        split = interp.load(tmp_path / "m", device_map={0: "cuda:0", 1: "cuda:1"})
        with pytest.raises(DeviceMapRefused, match="KV cache"):
            split.new_kv_cache(1)
        with pytest.raises(DeviceMapRefused, match="KV cache"):
            split.generate(_tokens(split.cfg)[:1].to(split.device), 2)
        with pytest.raises(DeviceMapRefused, match="split over devices"):
            split.to("cuda:1")
        assert split.to(torch.float32) is split  # a dtype alone is fine


def test_a_wrapped_model_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    builder("phi")().save_pretrained(tmp_path / "w")
    with pytest.raises(DeviceMapRefused, match="transformers runs this architecture"):
        interp.load(tmp_path / "w", device_map="auto")
    assert cli(["analyze", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--device-map", "auto",
                "--no-progress"]) == 2
    assert "wrapped" in capsys.readouterr().err and not (tmp_path / "o").exists()


# every analysis of the atlas but those reading the KV cache (streaming, retrieval: refused on a split model)
ANALYSES = "previous_token,duplicate_token,induction,sinks,viewer,composition,ablation,pruning,importance,loss"


def test_the_atlas_split_over_two_devices_is_the_atlas(tmp_path, capsys):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    tables = []
    with simulated_gpu(devices=2):
        for extra in (["--device", "cuda:0"], ["--device-map", "0:cuda:0,1:cuda:1"]):
            out = tmp_path / f"out{len(tables)}"
            assert cli(["analyze", str(tmp_path / "m"), "--out", str(out), "--seq-len", "16", "--n-seqs", "2",
                        "--no-progress", "--no-report", "--analyses", ANALYSES, *extra]) == 0, capsys.readouterr()
            assert (out / "errors.json").read_text().strip() == "[]"
            t = pd.read_csv(out / "results.csv")
            tables.append(t.sort_values([c for c in t.columns if c != "value"]).reset_index(drop=True))
    assert len(tables[0]) > 100
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)


@pytest.mark.parametrize("argv, says", [
    (["--device-map", "0-1:cuda:0", "--offload", "disk"], "give one of"),
    (["--device-map", "0-3:cuda:0"], "layers 0-1"),
    (["--device-map", "3-1:cuda:0"], "backwards"),
    (["--device-map", "head:cuda:0"], "is not a layer"),
    (["--device-map", "0:cuda:0,0:cuda:1"], "twice"),
    (["--device-map", "0-1:cuda:7"], "not available"),
])
def test_bad_device_maps_on_the_command_line_are_one_line(argv, says, tmp_path, capsys):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    with simulated_gpu(devices=2):
        assert cli(["analyze", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--no-progress",
                    "--analyses", "induction", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_info_and_generate_read_the_device_map(tmp_path, capsys):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    with simulated_gpu(devices=2):
        assert cli(["info", str(tmp_path / "m"), "--device-map", "0:cuda:0,1:cuda:1"]) == 0
        assert "embed, blocks.0 on cuda:0; blocks.1, ln_final, unembed on cuda:1" in capsys.readouterr().out
        assert cli(["generate", str(tmp_path / "m"), "x", "--device-map", "0:cuda:0,1:cuda:1"]) == 2
        assert "KV cache" in capsys.readouterr().err


def test_a_study_split_over_two_devices_is_the_study_on_one(tmp_path, capsys):
    """interp lengths: its table with the blocks split is the one-device table; a study that reads the KV cache
    (interp kv precision) is refused in one line before loading."""
    tables = []
    with simulated_gpu(devices=2):
        for extra in (["--device", "cuda:0"], ["--device-map", "0-1:cuda:0,2-3:cuda:1"]):
            out = tmp_path / f"lengths{len(tables)}"
            assert cli(["lengths", "rope-gqa-4l", "--lengths", "32,64", "--no-progress", "--out", str(out),
                        *extra]) == 0, capsys.readouterr()
            tables.append(pd.read_csv(out / "lengths.csv"))
        assert cli(["kv", "precision", "attn-only-2l", "--seq-len", "96", "--out", str(tmp_path / "kv"), "--no-progress",
                    "--device-map", "0:cuda:0,1:cuda:1"]) == 2
        err = capsys.readouterr().err
        assert "KV cache" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "kv").exists()
        assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "4", "--no-progress",
                    "--out", str(tmp_path / "c"), "--device-map", "0:cuda:0,1:cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "its runner stacks" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "c").exists()
    assert len(tables[0]) > 20
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)
