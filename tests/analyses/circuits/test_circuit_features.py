"""SAE features as nodes of the circuit graph (`interp.analyses.circuits.features`; Marks et al. 2024): the graph's
invariant (every receiver's input is the sum of its senders' values plus the biases) with SAEs on attention's z,
the attention output and the MLP output, on every configuration of ours; the clean run unchanged (the model with
every SAE spliced with its error term); exact patching of a feature edge and of a feature or error node against
the same intervention made by hand in a spliced run (`hook_sae_acts_post`, `hook_sae_error`); EAP against the
gradient taken by hand; EAP-IG with many steps reaching exact patching; features that never fire left out;
selection, pruning and faithfulness on the bigger graph; the zoo's SAE on attn-only-2l; the command and its
one-line refusals."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import interp
from interp.analyses.circuits import Graph, Runner, faithfulness_curve, prune_dangling, select
from interp.analyses.circuits.features import FeatureNodes, feature_nodes, fired
from interp.analyses.circuits.positions import each_position
from interp.analyses.circuits.tasks import induction_task
from interp.analyses.store import read_table
from interp.cli import main as cli
from interp.models.saes import SAE, SAEConfig

from circuit_tasks import add_to_head, by_hand_metric, cached, metric_of, metric_of_tensor, random_sae, random_task, spliced
from core_models import OWN_CONFIGS, build

NAMES = sorted(OWN_CONFIGS)
ZOO_SAE = "attn-only-2l/blocks.1.attn.hook_z"




def saes_for(cfg, sites: str = "z,mlp") -> list[SAE]:
    """An SAE on layer 0's attention (z or attn_out) and, where the model has MLPs, on the last layer's MLP."""
    out = []
    for i, site in enumerate(sites.split(",")):
        if site == "z":
            out.append(random_sae(cfg, "blocks.0.attn.hook_z", seed=i))
        elif site == "attn":
            out.append(random_sae(cfg, "blocks.0.hook_attn_out", seed=i))
        elif site == "mlp" and cfg.d_mlp is not None:
            out.append(random_sae(cfg, f"blocks.{cfg.n_layers - 1}.hook_mlp_out", seed=i))
    return out


def biases(model, saes, tokens) -> torch.Tensor:
    """What the stream holds besides the senders' values, by hand: each layer's b_O (and, with an SAE on z, b_dec
    carried through W_O; on the attention output, b_dec in place of b_O; on the MLP output, b_dec), each
    attention output's share under sandwich norms (its norm's scale from a run of `tokens`)."""
    cfg, at = model.cfg, {s.cfg.hook_name: s for s in saes}
    names = lambda n: n.endswith("ln1_post.hook_scale")  # noqa: E731
    _, cache = model.run_with_cache(tokens, names_filter=names)
    total = torch.zeros(cfg.d_model)
    for l, block in enumerate(model.blocks):
        attn = block.attn
        b_O = attn.b_O if getattr(attn, "b_O", None) is not None else torch.zeros(cfg.d_model)
        z, out = at.get(f"blocks.{l}.attn.hook_z"), at.get(f"blocks.{l}.hook_attn_out")
        bias = b_O + (z.b_dec @ attn.W_O_flat if z is not None else 0)
        if out is not None:
            bias = out.b_dec
        elif cfg.sandwich_norms:
            bias = block.ln1_post.w * bias / cache[f"blocks.{l}.ln1_post.hook_scale"]
        total = total + bias
        mlp = at.get(f"blocks.{l}.hook_mlp_out")
        if mlp is not None:
            total = total + mlp.b_dec
    return total




# ---- the graph --------------------------------------------------------------------------------------------------
def test_an_attention_saes_features_and_error_replace_its_layers_heads():
    model = interp.load("attn-only-2l")
    sae = interp.load_sae(ZOO_SAE)
    g = Graph(model.cfg, [feature_nodes(model.cfg, sae, [3, 40, 7])])
    assert g.senders == ["embed", "L0H0", "L0H1", "L0H2", "L0H3", "L1F3", "L1F7", "L1F40", "L1.sae_error"]
    assert g.sender_kind[5:] == ["feature"] * 3 + ["error"] and g.sender_feature[5:] == [3, 7, 40, -1]
    assert g.receivers == Graph(model.cfg).receivers  # receivers do not change
    assert g.n_edges == 12 * 1 + 12 * 5 + 9  # the four heads of layer 1 became four senders here too
    q = g.receivers.index("L1H2")
    assert g.receiver_senders[q] == [5, 6, 7, 8]  # each feature reads every head of its layer
    logits = len(g.receivers) - 1
    assert g.inputs_of[6] == [r for r in range(logits) if g.receiver_layer[r] == 1]
    assert g.writes_at[6] == "blocks.1.hook_attn_out"
    mlp = build(OWN_CONFIGS["learned-layernorm"])
    g = Graph(mlp.cfg, [random_sae(mlp.cfg, "blocks.0.hook_mlp_out", d_sae=3)])
    assert g.senders[6:11] == ["MLP0F0", "MLP0F1", "MLP0F2", "MLP0.sae_error", "L1H0"]
    assert g.receiver_senders[g.receivers.index("MLP0")] == [6, 7, 8, 9]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sites", ["z,mlp", "attn"])
def test_senders_add_up_to_the_stream_and_the_clean_run_is_the_spliced_one(name, sites):
    """The graph's invariant with SAEs in: the final stream is the senders' values plus the biases, to float32
    round-off; the clean metric is the model's, and the model's with every SAE spliced with its error term; patching
    every edge is the corrupted run, patching none the clean one."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    saes = saes_for(model.cfg, sites)
    runner = Runner(model, task, saes=saes)
    g = runner.graph
    assert any(k == "feature" for k in g.sender_kind) and g.sender_kind.count("error") == len(saes)
    values, _, final = runner._cache[0]["clean"]
    torch.testing.assert_close(values.sum(0) + biases(model, saes, task.clean), final, atol=2e-5, rtol=1e-5)
    plain = Runner(model, task)
    assert runner.clean_metric == pytest.approx(plain.clean_metric, abs=1e-5)
    assert runner.corrupted_metric == pytest.approx(plain.corrupted_metric, abs=1e-5)
    with torch.no_grad():
        spliced = model.run_with_saes(task.clean, saes=saes, use_error_term=True)
    assert runner.clean_metric == pytest.approx(metric_of(task, spliced), abs=1e-5)
    assert runner.patched(g.allowed.float()) == pytest.approx(runner.corrupted_metric, abs=1e-4)
    assert runner.patched(torch.zeros(g.allowed.shape)) == runner.clean_metric


