"""The plots draw what the frames hold: heatmap cells equal the pivoted values, curves the columns."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from analyses_fixtures import build, tokens  # noqa: E402

from interp.analyses import (  # noqa: E402
    composition_scores,
    detect_heads,
    plot_composition,
    plot_curve,
    plot_head_scores,
    window_eval,
)


def test_head_heatmaps_one_panel_per_kind():
    model = build("learned")
    frame = detect_heads(model, tokens(2, 16))
    fig = plot_head_scores(frame)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["previous_token: score", "duplicate_token: score", "induction: score"]
    for ax, kind in zip(panels, ["previous_token", "duplicate_token", "induction"]):
        want = frame[frame.kind == kind].pivot(index="layer", columns="head", values="score").to_numpy()
        assert np.allclose(ax.get_images()[0].get_array(), want)


def test_signed_values_get_a_centred_colour_scale():
    frame = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "delta": [-0.5, 0.1, 0.2, 0.3]})
    fig = plot_head_scores(frame)
    image = fig.axes[0].get_images()[0]
    assert image.get_clim() == (-0.5, 0.5)
    with pytest.raises(ValueError, match="layer"):
        plot_head_scores(pd.DataFrame({"x": [1]}))


def test_curves_and_composition():
    model = build("rotary-gqa")
    frame = window_eval(model, tokens(2, 20), window=[4, 8], n_sink=2)
    fig = plot_curve(frame, y=["loss", "perplexity"])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"full", "window", "window+sink"}
    assert np.allclose(lines["window"].get_xdata(), [4, 8])
    assert np.allclose(lines["window+sink"].get_ydata(), frame[frame.setting == "window+sink"]["loss"])
    assert np.allclose(lines["full"].get_ydata(), frame.loc[0, "loss"])  # a horizontal line
    comp = composition_scores(model, kinds="v")
    grid = plot_composition(comp, "v").axes[0].get_images()[0].get_array()
    assert grid.shape == (6, 6) and np.allclose(grid, comp["score"].to_numpy().reshape(6, 6))
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # figures are built without pyplot: nothing accumulates globally


def test_annotations_are_readable_on_their_cells():
    frame = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "score": [0.0, 1.0]})
    texts = plot_head_scores(frame, annotate=True).axes[0].texts
    colour = {t.get_text(): t.get_color() for t in texts}
    assert colour == {"0.00": "white", "1.00": "black"}  # white on viridis's dark purple, black on its yellow
    fig = plot_head_scores(pd.DataFrame({"layer": range(30), "head": 0, "score": 0.5}))
    assert fig.axes[1].get_ylabel() == "score"  # the colour bar says what it measures
    assert len(fig.axes[0].get_yticks()) <= 16
