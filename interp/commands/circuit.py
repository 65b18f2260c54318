"""`interp circuit MODEL --task ioi --method eap-ig --out DIR`: which heads and edges carry a task
(`interp.analyses.circuits.study.CircuitStudy`)."""

from __future__ import annotations

from pathlib import Path

from interp.analyses.circuits.choices import IG_ON, IG_POINTS, METHODS, SELECTIONS  # torch-free: --help stays fast

from . import checks

HELP = "circuits: which heads and head-to-head edges carry a task (exact patching, EAP, EAP-IG) and how faithful they are"
EPILOG = """examples:
  interp circuit smollm2-135m --task ioi --out out/ioi                       # EAP-IG, 5 steps, 64 prompts
  interp circuit smollm2-135m --task ioi --oracle nodes --out out/ioi        # and exact node patching beside it
  interp circuit attn-only-2l --task induction --method patching --out out/ind
  interp circuit gemma3-270m --task greater-than --method eap --out out/gt
  interp circuit MODEL --task pairs.jsonl --out out/mine   # {"clean": ..., "corrupted": ..., "answer": " Paris", "wrong": " Rome"}
  interp circuit MODEL --task ids.jsonl --metric kl --method eap-ig --out out/kl
      # {"clean_ids": [..], "corrupted_ids": [..], "answers": [{"position": -1, "answer_ids": 42}, {"position": 5}]}
  interp circuit attn-only-2l --task induction --qk 1.0 --out out/ind      # and why L1H0 attends where it does
  interp circuit smollm2-135m --task ioi --positions classes --out out/ioi  # edges per S1, S2, IO, END, other
  interp circuit smollm2-135m --task passkey --length 4096 --out out/pk     # a 4k-token circuit, block by block
  interp circuit attn-only-2l --task induction --sae attn-only-2l/blocks.1.attn.hook_z --out out/f   # SAE features

The graph: senders (embed, each head's output, each MLP's), receivers (each head's q, k and v inputs,
each MLP's input, the logits), an edge where a sender writes before a receiver reads. Scores are
metric(edge patched from the corrupted run) - metric(clean); EAP and EAP-IG estimate them from
gradients. Circuits at MIB's sizes (0.1% .. 100% of the edges; past ~500 tokens, block by block: 1%, 5%, 20%)
are judged by faithfulness, (metric of the circuit - corrupted) / (clean - corrupted). Writes DIR/edges.parquet, nodes.parquet,
faithfulness.csv, settings.json and a report that draws the circuit, its faithfulness curve and its
heads' patterns on the task. A task file's lines may give token ids ("clean_ids", "corrupted_ids",
"answer_ids", "wrong_ids") and answers at several positions ("answers": [{"position": -2, ...}, ...]);
the metric is a mean over every answer position (docs/circuits.md has the format).
--sae PATH[,PATH]: SAE features (and each SAE's error) as nodes in place of the heads or MLP they read
(L1F3: feature 3 of layer 1's attention SAE; MLP2F7; L1.sae_error); nodes.parquet gains feature and hook.
--qk L.H[,L.H]: also each head's score from the answer position split into
(query-side sender, key-side sender) terms (DIR/qk.parquet, a report section per head); with a residual SAE
in --sae (blocks.L.hook_resid_pre) the terms are of its features (F12, b_dec, error) for layer L's heads.
"""


