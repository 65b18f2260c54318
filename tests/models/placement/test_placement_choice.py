"""Where the weights go is one choice (`interp.models.placement.choice.Placement`: device, offload, device map),
made and refused in one place: each refusal is one line, and the same line whichever surface raised it
(`interp.load`, `load_checkpoint`, a study's or the sweep's settings, `check_up_front`, the command line)."""

from __future__ import annotations

import pytest

import interp
from interp.analyses.atlas.sweep import SweepSettings, check_up_front
from interp.analyses.study import StudySettings
from interp.cli import main as cli
from interp.errors import BadValue, UserError
from interp.models.formats.checkpoint import check_placement, load_checkpoint, read_config
from interp.models.placement.choice import Placement
from interp.models.placement.device_map import DeviceMapRefused
from interp.models.placement.offload import OffloadRefused
from interp.models.runs.names import resolve_run
from interp.testing import simulated_gpu

from core_models import OWN_CONFIGS, build

BOTH = ("device_map (--device-map) and offload='cpu' (--offload cpu) both say where the weights go: give one of "
        "the two")


def _said(call) -> str:
    """The one line a library call refuses with."""
    with pytest.raises(UserError) as e:
        call()
    text = str(e.value)
    assert len(text.splitlines()) == 1, text
    return text


def _cli_said(capsys, argv, out) -> str:
    """The one line a command refuses with (exit 2, nothing written)."""
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not out.exists()
    return err.removeprefix("error: ")


@pytest.fixture
def model_dir(tmp_path):
    build(OWN_CONFIGS["rotary-rms-swiglu-gqa"]).save(tmp_path / "m")
    return tmp_path / "m"


def test_a_map_beside_an_offload_is_one_line_the_same_everywhere(model_dir, tmp_path, capsys, monkeypatch):
    from interp.models.formats import build as build_module

    monkeypatch.setattr(build_module, "build_model", lambda *a, **k: pytest.fail("a weight was read"))
    out = tmp_path / "o"
    said = [
        _said(lambda: Placement(offload="cpu", device_map="auto")),
        _said(lambda: interp.load(model_dir, offload="cpu", device_map="auto")),
        _said(lambda: interp.load("no/such-model-anywhere", offload="cpu", device_map="auto")),  # before the name
        _said(lambda: StudySettings(offload="cpu", device_map="auto")),
        _said(lambda: SweepSettings(offload="cpu", device_map="auto")),
        _cli_said(capsys, ["analyze", str(model_dir), "--out", str(out), "--offload", "cpu", "--device-map", "auto",
                           "--no-progress"], out),
        _cli_said(capsys, ["sweep", "attn-only-2l", "--out", str(out), "--offload", "cpu", "--device-map", "auto",
                           "--no-progress"], out),
        _cli_said(capsys, ["lengths", str(model_dir), "--out", str(out), "--lengths", "8,16", "--offload", "cpu",
                           "--device-map", "auto"], out),
        _cli_said(capsys, ["info", str(model_dir), "--offload", "cpu", "--device-map", "auto"], out),
        _cli_said(capsys, ["generate", str(model_dir), "abc", "--offload", "cpu", "--device-map", "auto"], out),
    ]
    assert set(said) == {BOTH}, said
    with pytest.raises(DeviceMapRefused):
        Placement(offload="cpu", device_map={0: "cpu"})


def test_a_misspelt_offload_is_one_line_the_same_everywhere(model_dir):
    said = {_said(lambda: Placement(offload="ram")), _said(lambda: interp.load(model_dir, offload="ram")),
            _said(lambda: StudySettings(offload="ram")), _said(lambda: SweepSettings(offload="ram"))}
    assert len(said) == 1 and "offload='ram': give 'disk'" in said.pop()
    with pytest.raises(OffloadRefused):
        Placement(offload="ram")


def test_a_malformed_map_or_an_absent_device_is_one_line_the_same_everywhere(model_dir, tmp_path, capsys):
    out = tmp_path / "o"
    with simulated_gpu(devices=2):
        for option, value, says in (("device_map", "3-1:cuda:0", "runs backwards"),
                                    ("device_map", "everywhere", "give 'auto'"),
                                    ("device", "cuda:7", "is not available")):
            flag = "--" + option.replace("_", "-")
            said = {_said(lambda: Placement(**{option: value})), _said(lambda: interp.load(model_dir, **{option: value})),
                    _said(lambda: StudySettings(**{option: value})), _said(lambda: SweepSettings(**{option: value})),
                    _cli_said(capsys, ["analyze", str(model_dir), "--out", str(out), flag, value, "--no-progress"], out),
                    _cli_said(capsys, ["lengths", str(model_dir), "--out", str(out), "--lengths", "8", flag, value],
                              out)}
            assert len(said) == 1 and says in next(iter(said)), said
        with pytest.raises(BadValue):
            Placement(device="cuda:7")


def test_what_needs_the_config_is_checked_against_it(model_dir):
    cfg = read_config(model_dir)  # 2 layers
    with simulated_gpu(devices=2):
        split = Placement(device_map="0:cuda:0,1:cuda:1")
        assert split.device_map == {0: "cuda:0", 1: "cuda:1"} and split.may_split()
        assert split.resolved() is split  # the map says where: no device added
        assert {str(d) for d in split.units(cfg).values()} == {"cuda:0", "cuda:1"}
        assert Placement(device="cuda:1").resolved().device.index == 1 and Placement().units(cfg) is None
        for bad, says in ((Placement(device_map="0-3:cuda:0"), "layers 0-1"),
                          (Placement(device="cuda:1", device_map="0-1:cuda:0"), "disagree")):
            assert says in _said(lambda: check_placement(model_dir, bad))
            assert says in _said(lambda: load_checkpoint(model_dir, placement=bad))
        needs = "generation reads interp's KV cache, which holds every layer on one device"
        line = _said(lambda: split.refuse_split(cfg, needs))
        assert line == (f"{needs}, and device_map (--device-map) splits the model over 2 devices: run it on one device "
                        "(device=, --device)")
        Placement(device_map="0-1:cuda:1").refuse_split(cfg, needs)  # one device: nothing to refuse
        model = load_checkpoint(model_dir, placement=split)
        assert {str(d) for d in model.device_map.values()} == {"cuda:0", "cuda:1"}


def test_a_wrapped_model_is_refused_the_same_everywhere(tmp_path, capsys):
    pytest.importorskip("transformers")
    from arch_cases import builder

    builder("phi")().save_pretrained(tmp_path / "w")
    capsys.readouterr()  # transformers' progress bar
    runs = [resolve_run(str(tmp_path / "w"))]
    out = tmp_path / "o"
    for flags, placement, says in ((["--offload", "disk"], Placement(offload="disk"), "which interp does not offload"),
                                   (["--device-map", "auto"], Placement(device_map="auto"),
                                    "which interp does not split over devices")):
        said = {_said(lambda: interp.load(tmp_path / "w", **placement.keywords())),
                _said(lambda: load_checkpoint(tmp_path / "w", placement=placement)),
                _said(lambda: check_placement(tmp_path / "w", placement)),
                _said(lambda: check_up_front(SweepSettings(analyses=("induction",), **placement.keywords()), runs)),
                _cli_said(capsys, ["analyze", str(tmp_path / "w"), "--out", str(out), *flags, "--no-progress"], out),
                _cli_said(capsys, ["lengths", str(tmp_path / "w"), "--out", str(out), "--lengths", "8", *flags], out)}
        assert len(said) == 1, said
        line = said.pop()
        assert says in line and "transformers runs this architecture (phi, wrapped)" in line, line
