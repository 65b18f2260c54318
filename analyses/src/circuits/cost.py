"""What `interp circuit` will cost, from the config and the task's shape, before any run: the peak memory of
each stage it runs (`stage_bytes`) and its time (`stage_seconds`), said in one line (`CircuitCost.line`).

Memory. Beyond the weights and torch (`interp.models.placement.memory.FIXED_BYTES`), a `Runner` holds the runs of the
chunks it keeps (`runner.chunking`, `runner.run_bytes`), and each stage adds its own working set on top, in rows
of one chunk's stream (b x p x d_model values) and one forward's activations (`per_token_bytes`, a ceiling):

    runs         one forward                                             (the chunk's runs being made)
    eap, eap-ig  block by block: the point's stream (L + 1 rows, EAP-IG), one block's autograd (two forwards'
                 activations, each with the graph's own copy of the stream per head and its norm) and its
                 receivers' inputs and gradients (3 rows each); the whole graph: every block's autograd (L + 1),
                 every receiver's gradient (3 R rows) and the senders' differences (S rows); on "activations", each
                 run's every receiver input (2 R rows, held)
    patched runs the faithfulness curve and exact patching: lean, two blocks' forwards (the patched block and
                 the corrupted values formed again) and their senders' values; the whole cache, a buffer of every
                 sender's difference (S rows) and a forward
    roles        the atlas's induction scores (8 sequences of 101 tokens): their logits over the vocabulary;
                 the runs are released before it (`study.CircuitStudy.measure`), here and in patterns
    patterns     the report's view of the circuit's heads: a fused forward of a chunk of 16 prompts
                 (`study._movers`) and the rows of one layer's pattern it reads (`attention_rows`: the answer
                 positions, or the first prompt's shown positions, from its layers' q and k kept from one
                 forward), never a whole p x p pattern

and to each, the two largest working sets before it: glibc keeps what a stage frees (blocks under 32 MB) and
reuses it only in part, so the resident memory does not fall back between stages (measured against the
command's peak resident memory: `tests/analyses/circuits/test_circuit_memory.py`).

Every stage's memory is independent of EAP-IG's steps: its points are made one at a time.

Time. A pass is one forward over one prompt, `flops_per_token` at its mean causal context (q k^T and the
pattern @ v), at this machine's speed: a matrix product of the model's own shape timed once (`machine_flops`),
times `EFFICIENCY` (what a forward of hooks, norms, softmax and small products reaches of it). EAP-IG's step is 4
passes block by block (the point's stream, each block again with autograd, its backward: 2), EAP's 3; a patched
run of a lean cache 2 (the block and its corrupted values formed again), else 1; the clean and corrupted runs
2, again in each later stage for a chunk not held. An estimate, to see `--steps 100000000` for what it is before
it starts, not a promise: a loaded machine takes longer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from interp.models.placement.memory import GiB, per_token_bytes

from .graph import Graph, curve_fractions
from .layered import SENDER_CHUNK
from .runner import chunking, goes_by_layer, run_bytes

MOVERS_BATCH = 16  # prompts per forward of the report's heads that write the answer (`study._movers`)
PATTERN_MAX = 512  # the report's pattern view shows every position up to this length, then a few (`study._patterns`)
# what a forward reaches of that product's speed: SmolLM2's passes at 1,024 and 2,048 tokens reached 1.2 and 1.4
# times it on this project's 2-core CPU (idle); 1 leaves room for a loaded machine
EFFICIENCY = 1.0


@dataclass(frozen=True)
class CircuitCost:
    """Bytes of each stage's peak beyond the weights and `FIXED_BYTES`, seconds of each stage, and how the
    runner holds its runs (`prompts per chunk`, `held` chunks of `chunks`)."""

    stages: dict[str, int]
    seconds: dict[str, float]
    per_chunk: int
    held: int
    chunks: int
    layered: bool
    pass_seconds: float  # one forward over one prompt
    notes: dict[str, str] = field(default_factory=dict)  # stage -> what its time counts

    @property
    def peak(self) -> int:
        return max(self.stages.values())

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get)

    def line(self, fixed: int = 0) -> str:
        """One line: the peak memory (with `fixed`: the weights and torch) and its stage, the time in all and by
        stage."""
        held = ("every prompt's runs held" if self.held >= self.chunks else
                f"{self.held * self.per_chunk} of {self.chunks * self.per_chunk} prompts' runs held at a time")
        total = sum(self.seconds.values())
        parts = ", ".join(f"{k} {duration(v)}" + (f" ({self.notes[k]})" if k in self.notes else "")
                          for k, v in self.seconds.items() if v > 0)
        return (f"estimate: at most about {(fixed + self.peak) / GiB:.1f} GiB (its peak in {self.peak_stage}; "
                f"{'block by block' if self.layered else 'the whole graph'}, {held}); about {duration(total)}: "
                f"{parts}")


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    if seconds < 2 * 365 * 86400:
        return f"{seconds / 86400:,.0f} days"
    return f"{seconds / (365 * 86400):,.0f} years"


def _block_receivers(graph: Graph) -> int:
    """The most receivers one block holds (each head's q, k, v inputs, its MLP's)."""
    return max(sum(len(rs) for (l, _), rs in graph.groups.items() if l == layer) for layer in range(graph.n_layers + 1))


def stage_bytes(cfg, n_prompts: int, positions: int, batch_size: int = 16, *, method: str = "eap-ig",
                ig: str = "inputs", element_size: int = 4, layered: bool | None = None, hold: int | None = None,
                patterns: bool = True, graph: Graph | None = None) -> dict[str, int]:
    """Peak bytes beyond the weights and `FIXED_BYTES` of each stage `interp circuit` runs with these settings, in
    its order: "runs" (the clean and corrupted runs), `method`'s ("eap", "eap-ig"; "patching" has none of its
    own), "patched runs" (the faithfulness curve, exact patching), and with `patterns` the report's "roles" (the
    atlas's induction scores: 8 sequences of 101 tokens, their logits over the vocabulary) and "patterns". Each is
    the runs held, the stage's own working set, and the two largest working sets of the stages before it: the
    allocator keeps what those freed for reuse (glibc keeps freed blocks under 32 MB), and reuses it only in
    part, so the resident memory does not fall back between stages (measured: a stage's peak sits on what the
    ones before it left). `graph`: the graph the runs make (default the model's head graph; with SAEs' features,
    each feature's value is a sender's: the runs grow with them, and a pass that makes an SAE's values holds them
    all at once, [F + 1] rows)."""
    graph = Graph(cfg) if graph is None else graph
    batch = min(batch_size, n_prompts)
    if layered is None:
        layered = goes_by_layer(graph, cfg.d_model, batch, positions)
    per_chunk, held = chunking(cfg, graph, n_prompts, positions, batch_size, layered, element_size)
    if hold is not None:
        held = hold
    b = min(per_chunk, n_prompts)
    row = b * positions * cfg.d_model * 4  # one chunk's stream, float32 (gradients, sums)
    runs = held * b * run_bytes(cfg, graph, positions, element_size, lean=layered)
    forward = b * positions * per_token_bytes(cfg)  # one forward's activations, one block at a time
    # one block's activations that autograd saves: a forward's, and in the graph's mode each head's and the MLP's
    # own copy of the stream and of its norm (`graph_mode`)
    autograd = forward + 2 * (cfg.n_heads + 2 * cfg.kv_heads + 1) * row
    S, R, L = len(graph.senders), len(graph.receivers), graph.n_layers
    block = _block_receivers(graph)
    sae_rows = max((len(n.features) + 1 for n in graph.saes), default=0)  # one SAE's values, made at once
    if ig == "activations" and method == "eap-ig":  # every receiver's input in both runs, held with each chunk
        runs += held * 2 * R * row
    work = {"runs": forward + sae_rows * row}  # each stage's own, beyond the runs held
    if method in ("eap", "eap-ig"):
        if layered:
            work[method] = (2 * autograd + 3 * block * row + min(SENDER_CHUNK, S) * row * (element_size != 4)
                            + (L + 1) * row * (method == "eap-ig"))  # the point's stream, block by block
        else:
            work[method] = (L + 1) * autograd + 3 * R * row + S * row
    if layered:
        work["patched runs"] = 2 * forward + (2 * max(1, (S - 1) // max(1, L)) + block + 2 + 2 * sae_rows) * row
    else:
        work["patched runs"] = forward + (S + block + 2 + sae_rows) * row
    if patterns:
        tokens = 8 * 101  # `study._roles`: induction scores on 8 sequences of 2 x 50 random tokens and a BOS
        work["roles"] = 3 * tokens * cfg.d_vocab * 4 + tokens * per_token_bytes(cfg)  # logits, log-softmax
        heads_batch = min(MOVERS_BATCH, n_prompts)
        # a fused forward of a chunk of prompts, and the rows of one layer's pattern the view reads (scores,
        # weights and their exponent, float32): the answer rows of the chunk, or the first prompt's shown
        # positions (every one up to PATTERN_MAX, then fewer: a few keys per head)
        rows = max(heads_batch * heads_batch, min(positions, PATTERN_MAX))
        qk = cfg.n_layers * positions * (cfg.n_heads + cfg.kv_heads) * cfg.d_head * 4  # the first prompt's q and k
        work["patterns"] = (heads_batch * positions * per_token_bytes(cfg) + 3 * cfg.n_heads * rows * positions * 4
                            + qk)
    out, earlier = {}, []
    for stage, own in work.items():
        # the runs are released before the report's stages (`study.CircuitStudy.measure`)
        out[stage] = (runs if stage not in ("roles", "patterns") else 0) + own + sum(sorted(earlier)[-2:])
        earlier.append(own)
    return out


def machine_flops(cfg, device="cpu") -> float:
    """Multiply-adds x 2 per second of a matrix product of the model's own shape on `device` ([1,024 x d_model] @
    [d_model x d_mlp]), timed once after a warm-up: what this machine gives a forward's largest products."""
    device = torch.device(device)
    a = torch.randn(1024, cfg.d_model, device=device)
    w = torch.randn(cfg.d_model, cfg.d_mlp or 4 * cfg.d_model, device=device)
    best = float("inf")
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ w
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] * w.shape[0] * w.shape[1] / max(best, 1e-9)


