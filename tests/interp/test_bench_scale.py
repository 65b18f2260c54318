"""The scale section's machinery on a tiny Llama (a few MB): the shard-by-shard writer, a load + forward
cell, an `interp analyze` cell, the parameter counts of the extrapolation. The real 1.2B/8B folders are
never written here."""

import json

import pytest

from interp.benchmarks import scale

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=1024,
            rope_theta=500000.0, rope_scaling={**scale.ROPE_LLAMA3, "factor": 8.0})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale") / "tiny"
    scale.write(TINY, path, shard_bytes=40_000, timeout=300)
    return path


def test_writer_shards_index_and_config(tiny):
    assert not tiny.with_name("tiny.partial").exists()
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tiny.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == 2 * scale.model_params(TINY)
    assert json.loads((tiny / "config.json").read_text())["dtype"] == "bfloat16"


def test_load_and_forward_cell(tiny):
    for which in ("interp", "transformers"):
        cell = scale.load_cell(which, "bfloat16", tiny, threads=1, forward_tokens=16, timeout=300)
        assert cell["problem"] is None
        assert cell["load"]["params"] == scale.model_params(TINY)
        assert cell["forward"]["finite"] and cell["forward"]["peak_RssAnon"] > 0
        assert cell["load"]["VmHWM"] >= cell["load"]["RssAnon"]


def test_timeout_is_reported_not_raised(tiny):
    # the cell imports torch first: 5 s was too little for that on a loaded machine (the line never came)
    lines, problem = scale._run_cell("import time; print('{\"phase\": \"x\"}', flush=True); time.sleep(300)", [],
                                     threads=1, timeout=40)
    assert problem == "timeout (40 s)" and lines[0]["phase"] == "x"


def test_analyze_cell(tiny, tmp_path):
    cell = scale.analyze_cell(tiny, tmp_path / "out", threads=1, timeout=300)
    assert cell["rc"] == 0 and cell["problem"] is None, cell["stderr"]
    assert cell["seconds"] > 0 and cell["peak_RssAnon"] > 0


def test_choices(monkeypatch):
    monkeypatch.setenv("INTERP_SCALE_SIZES", "8B")
    assert scale._choice("INTERP_SCALE_SIZES", tuple(scale.SIZES)) == ("8b",)
    monkeypatch.setenv("INTERP_SCALE_SIZES", "70b")
    with pytest.raises(ValueError):
        scale._choice("INTERP_SCALE_SIZES", tuple(scale.SIZES))


def test_parameter_counts():
    assert round(scale.model_params(scale.SIZES["8b"].config) / 1e9, 2) == 8.03
    assert round(scale.model_params(scale.SIZES["1b"].config) / 1e9, 2) == 1.24
    assert round(scale.model_params(scale.SHAPE_70B) / 1e9, 1) == 70.6
