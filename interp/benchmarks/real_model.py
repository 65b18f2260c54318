"""Real pretrained models from their GGUF files, ours vs transformers: SmolLM2-135M-Instruct
(`real_model`) and Gemma 3 270M (`gemma3`: 262k vocabulary, local and global layers).

    python -m interp.benchmarks.real_model                   # SmolLM2: load + forward at 1x1024 and 4x256
    interp bench --sections real_model,gemma3

Loading: each loader runs in a fresh process (`interp.load(name)`; transformers'
`from_pretrained(folder, gguf_file=...)` with dtype float32), which reports its wall time and the
growth of its peak resident set over the process after imports (`ru_maxrss`, high-water mark
reset first), beside the size of the fp32 weights. Forward: both models in this process, same
tokens, logits checked first, median of timed rounds (transformers with `sdpa` attention).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import torch

from .entry import section_main
from .report import Options, Section, Table
from .timing import compare_times, fmt_bytes, format_table

_LOAD_SCRIPT = """
import json, resource, sys, time
import torch
which, name = sys.argv[1], sys.argv[2]
import interp
from interp.loading import real_model_file
f = real_model_file(name)
if which != "ours":
    from transformers import AutoModelForCausalLM
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (Linux)
except OSError:
    pass
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
start = time.perf_counter()
if which == "ours":
    model = interp.load(name)
else:
    model = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"seconds": seconds, "peak": peak, "weights": params * 4}))
"""


def load_cell(which: str, name: str = "smollm2-135m") -> dict:
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, which, name], capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"loading with {which} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def forward_rows(opts: Options, shapes=((1, 1024), (4, 256)), name: str = "smollm2-135m") -> tuple[list[list], list[str]]:
    import interp  # imported when the section runs: a section loads only what it measures
    from interp.loading import real_model_file  # imported when the section runs: a section loads only what it measures
    from transformers import AutoModelForCausalLM

    f = real_model_file(name)
    ours = interp.load(name)
    hf = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    rows, notes = [], []
    with torch.no_grad():
        probe = torch.randint(0, ours.cfg.d_vocab, (1, 64), generator=gen)
        notes.append(f"max |logit difference| ours vs transformers on the same GGUF: {(ours(probe) - hf(probe).logits).abs().max():.1e}")
        for batch, seq in shapes:
            tokens = torch.randint(0, ours.cfg.d_vocab, (batch, seq), generator=gen)
            t, rounds = compare_times({"ours": lambda: ours(tokens), "hf": lambda: hf(tokens, use_cache=False)},
                                      opts.repeats, opts.warmup, opts.budget, opts.min_repeats, opts.clock)
            rows.append([f"{batch}x{seq}", t["ours"] * 1e3, t["hf"] * 1e3, t["ours"] / t["hf"], rounds])
    return rows, notes


def _section(opts: Options, key: str, name: str, title: str, label: str) -> Section:
    # imported when the section runs: a section loads only what it measures
    from interp.loading import ModelNotFound, real_model_file

    try:
        real_model_file(name)
    except ModelNotFound as e:
        return Section(key, title, skipped=str(e))
    loads = {w: load_cell(w, name) for w in ("ours", "transformers")}
    load_rows = [[w, r["seconds"], fmt_bytes(r["peak"]), fmt_bytes(r["weights"]), r["peak"] / r["weights"]]
                 for w, r in loads.items()]
    shapes = ((1, 64), (2, 32)) if opts.quick else ((1, 1024), (4, 256))
    fwd, notes = forward_rows(opts, shapes, name)
    speedup = loads["transformers"]["seconds"] / loads["ours"]["seconds"]
    s = Section(
        key, title,
        intro=__doc__.split("\n\n", 2)[2].strip(),
        tables=[
            Table("Loading the GGUF file (fresh process each)", ["loader", "seconds", "peak RSS growth", "fp32 weights",
                                                                 "peak / weights"], load_rows),
            Table("Forward, float32", ["batch x seq", "ours ms", "HF sdpa ms", "ours / HF", "rounds"], fwd),
        ],
        notes=notes,
    )
    s.headline = [f"{label}: loads in {loads['ours']['seconds']:.1f} s ({speedup:.1f}x faster than transformers' "
                  f"{loads['transformers']['seconds']:.1f} s), peak {loads['ours']['peak'] / loads['ours']['weights']:.2f}x "
                  "the fp32 weights; forward ours/HF = " + ", ".join(f"{r[3]:.2f} at {r[0]}" for r in fwd)]
    return s


def section(opts: Options) -> Section:
    return _section(opts, "real_model", "smollm2-135m", "A real model: SmolLM2-135M-Instruct (Q4_1 GGUF), ours vs transformers",
                    "SmolLM2-135M")


def gemma3_section(opts: Options) -> Section:
    title = "Gemma 3 270M (Q4_K_M GGUF), ours vs transformers"
    if opts.quick:  # the same code as real_model's, which --quick runs; transformers' load of this file takes minutes
        return Section("gemma3", title, skipped="--quick leaves it out (transformers loads this file in minutes; "
                                                "`real_model` runs the same code on SmolLM2)")
    return _section(opts, "gemma3", "gemma3-270m", title, "Gemma 3 270M")


def main(argv=None) -> int:
    return section_main("real_model", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["format_table", "gemma3_section", "load_cell", "section"]
