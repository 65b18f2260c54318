"""Which heads and edges carry a behaviour: the computation graph at head granularity, exact activation
patching (the oracle), edge attribution patching (EAP, Syed et al. 2023) and its integrated-gradients
form (EAP-IG, Hanna et al. 2024), circuits chosen by score and judged by faithfulness over their sizes
(MIB, Mueller et al. 2025).

The graph, with the conventions of the EAP literature (ACDC's, Hanna et al.'s):

- senders: the embeddings as one node `embed` (the residual stream entering block 0: token plus
  position), each head's output without the output bias `L{l}H{h}`, each MLP's output `MLP{l}`;
- receivers: each head's q, k and v inputs (the residual stream before that layer's norm, one copy
  per input: `set_use_split_qkv_input`), each MLP's input, and `logits` (the stream before the final
  norm);
- an edge: a sender that writes before a receiver reads. The receiver's input is the sum of its
  senders' values plus the biases, so patching edge s -> r gives r the input
  `input_r - value_s + value_s(corrupted)` and leaves every other reader of s alone.

Grouped-query attention: a key/value head's k and v inputs are one input read by all the query heads
of its group, so they are one receiver, named `L{l}KV{g}` (`L{l}H{g}` under multi-head attention,
where the two coincide); its edges are scored once, for the group.

Sandwich norms (Gemma 2 / 3, OLMo 2): a head's value is its share of the normalised attention output,
`w * result_h / rms(attention output)` with the norm's scale of the same run, so the layer's output is
still the sum of its heads' values (plus the bias's share). Patching a head changes only its own
share: the scale each receiver sees is the scale of the run it reads.

Scores are `metric(run with the edge corrupted) - metric(clean run)` (patching), or its first-order
estimate `(value_s(corrupted) - value_s(clean)) . d metric / d input_r` (EAP); EAP-IG averages the
gradient over m points between the corrupted and the clean run (midpoints: alpha = (k - 1/2) / m),
interpolating the embeddings ("inputs") or every receiver's input at once ("activations"). The metric
is a mean over prompts and answer positions (`Task`). A node's score is its sender's: every edge out of
it patched at once (exact), or the sum of its edges' scores (EAP, EAP-IG: the same first-order
estimate).

SAE features (`features`): an SAE on a component's output (attention's hook_z, hook_attn_out, hook_mlp_out) replaces
that component's senders by its features (`L{l}F{i}`, `MLP{l}F{i}`) and its error node; the graph's invariant (a
receiver's input is the sum of its senders' values plus the biases) still holds to round-off. QK attribution in a
residual SAE's features: `qk_features`.

The room: `graph` (the graph, the task, choosing circuits), `runner` (patching, EAP, EAP-IG,
faithfulness), `positions` (edges resolved by token position or named position class), `tasks` (induction,
IOI, greater-than, JSON lines), `features` (SAE features as nodes), `qk` and `qk_features` (why a head attends),
`study` (`interp circuit`) and `report` (its report), `choices` (the settings' choices, torch-free).
"""

from __future__ import annotations

from .._faces import lazy_face

_LAZY = {  # name -> its module here: imported on first use (PEP 562), so `choices` alone loads no torch
    **dict.fromkeys(("FRACTIONS", "Graph", "Task", "areas", "greedy_edges", "prune_dangling", "select", "top_edges"),
                    ".graph"),
    **dict.fromkeys(("IG_ON", "IG_POINTS", "METHODS", "SELECTIONS"), ".choices"),
    "graph_mode": ".passes",
    "Runner": ".runner",
    "faithfulness_curve": ".runner",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_face(__name__, _LAZY)