def pass_flops(cfg, positions: int) -> float:
    """FLOPs of one forward over one prompt of `positions` tokens (no unembedding: only the answers are read)."""
    per = cfg.flops_per_token(max(1, (positions + 1) // 2))
    return positions * (per["attention"] + per["mlp"])


def stage_seconds(cfg, n_prompts: int, positions: int, batch_size: int = 16, *, method: str = "eap-ig",
                  steps: int = 5, oracle: str = "none", flops: float, layered: bool | None = None,
                  element_size: int = 4, graph: Graph | None = None) -> tuple[dict[str, float], dict[str, str], float]:
    """Seconds of each stage at `flops` per second (`machine_flops`), its notes, and one pass's seconds (`graph`:
    as `stage_bytes`)."""
    graph = Graph(cfg) if graph is None else graph
    if layered is None:
        layered = goes_by_layer(graph, cfg.d_model, min(batch_size, n_prompts), positions)
    per_chunk, held = chunking(cfg, graph, n_prompts, positions, batch_size, layered, element_size)
    chunks = -(-n_prompts // per_chunk)
    one = pass_flops(cfg, positions) / (flops * EFFICIENCY)  # one forward over one prompt
    contraction = 2 * graph.n_edges * positions * cfg.d_model / (flops * EFFICIENCY)  # a point's products, a prompt
    again = 2 * one * per_chunk * max(0, chunks - held)  # a stage's runs of the chunks not held
    seconds, notes = {"runs": 2 * one * n_prompts}, {}
    patched_pass = 2 * one if layered else one
    if method in ("eap", "eap-ig"):
        k = 1 if method == "eap" else steps
        step = (4 if method == "eap-ig" and layered else 3) * one + contraction
        seconds[method] = k * n_prompts * step + again
        notes[method] = f"{k:,} step{'s' if k != 1 else ''} x {n_prompts} prompts x {duration(step)}"
    if method == "patching" or oracle == "edges":
        seconds["exact edges"] = graph.n_edges * n_prompts * one / 2 + again
    if method == "patching" or oracle == "nodes":
        seconds["exact nodes"] = len(graph.senders) * n_prompts * one / 2 + again
    # the whole model's costs none, the drawn circuit is one of them, block by block no edge costs none either
    runs = sum(1 for f in curve_fractions(layered) if f < 1 and (f > 0 or not layered))
    seconds["faithfulness"] = runs * n_prompts * patched_pass + again
    notes["faithfulness"] = f"{runs} patched runs x {n_prompts} prompts x {duration(patched_pass)}"
    return seconds, notes, one


def estimate(cfg, n_prompts: int, positions: int, batch_size: int = 16, *, method: str = "eap-ig",
             steps: int = 5, ig: str = "inputs", oracle: str = "none", element_size: int = 4, flops: float,
             graph: Graph | None = None) -> CircuitCost:
    """The `CircuitCost` of `interp circuit` with these settings on a model of config `cfg` (`graph`: the graph the
    runs make, default its head graph), the report's stages included."""
    graph = Graph(cfg) if graph is None else graph
    layered = goes_by_layer(graph, cfg.d_model, min(batch_size, n_prompts), positions)
    per_chunk, held = chunking(cfg, graph, n_prompts, positions, batch_size, layered, element_size)
    stages = stage_bytes(cfg, n_prompts, positions, batch_size, method=method, ig=ig, element_size=element_size,
                         layered=layered, graph=graph)
    seconds, notes, one = stage_seconds(cfg, n_prompts, positions, batch_size, method=method, steps=steps,
                                        oracle=oracle, flops=flops, layered=layered, element_size=element_size,
                                        graph=graph)
    return CircuitCost(stages, seconds, per_chunk, held, -(-n_prompts // per_chunk), layered, one, notes)
