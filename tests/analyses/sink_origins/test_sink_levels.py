"""Sink levels (analyses/src/sink_origins/levels.py): every key's mass against the materialised pattern; a secondary
sink planted in a tiny model (an MLP of layer 1 that writes a large value at one chosen position, a head of layer 2
whose keys read it) found at that position, at level 2, made by MLP 1; and nothing there without the plant."""

from __future__ import annotations

import pytest
import torch
from analyses_fixtures import build, tokens

from interp import HookedTransformer, ModelConfig
from interp.analyses.sink_origins.levels import GAP, find_sites, key_masses, masses_pass, min_queries, sink_levels
from interp.analyses.sink_origins.study import SinksSettings, SinksStudy
from interp.analyses.study import StudyData
from interp.errors import UserError

T, AT, N = 29, 6, 24  # the planted token, its position, the sequence length
D_T, D_S, D_C = 0, 1, 2  # residual dimensions: "the token is T", the sink's direction, a constant in every query


# ---- the masses against the pattern -----------------------------------------------------------------------------
def _alpha_by_hand(pattern: torch.Tensor, gap: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """From a materialised pattern [batch, head, q, k]: each key's mean weight over the queries >= gap past it."""
    n = pattern.shape[-1]
    rel = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    use = (rel >= gap) & (rel < (window or n + 1))
    count = use.sum(0)
    alpha = (pattern.double() * use).sum(2) / count.clamp(min=1)
    most = n - gap if window is None else min(n, window) - gap
    examined = (count >= max(1, min(max(gap, n // 4), most))) & (count > 0)
    return alpha * examined, examined


@pytest.mark.parametrize("name", ["rotary-gqa", "alibi-window"])
def test_every_keys_mass_equals_the_materialised_pattern(name):
    model = build(name)
    toks = tokens(3, 40, seed=3)
    alpha, examined = masses_pass(model, toks)
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    for l in range(model.cfg.n_layers):
        want, seen = _alpha_by_hand(cache["pattern", l], GAP, model.cfg.sliding_window)
        assert torch.equal(examined, seen)
        torch.testing.assert_close(alpha[l].double(), want, atol=1e-5, rtol=0)
    assert bool(examined.any()) and float(alpha.max()) > 0.15  # sharpened heads: far from uniform, not vacuous


def test_key_masses_examine_only_keys_with_enough_queries_past_them():
    model = build("learned")
    q = torch.randn(1, 5, 16, 8)
    _, examined = key_masses(q, q[:, :5], model.blocks[0].attn.scoring, gap=GAP)
    assert examined.tolist() == [k <= 16 - GAP - min_queries(16) for k in range(16)]


# ---- the planted secondary sink -----------------------------------------------------------------------------------
def planted(plant: bool = True, seed: int = 0) -> HookedTransformer:
    """4 layers: token T sets dimension D_T (nothing else writes it); neuron 0 of MLP 1 reads D_T and, planted,
    writes 10 into D_S (nothing else writes it); head 0 of layer 2 (and head 1 of layer 3) queries a constant
    dimension D_C against keys that read D_S, so every later query attends to where MLP 1 fired. Without the
    plant the MLP writes nothing there."""
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, d_vocab=31, n_ctx=32, d_mlp=16, act_fn="relu",
                      normalization="rmsnorm")
    model = HookedTransformer(cfg, seed=seed).eval()
    with torch.no_grad():
        model.embed.W_E[:, [D_T, D_S]] = 0
        model.pos_embed.W_pos[:, [D_T, D_S]] = 0
        model.embed.W_E[T, D_T] = 1.0
        model.embed.W_E[:, D_C] = 0.5
        for block in model.blocks:
            block.attn.W_O_flat[:, [D_T, D_S]] = 0
            block.attn.b_O[[D_T, D_S]] = 0
            block.mlp.W_out[:, [D_T, D_S]] = 0
            block.mlp.b_out[[D_T, D_S]] = 0
        mlp = model.blocks[1].mlp
        mlp.W_in[:, 0] = 0
        mlp.W_in[D_T, 0] = 1.0
        mlp.b_in[0] = 0
        mlp.W_out[0] = 0
        mlp.W_out[0, D_S] = 10.0 if plant else 0.0
        for layer, head in ((2, 0), (3, 1)):  # the sink forms at layer 2 and stays a sink at layer 3
            attn = model.blocks[layer].attn
            attn.b_qkv.zero_()
            attn.W_Q[head] = 0
            attn.W_Q[head, D_C, 0] = 10.0
            attn.W_K[head] = 0
            attn.W_K[head, D_S, 0] = 10.0
    return model


def planted_tokens(batch: int = 3) -> torch.Tensor:
    toks = tokens(batch, N, seed=4, vocab=12)  # ids < 12: T appears only where it is put
    toks[:, AT] = T
    return toks


def test_a_planted_secondary_sink_is_found_at_its_position_and_level_made_by_its_mlp():
    model, toks = planted(), planted_tokens()
    levels = sink_levels(model, toks, 0.3, set()).copy()
    site = levels["sink_levels"].set_index("site").loc[f"token:{T}"]
    assert site["median_position"] == AT and site["n_positions"] == toks.shape[0] and site["share"] == 1.0
    assert site["level"] == 2 and site["head"] == 0 and site["mass_at_level"] > 0.9
    assert site["component"] == "mlp 1" and site["removes"] and site["mass_without"] < 0.3
    ablations = levels["sink_level_ablations"]
    mine = ablations[ablations["site"] == f"token:{T}"].set_index("component")
    assert list(mine.index) == ["attn 0", "mlp 0", "attn 1", "mlp 1"]  # only the components before the level
    assert (mine.drop(index="mlp 1")["mass_without"] > 0.9).all()  # the others leave it a sink
    by_layer = levels["sink_level_layers"].set_index(["site", "layer"])["mass"]
    mass = by_layer[f"token:{T}"]
    assert mass[1] < 0.3 and mass[2] > 0.9 and mass[3] > 0.9  # it forms at layer 2 and stays


def test_without_the_plant_no_sink_is_found_there():
    model, toks = planted(plant=False), planted_tokens()
    alpha, examined = masses_pass(model, toks)
    sites = find_sites(alpha, examined, toks, 0.3)
    assert all(not bool(s.positions[:, AT].any()) for s in sites)
    assert float(alpha[..., AT].max()) < 0.3


def test_the_study_writes_the_levels_and_names_them_in_its_report(tmp_path):
    from interp.analyses.store import read_table
    from interp.analyses.study import run

    model, toks = planted(), planted_tokens(2)
    data = StudyData.given(toks, "random tokens with a planted sink")
    settings = SinksStudy().checked(model.cfg, SinksSettings(model="planted", data=data, delimiters=(5,),
                                                                 mlp_layers=(0,), progress=False))
    run(SinksStudy(), model, tmp_path / "o", settings, log=lambda *a: None)
    site = read_table(tmp_path / "o", "sink_levels").set_index("site").loc[f"token:{T}"]
    assert site["level"] == 2 and site["component"] == "mlp 1"
    assert len(read_table(tmp_path / "o", "sink_level_layers")) % model.cfg.n_layers == 0
    report = (tmp_path / "o" / "report.md").read_text()
    assert "Sink levels" in report and "mlp 1" in report


def test_bad_levels_setting_is_one_line():
    from interp.analyses.data import DataSpec

    data = StudyData.of(DataSpec(kind="text", n_seqs=2, seq_len=16))
    with pytest.raises(UserError) as e:
        SinksStudy().checked(planted().cfg, SinksSettings(model="m", data=data, levels=-1))
    assert "--levels" in str(e.value) and "\n" not in str(e.value)
