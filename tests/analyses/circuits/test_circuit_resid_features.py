"""A residual-stream SAE as a cut of the circuit graph (`interp.analyses.circuits.cut`; Marks et al. 2024): the graph
(earlier senders feed the cut's features and error and nothing after the cut; the later receivers read the cut's
senders); its invariant (the final stream is the senders' values plus the biases after the cut) on every placement
(resid_pre, resid_mid, resid_post, the last block's) and configurations with sandwich norms and parallel blocks;
node patching of a feature and of the error against the spliced run (`hook_sae_acts_post`, `hook_sae_error`); edge
patching into a feature, into the error and out of a feature against the intervention written by hand with the
SAE's own encoder; EAP against the gradient taken by hand through the SAE's own encoder; EAP-IG reaching exact
patching; features that never fire joining the error; a cut beside SAEs on z and the MLP; the one-line refusals and
the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import interp
from interp.analyses.circuits import Graph, Runner
from interp.analyses.store import read_table
from interp.cli import main as cli

from circuit_tasks import (add_to_head, by_hand_metric, cached, head_delta, metric_of, metric_of_tensor, random_sae,
                           random_task, spliced)
from core_models import OWN_CONFIGS, build

ZOO_RESID = Path(interp.__file__).resolve().parents[1] / "models/src/zoo/saes/attn-only-2l/blocks.1.hook_resid_pre"

# (config, hook): every placement of the cut, with sandwich norms (gemma3-like) and parallel blocks
PLACES = [("learned-layernorm", "blocks.1.hook_resid_pre"), ("learned-layernorm", "blocks.0.hook_resid_mid"),
          ("learned-layernorm", "blocks.1.hook_resid_post"), ("gemma3-like", "blocks.1.hook_resid_mid"),
          ("gemma3-like", "blocks.2.hook_resid_pre"), ("rotary-partial-parallel", "blocks.0.hook_resid_post"),
          ("no-positions-attn-only", "blocks.1.hook_resid_pre"), ("rotary-rms-swiglu-gqa", "blocks.0.hook_resid_pre")]












def biases_after(model, hook: str, sae, tokens) -> torch.Tensor:
    """What the stream after the cut holds besides the senders' values, by hand: b_dec, and each later attention's
    b_O (its share of the normalised output under sandwich norms, the norm's scale from a run of `tokens`)."""
    cfg = model.cfg
    _, layer, point = hook.split(".")
    first = int(layer) + (point != "hook_resid_pre")
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("ln1_post.hook_scale"))
    total = sae.b_dec.detach().clone()
    for l in range(first, cfg.n_layers):
        attn, block = model.blocks[l].attn, model.blocks[l]
        bias = attn.b_O if getattr(attn, "b_O", None) is not None else torch.zeros(cfg.d_model)
        if cfg.sandwich_norms:
            bias = block.ln1_post.w * bias / cache[f"blocks.{l}.ln1_post.hook_scale"]
        total = total + bias
    return total


def cut_of(g: Graph) -> list[int]:
    return g.groups[(g.cut.layer, "cut")]


def _firing(runner) -> list[int]:
    """The cut's two feature senders whose value changes most between the clean and the corrupted prompts."""
    g = runner.graph
    mine = [s for s, k in enumerate(g.sender_kind) if k == "feature" and g.saes[g.sender_sae[s]] is g.cut]
    change = runner._differences(0)[mine].flatten(1).abs().sum(1)
    return [mine[i] for i in change.argsort(descending=True)[:2].tolist()]


def _stream(model, hook: str, tokens) -> torch.Tensor:
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == hook)
    return cache[hook]