def add_arguments(p) -> None:
    p.add_argument("model", help="a checkpoint folder, .gguf file, real-model name or zoo name")
    g = p.add_argument_group("the task")
    g.add_argument("--task", required=True, help="ioi, induction, greater-than, passkey, or a JSON-lines file of clean / "
                                                 "corrupted prompts (text or token ids) and answers (at one position "
                                                 "or several)")
    g.add_argument("--prompts", type=int, default=None, help="prompts (default 64; a file: all of its pairs)")
    g.add_argument("--metric", default=None,
                   help="logit-diff, logit (the answer's), prob, loss, prob-diff or kl (from the clean run's "
                        "distribution; not with --method eap), averaged over every answer position (default: the "
                        "task's own; a file's: logit-diff with wrong answers, loss with answers, else kl)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    g.add_argument("--length", type=int, default=None,
                   help="passkey: the prompts' length in tokens (default 1024; 2 prompts unless --prompts): the KV "
                        "study's passkey prompts, the clean key against another")
    m = p.add_argument_group("the scores and the circuit")
    m.add_argument("--method", default="eap-ig", choices=METHODS, help="default eap-ig")
    m.add_argument("--steps", type=int, default=5, help="EAP-IG's interpolation steps (default 5)")
    m.add_argument("--ig", default="inputs", choices=IG_ON, help="EAP-IG interpolates the embeddings (inputs, "
                                                                "default) or every receiver's input (activations)")
    m.add_argument("--ig-points", default="midpoint", choices=IG_POINTS,
                   help="EAP-IG's points between the corrupted and clean run: midpoint, (k + 1/2) / steps (default), "
                        "or left, k / steps (hannamw/EAP-IG's own, to reproduce its scores)")
    m.add_argument("--select", default="top", choices=SELECTIONS,
                   help="top: the n edges of largest |score|; greedy: grown from the logits (default top)")
    m.add_argument("--size", type=float, default=None,
                   help="the circuit the report draws, as a fraction of the edges (default: the smallest of the curve's "
                        "sizes with faithfulness >= 0.8, else 0.05)")
    m.add_argument("--oracle", default="none", choices=("none", "nodes", "edges"),
                   help="also patch every node (or edge) exactly and report the agreement (default none)")
    m.add_argument("--positions", default="none", metavar="none|classes|each|S2,END",
                   help="also resolve every edge by where it acts: each (a class per token position), classes (the "
                        "task's named positions: ioi's S1, S2, IO, END, other) or some of them by name (the rest "
                        "join other); scored by --method, with a faithfulness curve beside the plain one "
                        "(position_edges.parquet, position_faithfulness.csv). Default none")
    m.add_argument("--batch-size", type=int, default=16, help="prompts per forward (default 16)")
    f = p.add_argument_group("SAE features as nodes")
    f.add_argument("--sae", default=None, metavar="PATH[,PATH]",
                   help="SAEs (folders, zoo or Hub names: interp.load_sae's) on attn.hook_z, hook_attn_out or "
                        "hook_mlp_out: their features and errors replace those components' senders in the graph "
                        "(Marks et al.'s feature circuits); features that fire on none of the prompts are left out. "
                        "A residual SAE (blocks.L.hook_resid_pre) serves --qk: layer L's heads split in its features")
    q = p.add_argument_group("why a head attends where it does")
    q.add_argument("--qk", default=None, metavar="L.H[,L.H]",
                   help="heads (1.0 or L1H0, comma-separated) whose scores from the answer position are split into "
                        "(query-side sender, key-side sender) terms: qk.parquet and a report section each")
    q.add_argument("--qk-keys", type=int, default=3, help="the keys each query's scores are split at: the ones the "
                                                          "head attends to most (default 3; at most the keys a query "
                                                          "sees, each once)")
    checks.add_output_options(p)


def run(args) -> int:
    from interp.analyses.circuits.study import CircuitSettings, CircuitStudy  # start-up time: torch

    def settings():
        _refuse_eap_with_kl(args)
        return CircuitSettings(**checks.common(args), task=args.task, method=args.method, steps=args.steps,
                               ig=args.ig, ig_points=args.ig_points, metric=args.metric, prompts=args.prompts, seed=args.seed,
                               batch_size=args.batch_size, select=args.select, size=args.size, oracle=args.oracle,
                               qk=args.qk, qk_keys=args.qk_keys, positions=args.positions, length=args.length,
                               rope_scaling=args.rope_scaling, sae=args.sae)

    return checks.run_command(CircuitStudy(), args, settings)


def _refuse_eap_with_kl(args) -> None:
    """EAP with the kl metric (asked for, or a task file's default) is one line before the model loads."""
    if args.method != "eap" or args.metric not in (None, "kl"):
        return
    from interp.analyses.circuits.runner import EAP_KL
    from interp.analyses.circuits.tasks import TASKS, default_metric, read_task_file

    if args.metric == "kl" or (args.task not in TASKS and Path(args.task).is_file()
                               and default_metric(read_task_file(args.task)) == "kl"):
        raise ValueError(EAP_KL)