def test_under_sandwich_norms_a_z_feature_is_its_share_of_the_normalised_output():
    """Gemma's sandwich norm divides the attention output by its RMS: a z feature's value is its share of the
    normalised output in its run, w * acts_f (W_dec[f] @ W_O) / scale, as a head's is, so patching it adds its
    corrupted share less its clean one where the layer writes."""
    model = build(OWN_CONFIGS["gemma3-like"])
    task = random_task(model)
    sae = random_sae(model.cfg, "blocks.0.attn.hook_z")
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    s = _firing(runner, sae)[0]
    f = g.sender_feature[s]
    row, norm = sae.W_dec[f] @ model.blocks[0].attn.W_O_flat, model.blocks[0].ln1_post

    def share(tokens):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == "blocks.0.ln1_post.hook_scale")
        acts = cached(model, sae, tokens, "hook_sae_acts_post")[..., f]
        return norm.w * (acts[..., None] * row) / cache["blocks.0.ln1_post.hook_scale"]

    change = share(task.corrupted) - share(task.clean)
    want = by_hand_metric(model, task, [("blocks.0.hook_attn_out", lambda x, hook: x + change)]) - runner.clean_metric
    assert abs(want) > 1e-4
    assert float(runner.patch_nodes([s])[s]) == pytest.approx(want, abs=2e-5)
    mask = torch.zeros(g.allowed.shape)
    mask[s] = 1
    assert runner.patched(mask) - runner.clean_metric == pytest.approx(want, abs=2e-5)


# ---- exact patching against the spliced run -----------------------------------------------------------------