# ---- the graph --------------------------------------------------------------------------------------------------
def test_the_cut_is_between_the_senders_before_it_and_the_receivers_after_it():
    model = build(OWN_CONFIGS["learned-layernorm"])
    sae = random_sae(model.cfg, "blocks.1.hook_resid_pre", d_sae=3)
    g = Graph(model.cfg, [sae])
    assert g.senders[5:12] == ["L0H4", "MLP0", "R1F0", "R1F1", "R1F2", "R1.sae_error", "L1H0"]
    assert g.sender_kind[7:11] == ["feature"] * 3 + ["error"] and g.sender_feature[7:11] == [0, 1, 2, -1]
    assert g.writes_at[7] == g.writes_at[10] == "blocks.1.hook_resid_pre"
    cut = cut_of(g)
    assert [g.receivers[r] for r in cut] == ["R1F0", "R1F1", "R1F2", "R1.sae_error"]
    assert [g.receiver_senders[r] for r in cut] == [[7], [8], [9], [10]]
    before, after = list(range(7)), [r for r in range(len(g.receivers)) if g.receiver_layer[r] == 1 and r not in cut]
    after.append(len(g.receivers) - 1)  # the logits
    assert g.allowed[before][:, cut].all() and not g.allowed[7:11][:, cut].any()  # every earlier sender feeds the cut
    assert not g.allowed[before][:, after].any() and g.allowed[7:11][:, after].all()  # nothing crosses it
    assert g.n_edges == Graph(model.cfg).n_edges - 7 * 17 + 7 * 4 + 4 * 17  # 17: layer 1's 16 inputs and the logits
    post = Graph(model.cfg, [random_sae(model.cfg, "blocks.1.hook_resid_post", d_sae=2)])
    assert post.senders[-3:] == ["R2F0", "R2F1", "R2.sae_error"] and post.receivers[-4:-1] == post.senders[-3:]
    assert post.allowed[:, -1].nonzero().flatten().tolist() == [len(post.senders) - 3 + i for i in range(3)]
    mid = Graph(model.cfg, [random_sae(model.cfg, "blocks.0.hook_resid_mid", d_sae=2)])
    assert mid.senders[5:9] == ["L0H4", "R0midF0", "R0midF1", "R0mid.sae_error"] and mid.senders[9] == "MLP0"
    mlp0 = mid.receivers.index("MLP0")
    assert mid.allowed[:, mlp0].nonzero().flatten().tolist() == [6, 7, 8]  # MLP0 reads the cut only


@pytest.mark.parametrize("name, hook", PLACES)
@pytest.mark.parametrize("arch", ["standard", "topk"])
def test_senders_add_up_to_the_stream_and_the_clean_run_is_the_spliced_one(name, hook, arch):
    """The final stream is the senders' values plus b_dec and the later biases, to float32 round-off; the clean metric
    is the model's and the spliced model's; patching every edge is the corrupted run, patching none the clean one."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    sae = random_sae(model.cfg, hook, arch=arch)
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    assert g.cut is not None and 0 < len(g.cut.features) and g.sender_kind.count("error") == 1
    values, _, final = runner._cache[0]["clean"]
    after = g.allowed[:, -1]  # what the logits read: the cut's senders and the later ones
    assert after.sum() == len(g.cut.features) + 1 + sum(1 for l in g.sender_layer if l > g.cut.layer) + (
        g.n_heads if hook.endswith("resid_pre") else 0) + (g.has_mlp and not hook.endswith("resid_post"))
    torch.testing.assert_close(values[after].sum(0) + biases_after(model, hook, sae, task.clean), final, atol=3e-5,
                               rtol=1e-5)
    plain = Runner(model, task)
    assert runner.clean_metric == pytest.approx(plain.clean_metric, abs=1e-6)
    assert runner.corrupted_metric == pytest.approx(plain.corrupted_metric, abs=1e-6)
    assert runner.clean_metric == pytest.approx(metric_of(task, spliced(model, sae, task.clean)), abs=1e-5)
    assert runner.patched(g.allowed.float()) == pytest.approx(runner.corrupted_metric, abs=1e-4)
    assert runner.patched(torch.zeros(g.allowed.shape)) == runner.clean_metric


# ---- exact patching ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, hook", PLACES[:6])
@pytest.mark.parametrize("arch", ["standard", "topk"])
def test_patching_a_feature_or_the_error_node_is_replacing_it_in_the_spliced_run(name, hook, arch):
    """Node patching of a cut's feature is the spliced run (`use_error_term`) with that feature's `hook_sae_acts_post`
    set to its corrupted value; of the error node, with `hook_sae_error` set to its corrupted value: by the edges'
    buffer (`patched`) and where the sender writes (`patch_nodes`)."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    sae = random_sae(model.cfg, hook, arch=arch)
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    error = g.sender_kind.index("error")
    acts = cached(model, sae, task.corrupted, "hook_sae_acts_post")
    err = cached(model, sae, task.corrupted, "hook_sae_error")
    nodes = runner.patch_nodes()
    for s in _firing(runner) + [error]:
        f = g.sender_feature[s]

        def swap(x, hook, f=f):
            if f < 0:
                return err
            x = x.clone()
            x[..., f] = acts[..., f]
            return x

        point = f"{hook}.{'hook_sae_error' if f < 0 else 'hook_sae_acts_post'}"
        want = metric_of(task, spliced(model, sae, task.clean, [(point, swap)])) - runner.clean_metric
        mask = torch.zeros(g.allowed.shape)
        mask[s] = 1
        assert abs(want) > 1e-4, g.senders[s]
        assert runner.patched(mask) - runner.clean_metric == pytest.approx(want, abs=2e-5), g.senders[s]
        assert float(nodes[s]) == pytest.approx(want, abs=2e-5), g.senders[s]


