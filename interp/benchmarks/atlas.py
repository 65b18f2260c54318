"""Benchmark: where the default atlas's time goes, stage by stage, and the stages made faster, before and after.

    interp bench --sections atlas                 # SmolLM2-135M and Gemma 3 270M (the real models installed)
    interp bench --sections atlas --quick         # the zoo's attn-only-2l, seconds

For each model, in one process:

1. the three stages that had a faster way to the same numbers, each timed both ways on the atlas's own
   inputs, the results compared:
   - pruning (Michel et al.'s study: importance, reverse and 3 random orders on the atlas's 8 pieces of 256
     tokens): every curve alone and every evaluation a whole forward (`pruning_study(reuse=False)`, the
     plain algorithm) against the shared values, unpruned evaluation and importance, with each evaluation
     resumed from the lowest layer its step changed;
   - StreamingLLM's window + sink settings with positions inside the cache (2,048 tokens, the atlas's two
     windows): the score hooks on the instrumented [pos, pos] path against the window's fused forward with
     each layer's z written out in blocks;
   - Q/K/V composition scores: a product of small matrices per pair of heads (`factored.composition_scores`,
     one call per layer) against one matrix product per layer (`layered_composition_scores`);
2. the whole default atlas (`interp analyze MODEL`, in this process), its seconds per analysis.

One round each (these are minutes on a CPU); the machine should be otherwise idle.
"""

from __future__ import annotations

import tempfile
import time

import torch

from .entry import section_main
from .report import Options, Section, Table


def _seconds(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _pruning(model, ctx_tokens):
    from interp.analyses.pruning import pruning_study
    from interp.analyses.atlas.registry import pruning as reg

    p = reg.PARAMS
    kw = dict(split=p["split"], seeds=p["seeds"], step=p["step"], max_fraction=p["max_fraction"], method=p["method"],
              tolerance=p["tolerance"], progress_bar=False)
    before, a = _seconds(lambda: pruning_study(model, ctx_tokens, reuse=False, **kw))
    after, b = _seconds(lambda: pruning_study(model, ctx_tokens, **kw))
    same = list(a["pruned"]) == list(b["pruned"])
    return before, after, float((a["loss"] - b["loss"]).abs().max()), same


def _streaming(model, stream, windows, n_sink):
    from interp.analyses import streaming as st
    from interp.models import lm_loss

    def run(hooks_of):
        out = []
        for w in windows:
            with st.sliding_window(model, w):
                logits = model.run_with_hooks(stream, fwd_hooks=hooks_of(model, w, n_sink))
            out.append(lm_loss(logits, stream, per_token=True))
        return torch.stack(out)

    with torch.no_grad():
        before, a = _seconds(lambda: run(st._cache_position_hooks))
        after, b = _seconds(lambda: run(st._cache_position_z_hooks))
    return before, after, float((a.mean(-1) - b.mean(-1)).abs().max()), None


def _composition(model):
    from interp.models.readouts.factored import composition_scores

    def per_pair(mode):
        L, H = model.cfg.n_layers, model.cfg.n_heads
        out = torch.zeros(L, H, L, H)
        left = model.OV
        right = {"Q": model.QK, "K": model.QK.T, "V": left}[mode]
        for la in range(L - 1):
            out[la, :, la + 1:] = composition_scores(left[la], right[la + 1:], dtype=torch.float32)
        return out

    with torch.no_grad():
        before, a = _seconds(lambda: [per_pair(m) for m in "QKV"])
        after, b = _seconds(lambda: [model.all_composition_scores(m) for m in "QKV"])
    return before, after, max(float((x - y).abs().max()) for x, y in zip(a, b)), None


def _atlas(name: str, device: str) -> dict[str, float]:
    """`interp analyze NAME` (the default atlas) as a user runs it, in a fresh process; seconds per analysis
    (from its parts) and of the whole command."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "interp", "analyze", name, "--out", f"{tmp}/atlas", "--device",
                               device, "--no-progress"], capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir())
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"interp analyze {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        seconds = {f.stem: json.loads(f.read_text()).get("seconds", float("nan"))
                   for f in sorted(Path(tmp, "atlas", "parts").rglob("*.json"))}
    return dict(seconds, **{"whole command": total})


def _model_rows(name: str, opts: Options) -> tuple[list[list], list[list]]:
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.analyses.atlas.registry import streaming as reg_stream
    from interp.analyses.atlas.registry.base import Context
    from interp.analyses.data import DataSpec, build_tokens

    model = interp.load(name, device=opts.device)
    kind = "corpus" if name == "attn-only-2l" else "text"  # what the atlas reads: the zoo's corpus, or real text
    data = DataSpec(kind=kind, n_seqs=16, seq_len=min(256, model.cfg.n_ctx))
    ctx = Context(model=model, tokens=build_tokens(data, model).to(opts.device), data=data)
    stream = reg_stream.stream(ctx).to(opts.device)
    stages = [("pruning", lambda: _pruning(model, ctx.pieces(256, 8)))]
    if model.rotary is not None:  # cache positions are a rotary model's (others keep their positions)
        stages.append(("streaming (window+sink, cache positions)",
                       lambda: _streaming(model, stream, reg_stream.windows(stream.shape[1]), reg_stream.PARAMS["n_sink"])))
    stages.append(("composition (Q, K, V)", lambda: _composition(model)))
    rows = []
    for stage, run in stages:
        before, after, diff, same = run()
        rows.append([name, stage, f"{before:.1f}", f"{after:.1f}", f"{before / after:.2f}x", f"{diff:.1e}",
                     "-" if same is None else "yes" if same else "NO"])
    seconds = _atlas(name, opts.device)
    return rows, [[name, k, f"{v:.1f}"] for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]


def section(opts: Options) -> Section:
    stage_rows, atlas_rows = [], []
    for name in ["attn-only-2l"] if opts.quick else ["smollm2-135m", "gemma3-270m"]:
        rows, seconds = _model_rows(name, opts)
        stage_rows += rows
        atlas_rows += seconds
    return Section(
        "atlas", "Where the default atlas's time goes",
        intro=("The stages of `interp analyze MODEL` that have a faster way to the same numbers, each timed both ways in "
               "one process on the atlas's own inputs (pruning: 8 pieces of 256 tokens, importance + reverse + 3 random "
               "orders, 2.5% of the heads a step to 20%; streaming: the window + 4 sinks settings at the atlas's two "
               "windows of a 2,048-token stream, positions inside the rolling cache; composition: Q, K and V scores of "
               "every pair of heads in different layers), then the whole default atlas with its seconds per analysis. "
               "One round each."),
        tables=[Table("Stages, before and after", ["model", "stage", "before s", "after s", "speed-up",
                                                   "max |before - after|", "same heads"], stage_rows),
                Table("The default atlas, seconds per analysis (after)", ["model", "analysis", "seconds"], atlas_rows)],
        notes=[f"on {opts.device}, {torch.get_num_threads()} threads; pruning's 'before' leaves out the forward the old "
               "code spent on zero ablation values (one per curve, ~1.4 s on SmolLM2)"],
    )


def main(argv=None) -> int:
    return section_main("atlas", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