def _firing(runner, sae) -> list[int]:
    """Feature senders of `sae` whose activation changes between the clean and corrupted prompts most."""
    g = runner.graph
    mine = [s for s, k in enumerate(g.sender_kind) if k == "feature"
            and g.saes[g.sender_sae[s]].sae is sae]
    change = runner._differences(0)[mine].flatten(1).abs().sum(1)
    return [mine[i] for i in change.argsort(descending=True)[:2].tolist()]


@pytest.mark.parametrize("name, hook", [("learned-layernorm", "blocks.0.attn.hook_z"),
                                        ("rotary-rms-swiglu-gqa", "blocks.0.attn.hook_z"),
                                        ("gemma3-like", "blocks.0.hook_attn_out"),
                                        ("learned-layernorm", "blocks.0.hook_mlp_out"),
                                        ("rotary-partial-parallel", "blocks.0.hook_attn_out")])
def test_patching_a_feature_or_the_error_node_is_replacing_it_in_the_spliced_run(name, hook):
    """Node patching of a feature (every edge out of it) is the spliced run with that feature's activation replaced
    by its corrupted one at `hook_sae_acts_post`, and of the error node the run with `hook_sae_error` replaced: the
    same number by the buffer of edges (`patched`) and by adding the change where the sender writes
    (`patch_nodes`). (Under sandwich norms an SAE on the attention output reads what enters the stream, after the
    norm: the spliced run is the graph's intervention there too.)"""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    sae = random_sae(model.cfg, hook)
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    error = g.sender_kind.index("error")
    acts = cached(model, sae, task.corrupted, "hook_sae_acts_post")
    err = cached(model, sae, task.corrupted, "hook_sae_error")
    nodes = runner.patch_nodes()
    for s in _firing(runner, sae) + [error]:
        f = g.sender_feature[s]

        def swap(x, hook, f=f):
            x = x.clone()
            if f < 0:
                return err
            x[..., f] = acts[..., f]
            return x

        point = f"{hook}.{'hook_sae_error' if f < 0 else 'hook_sae_acts_post'}"
        want = metric_of(task, spliced(model, sae, task.clean, [(point, swap)])) - runner.clean_metric
        mask = torch.zeros(g.allowed.shape)
        mask[s] = 1
        assert abs(want) > 1e-4, g.senders[s]  # something to compare
        assert runner.patched(mask) - runner.clean_metric == pytest.approx(want, abs=2e-5), g.senders[s]
        assert float(nodes[s]) == pytest.approx(want, abs=2e-5), g.senders[s]


@pytest.mark.parametrize("name", ["learned-layernorm", "rotary-rms-swiglu-gqa"])
def test_patching_a_feature_edge_into_one_head_is_the_intervention_written_out_by_hand(name):
    """Edge f -> L1H2's query: that query's input (only) moves by the feature's change of activation times its
    decoder row carried through W_O, everything else clean."""
    model = build(OWN_CONFIGS[name])
    task = random_task(model)
    sae = random_sae(model.cfg, "blocks.0.attn.hook_z", arch="topk")
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    s, r = _firing(runner, sae)[0], g.receivers.index("L1H2")
    f = g.sender_feature[s]
    change = (cached(model, sae, task.corrupted, "hook_sae_acts_post")[..., f]
              - cached(model, sae, task.clean, "hook_sae_acts_post")[..., f])
    row = sae.W_dec[f] / sae.W_dec[f].norm() @ model.blocks[0].attn.W_O_flat  # SAELens: acts / |W_dec row| decoded
    delta = change[..., None] * row
    want = by_hand_metric(model, task, [("blocks.1.hook_q_input", add_to_head(2, delta))], split_qkv=True)
    assert abs(want - runner.clean_metric) > 1e-4
    assert float(runner.patch_edges([(s, r)])[s, r]) == pytest.approx(want - runner.clean_metric, abs=2e-5)
    # EAP: the same change dotted with the metric's gradient at that query's input, taken by hand
    seen = {}

    def keep(x, hook):
        seen["x"] = x
        return x

    model.set_use_split_qkv_input(True)
    try:
        logits = model.run_with_hooks(task.clean, fwd_hooks=[("blocks.1.hook_q_input", keep)])
        grad = torch.autograd.grad(metric_of_tensor(task, logits), seen["x"])[0][:, :, 2].detach()
    finally:
        model.set_use_split_qkv_input(False)
    assert float(runner.eap()[s, r]) == pytest.approx(float((delta.detach() * grad).sum()), rel=1e-4, abs=1e-6)