def _edge_into_the_cut(model, sae, hook: str, task, delta: torch.Tensor, f: int) -> float:
    """The metric with feature f's activation (f >= 0) or the error (f < 0) made from the stream at the cut moved by
    `delta` (the SAE's own encode on it), everything else as in the spliced clean run."""
    moved = _stream(model, hook, task.clean) + delta
    with torch.no_grad():
        new_acts, new_err = sae.encode(moved), moved - sae(moved)

    def swap(x, hook):
        if f < 0:
            return new_err
        x = x.clone()
        x[..., f] = new_acts[..., f]
        return x

    point = f"{hook}.{'hook_sae_error' if f < 0 else 'hook_sae_acts_post'}"
    return metric_of(task, spliced(model, sae, task.clean, [(point, swap)]))


@pytest.mark.parametrize("name, hook, arch", [("learned-layernorm", "blocks.1.hook_resid_pre", "standard"),
                                              ("learned-layernorm", "blocks.1.hook_resid_pre", "topk"),
                                              ("gemma3-like", "blocks.1.hook_resid_mid", "topk"),
                                              ("rotary-partial-parallel", "blocks.0.hook_resid_post", "standard")])
def test_patching_an_edge_into_a_feature_or_the_error_is_the_intervention_written_out_by_hand(name, hook, arch):
    """Edge L0H1 -> feature f: feature f's input (only) moves by the head's corrupted - clean output, then the SAE's
    own encoder and nonlinearity run on it (a top-k SAE chooses its k again); edge L0H1 -> error: the error becomes
    the moved stream less the SAE's reconstruction of it. EAP: that move dotted with the metric's gradient at the
    input, taken by hand through the SAE's own encode."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    sae = random_sae(model.cfg, hook, arch=arch)
    runner = Runner(model, task, saes=[sae], all_features=True)  # the error is SAELens's: x - sae(x)
    g = runner.graph
    s = g.senders.index("L0H1")
    delta = head_delta(model, task.clean, task.corrupted, 0, 1).detach()
    if model.cfg.sandwich_norms:  # a head's value is its share of the normalised output: w * result / scale
        shares = []
        for tokens in (task.clean, task.corrupted):
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in (
                "blocks.0.attn.hook_result", "blocks.0.ln1_post.hook_scale"))
            shares.append(model.blocks[0].ln1_post.w.detach() * cache["blocks.0.attn.hook_result"][:, :, 1]
                          / cache["blocks.0.ln1_post.hook_scale"])
        delta = shares[1] - shares[0]
    eap = runner.eap()
    error = g.sender_kind.index("error")
    for r in [g.receivers.index(g.senders[t]) for t in _firing(runner)] + [g.receivers.index(g.senders[error])]:
        f = g.sender_feature[g.receiver_senders[r][0]]
        want = _edge_into_the_cut(model, sae, hook, task, delta, f) - runner.clean_metric
        assert abs(want) > 1e-5, g.receivers[r]
        assert float(runner.patch_edges([(s, r)])[s, r]) == pytest.approx(want, abs=2e-5), g.receivers[r]
        grad = _gradient_at_the_cut(model, sae, hook, task, f)
        assert float(eap[s, r]) == pytest.approx(float((delta * grad).sum()), rel=1e-4, abs=1e-6), g.receivers[r]


def _gradient_at_the_cut(model, sae, hook: str, task, f: int) -> torch.Tensor:
    """d metric / d (feature f's input) (f < 0: the error's) at the clean run, [b, p, d]: the stream at the cut
    replaced by itself plus (feature f's value, or the error, as a function of a copy y of it) less its value, so
    that the gradient reaches y only through the SAE's own encode."""
    seen = {}

    def cut(x, hook):
        y = x.detach().clone().requires_grad_(True)
        seen["y"] = y
        if f < 0:
            part = y - sae(y)
        else:
            part = sae.encode(y)[..., f, None] * (sae.W_dec[f] / (sae.W_dec[f].norm() if sae.cfg.architecture == "topk"
                                                                   else 1))
        return x + part - part.detach()

    logits = model.run_with_hooks(task.clean, fwd_hooks=[(hook, cut)])
    return torch.autograd.grad(metric_of_tensor(task, logits), seen["y"])[0].detach()


def test_patching_an_edge_out_of_a_feature_into_one_head_is_the_intervention_written_out_by_hand():
    """Edge R1Ff -> L1H2's query: that query's input (only) moves by the feature's change of activation times its
    decoder row, everything else clean."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    sae = random_sae(model.cfg, "blocks.1.hook_resid_pre", arch="topk")
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    s, r = _firing(runner)[0], g.receivers.index("L1H2")
    f = g.sender_feature[s]
    change = (cached(model, sae, task.corrupted, "hook_sae_acts_post")[..., f]
              - cached(model, sae, task.clean, "hook_sae_acts_post")[..., f])
    delta = change[..., None] * (sae.W_dec[f] / sae.W_dec[f].norm())
    want = by_hand_metric(model, task, [("blocks.1.hook_q_input", add_to_head(2, delta))], split_qkv=True)
    assert abs(want - runner.clean_metric) > 1e-4
    assert float(runner.patch_edges([(s, r)])[s, r]) == pytest.approx(want - runner.clean_metric, abs=2e-5)


@pytest.mark.parametrize("arch", ["standard", "topk"])
def test_eap_ig_with_many_steps_reaches_exact_patching(arch):
    """EAP-IG on every receiver's input: with the cut at the last stream (the logits read only its senders), the
    scores of every edge into the cut's features and error add up to the exact patch of them all (the corrupted run),
    and those into the logits from an earlier cut's senders to their exact patch, the error falling as 1 / steps^2."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    for hook, into in (("blocks.1.hook_resid_post", "cut"), ("blocks.1.hook_resid_pre", "logits")):
        runner = Runner(model, task, saes=[random_sae(model.cfg, hook, arch=arch)])
        g = runner.graph
        cols = cut_of(g) if into == "cut" else [len(g.receivers) - 1]
        mask = torch.zeros(g.allowed.shape)
        mask[:, cols] = 1
        exact = runner.patched(mask) - runner.clean_metric
        if into == "cut":
            assert exact == pytest.approx(runner.corrupted_metric - runner.clean_metric, abs=1e-4)
        errors = [abs(float(runner.eap_ig(k, "activations")[:, cols].sum()) - exact) for k in (1, 4, 32)]
        assert errors[2] < 2e-3 * abs(exact) and errors[2] < errors[1] < errors[0], (hook, errors)


# ---- which features, and other SAEs beside the cut ---------------------------------------------------------------
def test_features_that_never_fire_are_left_out_and_what_they_write_joins_the_error():
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    hook = "blocks.1.hook_resid_pre"
    sae = random_sae(model.cfg, hook, d_sae=40)
    with torch.no_grad():
        sae.b_enc[::3] = -100.0  # a third never fire
    kept, every = Runner(model, task, saes=[sae]), Runner(model, task, saes=[sae], all_features=True)
    on = len(kept.graph.cut.features)
    assert 0 < on < 40 and len(every.graph.cut.features) == 40
    assert len(every.graph.senders) == len(kept.graph.senders) + 40 - on
    assert len(every.graph.receivers) == len(kept.graph.receivers) + 40 - on
    e_kept, e_every = kept.graph.sender_kind.index("error"), every.graph.sender_kind.index("error")
    assert float(kept.patch_nodes([e_kept])[e_kept]) == pytest.approx(float(every.patch_nodes([e_every])[e_every]),
                                                                      abs=1e-5)
    s = kept.graph.senders.index("L0H3")
    r_kept, r_every = kept.graph.receivers.index("R1.sae_error"), every.graph.receivers.index("R1.sae_error")
    assert float(kept.patch_edges([(s, r_kept)])[s, r_kept]) == pytest.approx(
        float(every.patch_edges([(s, r_every)])[s, r_every]), abs=1e-5)


def test_a_cut_composes_with_saes_on_z_and_the_mlp():
    """A cut at layer 1's stream beside an SAE on layer 0's z and one on layer 1's MLP: the clean run is the one with
    all three spliced; patching all is the corrupted run; a cut feature's node patch is the spliced run with its
    activation corrupted, every SAE spliced."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    saes = [random_sae(model.cfg, "blocks.0.attn.hook_z", seed=1), random_sae(model.cfg, "blocks.1.hook_resid_pre"),
            random_sae(model.cfg, "blocks.1.hook_mlp_out", seed=2)]
    runner = Runner(model, task, saes=saes)
    g = runner.graph
    assert {g.saes[i].component for i in set(g.sender_sae) - {-1}} == {"attn", "resid", "mlp"}
    z_features = [s for s, k in enumerate(g.sender_kind) if k == "feature" and g.sender_layer[s] == 0]
    assert g.allowed[z_features][:, cut_of(g)].all() and not g.allowed[z_features, -1].any()
    with torch.no_grad():
        spliced = model.run_with_saes(task.clean, saes=saes, use_error_term=True)
    assert runner.clean_metric == pytest.approx(metric_of(task, spliced), abs=1e-5)
    assert runner.patched(g.allowed.float()) == pytest.approx(runner.corrupted_metric, abs=1e-4)
    s = _firing(runner)[0]
    f = g.sender_feature[s]
    acts = cached(model, saes[1], task.corrupted, "hook_sae_acts_post")

    def swap(x, hook):
        x = x.clone()
        x[..., f] = acts[..., f]
        return x

    with torch.no_grad(), model.saes(saes, use_error_term=True):
        logits = model.run_with_hooks(task.clean, fwd_hooks=[("blocks.1.hook_resid_pre.hook_sae_acts_post", swap)])
    want = metric_of(task, logits) - runner.clean_metric
    assert abs(want) > 1e-4
    assert float(runner.patch_nodes([s])[s]) == pytest.approx(want, abs=2e-5)
    mask = torch.zeros(g.allowed.shape)
    mask[s] = 1
    assert runner.patched(mask) - runner.clean_metric == pytest.approx(want, abs=2e-5)


# ---- refusals and the command -----------------------------------------------------------------------------------
def test_the_runner_refuses_what_the_cut_does_not_take_in_one_line():
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    pre, post = random_sae(model.cfg, "blocks.1.hook_resid_pre"), random_sae(model.cfg, "blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match="would both cut the residual stream"):
        Runner(model, task, saes=[pre, post])
    with pytest.raises(ValueError, match="block-by-block attribution"):
        Runner(model, task, saes=[pre], layered=True)
    for name, says in (("rotary-partial-parallel", "in parallel"), ("no-positions-attn-only", "have no MLP")):
        other = build(OWN_CONFIGS[name])
        with pytest.raises(ValueError, match=says):
            Graph(other.cfg, [random_sae(other.cfg, "blocks.0.hook_resid_mid")])


def _resid_sae(tmp_path) -> str:
    """The zoo's attn-only-2l SAE at blocks.1.hook_resid_pre where there is one; else a random one saved to disk."""
    if (ZOO_RESID / "cfg.json").exists():
        return "attn-only-2l/blocks.1.hook_resid_pre"
    model = interp.load("attn-only-2l")
    folder = tmp_path / "resid_sae"
    random_sae(model.cfg, "blocks.1.hook_resid_pre", d_sae=64).save_model(folder)
    return str(folder)


def test_the_command_cuts_the_stream_and_names_the_features(tmp_path):
    sae, out = _resid_sae(tmp_path), tmp_path / "ind"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "8", "--method", "eap",
                "--sae", sae, "--oracle", "nodes", "--no-progress", "--out", str(out)]) == 0
    edges, nodes = read_table(out, "edges"), read_table(out, "nodes")
    features = nodes[nodes.kind == "feature"]
    assert len(features) > 0 and features.node.str.match(r"R1F\d+$").all()
    assert (features.feature == features.node.str[3:].astype(int)).all()
    assert (features.hook == "blocks.1.hook_resid_pre").all() and "R1.sae_error" in set(nodes.node)
    assert nodes.node.str.match(r"L[01]H\d$").sum() == 8  # the heads stay
    crossing = edges[edges.sender.str.match(r"(embed|L0H\d)$") & ~edges.receiver.str.startswith(("R1", "L0"))]
    assert crossing.empty  # nothing before the cut reaches past it
    assert set(edges[edges.receiver.str.startswith("R1")].sender) == {"embed"} | {f"L0H{h}" for h in range(4)}
    record = json.loads((out / "settings.json").read_text())
    (spliced,) = record["saes"]
    assert spliced["hook"] == "blocks.1.hook_resid_pre" and spliced["error_node"] == "R1.sae_error"
    assert record["n_edges"] == len(edges)
    assert (out / "report.md").exists() and (out / "faithfulness.csv").exists()


@pytest.mark.parametrize("hooks, extra, says", [
    (("blocks.1.hook_resid_pre", "blocks.0.hook_resid_post"), [], "would both cut the residual stream"),
    (("blocks.0.hook_resid_mid",), [], "have no MLP"),
    (("blocks.1.hook_resid_pre",), ["--task", "passkey", "--length", "256"], "long prompts"),  # 8,193 x 2 x 256 x 128
])
def test_bad_cuts_are_one_line_before_loading(tmp_path, capsys, monkeypatch, hooks, extra, says):
    names = []
    for i, hook in enumerate(hooks):
        folder = tmp_path / f"sae{i}"
        random_sae(interp.load("attn-only-2l").cfg, hook, d_sae=8192 if extra else 8).save_model(folder)
        names.append(str(folder))
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    argv = ["circuit", "attn-only-2l", *(extra or ["--task", "induction"]), "--sae", ",".join(names),
            "--out", str(tmp_path / "x")]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