def test_eap_ig_with_many_steps_reaches_exact_patching():
    """EAP-IG on every receiver's input is the integral of the gradient along the straight line from the corrupted to
    the clean inputs: the scores of the edges into the logits (features, the error, heads, embed) add up to the exact
    patch of them all, the midpoint rule's error falling as 1 / steps^2."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    runner = Runner(model, task, saes=saes_for(model.cfg, "z,mlp"))
    g = runner.graph
    into = torch.zeros(g.allowed.shape)
    into[:, -1] = 1
    exact = runner.patched(into) - runner.clean_metric
    errors = [abs(float(runner.eap_ig(k, "activations")[:, -1].sum()) - exact) for k in (1, 4, 32)]
    assert errors[2] < 1e-3 * abs(exact) and errors[2] < errors[1] < errors[0]


def test_a_patched_run_reads_an_saes_values_at_once_and_skips_those_it_does_not_read(monkeypatch):
    """An SAE's values are made at once and their differences taken at once (`passes.Values.blocks`); a patched run
    that patches no edge out of an SAE makes none of its values (`_Patching.needs`). Both give the numbers of the
    sender-by-sender run, stacked or from the buffer."""
    from interp.analyses.circuits import passes

    model = build(OWN_CONFIGS["learned-layernorm"])
    runner = Runner(model, random_task(model), saes=saes_for(model.cfg, "z,mlp"))
    g = runner.graph
    gen = torch.Generator().manual_seed(3)
    masks = [(torch.rand(g.allowed.shape, generator=gen) < p).float() for p in (0.9, 0.3, 0.9)]
    masks[2][:, [l == 0 for l in g.receiver_layer]] = 0  # layer 0 clean: its senders' differences are the runs'
    quiet = masks[0].clone()
    quiet[[k in ("feature", "error") for k in g.sender_kind]] = 0  # no edge out of an SAE's nodes
    masks.append(quiet)
    # a buffer's rows start as NaN here: every row a patched run reads must be written (the skipped values' as 0)
    monkeypatch.setattr(passes.Corrupted, "buffer", lambda self, n, shape, dtype, device: torch.full(
        (n, *shape), float("nan"), dtype=dtype, device=device))
    for stack in (0, 10_000):
        monkeypatch.setattr(passes._Patching, "STACK", stack)
        fast = [runner.patched(m) for m in masks]
        with monkeypatch.context() as m:
            m.setattr(passes._Patching, "needs", lambda self, s, e: True)
            m.setattr(passes.Values, "extend_block", lambda self, stacked: self.extend(stacked.unbind(0)))
            slow = [runner.patched(mask) for mask in masks]
        assert fast == pytest.approx(slow, abs=2e-6), stack


def test_features_that_never_fire_are_left_out_and_what_they_write_joins_the_error():
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    sae = random_sae(model.cfg, "blocks.0.attn.hook_z", d_sae=40)
    with torch.no_grad():
        sae.b_enc[::3] = -100.0  # a third never fire
    on = (cached(model, sae, task.clean, "hook_sae_acts_post") != 0).flatten(0, -2).any(0)
    on |= (cached(model, sae, task.corrupted, "hook_sae_acts_post") != 0).flatten(0, -2).any(0)
    assert 0 < int(on.sum()) < 40  # some fire, some never
    assert fired(model, task, [sae])[0].tolist() == on.tolist()
    kept, every = Runner(model, task, saes=[sae]), Runner(model, task, saes=[sae], all_features=True)
    assert kept.graph.saes[0].features == tuple(on.nonzero().flatten().tolist())
    assert len(every.graph.senders) == len(kept.graph.senders) + 40 - int(on.sum())
    e_kept, e_every = kept.graph.sender_kind.index("error"), every.graph.sender_kind.index("error")
    assert float(kept.patch_nodes([e_kept])[e_kept]) == pytest.approx(float(every.patch_nodes([e_every])[e_every]),
                                                                      abs=1e-5)
    values, _, final = kept._cache[0]["clean"]
    torch.testing.assert_close(values.sum(0) + biases(model, [sae], task.clean), final, atol=2e-5, rtol=1e-5)


# ---- circuits on the feature graph ------------------------------------------------------------------------------
def test_selection_pruning_and_the_curve_on_the_feature_graph():
    model = interp.load("attn-only-2l")
    task = induction_task(model, 8, 10)
    runner = Runner(model, task, saes=[interp.load_sae(ZOO_SAE)])
    g = runner.graph
    f = g.sender_kind.index("feature")
    logits, q = len(g.receivers) - 1, g.receivers.index("L1H0")
    c = torch.zeros(g.allowed.shape, dtype=torch.bool)
    c[f, logits] = True  # a feature nothing in the circuit feeds: dangling
    assert not prune_dangling(g, c).any()
    c[0, q] = True  # embed -> L1H0's query: the feature now reads something of the circuit
    assert prune_dangling(g, c).sum() == 2
    scores = runner.eap_ig(2)
    curve = faithfulness_curve(runner, scores, (0.0, 0.05, 1.0))
    assert curve.faithfulness.iloc[0] == pytest.approx(0.0, abs=1e-4)
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0, abs=1e-4)
    greedy = select(g, scores, 20, "greedy")
    assert 0 < int(greedy.sum()) <= 20 and bool(greedy[:, logits].any())


def test_the_zoo_saes_feature_into_the_logits_is_replaced_as_in_the_spliced_run():
    """attn-only-2l with its layer-1 hook_z SAE: an edge feature -> logits (the feature's only edge) patched is the
    spliced run with that feature's activation corrupted; the scores of the three methods agree in sign on the
    strongest feature edges."""
    model = interp.load("attn-only-2l")
    sae = interp.load_sae(ZOO_SAE)
    task = induction_task(model, 8, 10)
    runner = Runner(model, task, saes=[sae])
    g = runner.graph
    logits = len(g.receivers) - 1
    exact = runner.patch_edges([(s, logits) for s, k in enumerate(g.sender_kind) if k == "feature"])
    s = int(exact[:, logits].abs().argmax())
    f = g.sender_feature[s]
    acts = cached(model, sae, task.corrupted, "hook_sae_acts_post")

    def swap(x, hook):
        x = x.clone()
        x[..., f] = acts[..., f]
        return x

    want = metric_of(task, spliced(model, sae, task.clean, [(f"{ZOO_SAE.split('/')[1]}.hook_sae_acts_post", swap)]))
    assert float(exact[s, logits]) == pytest.approx(want - runner.clean_metric, abs=1e-4)
    assert abs(float(exact[s, logits])) > 0.05
    top = exact[:, logits].abs().argsort(descending=True)[:5]
    eap = runner.eap()[:, logits]
    assert (torch.sign(eap[top]) == torch.sign(exact[top, logits])).all()  # logit edges: EAP is exact up to ln_final


# ---- long prompts and position classes ---------------------------------------------------------------------------
def test_block_by_block_and_per_position_scores_with_features_are_the_whole_graphs():
    model = build(OWN_CONFIGS["rotary-rms-swiglu-gqa"])
    task = random_task(model, n=3, p=6)
    saes = saes_for(model.cfg)
    whole = Runner(model, task, batch_size=2, layered=False, saes=saes)
    layered = Runner(model, task, batch_size=2, layered=True, saes=saes)
    want = whole.eap_ig(2)
    torch.testing.assert_close(layered.eap_ig(2), want, rtol=1e-5, atol=2e-6 * float(want.abs().max()))
    pos = each_position(task)
    torch.testing.assert_close(whole.eap_ig(2, positions=pos).sum(-1), want, rtol=1e-5,
                               atol=2e-6 * float(want.abs().max()))
    g = whole.graph
    mask = (torch.rand(g.allowed.shape, generator=torch.Generator().manual_seed(0)) < 0.6).float()
    assert layered.patched(mask) == pytest.approx(whole.patched(mask), abs=2e-5)


# ---- the command ------------------------------------------------------------------------------------------------
def test_the_command_scores_the_feature_graph_and_names_the_features(tmp_path):
    out = tmp_path / "ind"
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--prompts", "8", "--method", "eap",
                "--sae", ZOO_SAE, "--oracle", "nodes", "--no-progress", "--out", str(out)]) == 0
    edges, nodes = read_table(out, "edges"), read_table(out, "nodes")
    features = nodes[nodes.kind == "feature"]
    assert len(features) > 100 and features.node.str.match(r"L1F\d+$").all()
    assert (features.feature == features.node.str[3:].astype(int)).all()
    assert "L1.sae_error" in set(nodes.node) and not nodes.node.str.match(r"L1H\d+$").any()
    assert set(edges[edges.sender.str.startswith("L1F")].receiver) == {"logits"}
    record = json.loads((out / "settings.json").read_text())
    (spliced,) = record["saes"]
    assert spliced["hook"] == "blocks.1.attn.hook_z" and spliced["d_sae"] == 512
    assert spliced["features"] == len(features) and record["n_edges"] == len(edges)
    curve = pd.read_csv(out / "faithfulness.csv")
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0)
    page = (out / "report.md").read_text()
    assert "blocks.1.attn.hook_z" in page and "L1F" in page and "never fire" in page


@pytest.mark.parametrize("argv, says", [
    (["--sae", f"{ZOO_SAE},{ZOO_SAE}"], "two SAEs at blocks.1.attn.hook_z"),
    (["--sae", "no/such/sae/folder"], "no zoo SAE of that name"),
])
def test_bad_saes_are_one_line_before_loading(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    assert cli(["circuit", "attn-only-2l", "--task", "induction", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("hook, d_in, says", [
    ("blocks.0.hook_resid_mid", 128, "have no MLP, so they have no hook_resid_mid"),  # a cut: test_circuit_resid_features
    ("blocks.1.attn.hook_z", 64, "reads d_in=64, but that activation has width 128"),
    ("blocks.0.attn.hook_q", 128, "takes SAEs on attn.hook_z, hook_attn_out or hook_mlp_out"),
    ("blocks.1.hook_mlp_out", 128, "blocks have no MLP"),
])
def test_an_sae_the_graph_has_no_place_for_is_one_line_before_loading(tmp_path, capsys, monkeypatch, hook, d_in, says):
    folder = tmp_path / "sae"
    SAE(SAEConfig(architecture="standard", d_in=d_in, d_sae=8, hook_name=hook)).save_model(folder)
    monkeypatch.setattr(interp, "load", lambda *a, **k: pytest.fail("loaded"))
    assert cli(["circuit", "attn-only-2l", "--task", "induction", "--sae", str(folder), "--out",
                str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_the_runner_refuses_saes_it_cannot_read_in_one_line():
    model = interp.load("attn-only-2l")
    task = induction_task(model, 4, 6)
    sae = interp.load_sae(ZOO_SAE)
    with pytest.raises(ValueError, match="two SAEs at blocks.1.attn.hook_z"):
        Runner(model, task, saes=[sae, sae])
    out = random_sae(model.cfg, "blocks.1.hook_attn_out")
    with pytest.raises(ValueError, match="would both replace layer 1's heads"):
        Runner(model, task, saes=[sae, out])
    with model.saes([sae]), pytest.raises(ValueError, match="has SAEs spliced in"):
        Runner(model, task, saes=[sae])
    nodes = feature_nodes(model.cfg, sae, [1, 2])
    assert isinstance(nodes, FeatureNodes) and Runner(model, task, saes=[nodes]).graph.saes == (nodes,)


def test_qk_attribution_on_a_feature_graphs_runner_is_the_head_level_split():
    """`Runner.qk_attribution` splits a head's score over the head graph's senders; on a runner whose graph has SAE
    features it runs the forward to the head's layer again (the cached values are the features') and gives the
    plain runner's terms."""
    model = build(OWN_CONFIGS["learned-layernorm"])
    task = random_task(model)
    plain = Runner(model, task).qk_attribution("L1H0", corrupted=False)
    feats = Runner(model, task, saes=saes_for(model.cfg, "z")).qk_attribution("L1H0", corrupted=False)
    assert feats.query_senders == plain.query_senders
    torch.testing.assert_close(feats.terms, plain.terms)
