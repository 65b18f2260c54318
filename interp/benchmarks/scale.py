"""Loading a model at the size researchers study: a Llama-3.2-1B-shaped checkpoint (1.24B parameters,
bf16, four safetensors shards, random weights written by transformers' `save_pretrained`), interp vs
transformers, each in the other's dtypes.

    python -m interp.benchmarks.scale --threads 1
    interp bench --sections scale

The folder is written once under `$INTERP_SCALE_DIR` (default ~/.cache/interp-scale; 2.4 GB) and
reused. Each load runs in a fresh process, which reports its wall time and, from /proc/self/status after
the load, the peak resident set (VmHWM) and what is resident now split into anonymous memory (RssAnon:
what the process owns) and file-backed pages (RssFile: the memory-mapped checkpoint, which the kernel
can drop and re-read). The whole process is counted, torch and the interpreter included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .entry import section_main
from .report import Options, Section, Table
from .timing import fmt_bytes

_WRITE_SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
                  rope_theta=500000.0, head_dim=64,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu").to(torch.bfloat16)
model.tie_weights()  # to_empty made the head its own tensor again
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
model.config.dtype = torch.bfloat16
model.save_pretrained(sys.argv[1], max_shard_size="700MB")
"""

_LOAD_SCRIPT = """
import json, sys, time
import torch
which, dtype, folder = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3]
if which == "interp":
    import interp
else:
    from transformers import AutoModelForCausalLM
start = time.perf_counter()
if which == "interp":
    model = interp.load(folder, dtype=dtype)
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
seconds = time.perf_counter() - start
status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.split(":")[0] in
          ("VmHWM", "RssAnon", "RssFile")}
print(json.dumps({"seconds": seconds, **status, "params": sum(p.numel() for p in model.parameters())}))
"""

LOADS = (("interp", "bfloat16"), ("transformers", "bfloat16"), ("interp", "float32"), ("transformers", "float32"))


def folder() -> Path:
    """The 1.2B folder, written (about a minute) when it is not there yet."""
    path = Path(os.environ.get("INTERP_SCALE_DIR", Path.home() / ".cache" / "interp-scale")) / "llama-1.2b-bf16"
    if not (path / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-c", _WRITE_SCRIPT, str(path)], check=True, timeout=1800)
    return path


def load_cell(which: str, dtype: str, path: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-c", f"import torch; torch.set_num_threads({threads})\n" + _LOAD_SCRIPT,
                           which, dtype, str(path)], capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"loading with {which} {dtype} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section(opts: Options) -> Section:
    title = "Loading a 1.2B checkpoint (Llama-3.2-1B shape, bf16 shards), interp vs transformers"
    if opts.quick:
        return Section("scale", title, skipped="--quick leaves it out (a 2.4 GB folder and four loads of 1.2B parameters)")
    import torch

    path = folder()
    threads = torch.get_num_threads()
    cells = {(w, d): load_cell(w, d, path, threads) for w, d in LOADS}
    rows = [[w, d, c["seconds"], fmt_bytes(c["VmHWM"]), fmt_bytes(c["RssAnon"]), fmt_bytes(c["RssFile"])]
            for (w, d), c in cells.items()]
    params = cells[LOADS[0]]["params"]
    ratio = {d: cells[("interp", d)]["seconds"] / cells[("transformers", d)]["seconds"] for d in ("bfloat16", "float32")}
    s = Section("scale", title, intro=__doc__.split("\n\n", 2)[2].strip(), tables=[
        Table(f"Load, fresh process each, {threads} thread(s), {params / 1e9:.2f}B parameters",
              ["loader", "dtype", "seconds", "peak (VmHWM)", "RssAnon after", "RssFile after"], rows)])
    s.headline = [f"1.2B bf16 folder: interp loads in {cells[('interp', 'bfloat16')]['seconds']:.1f} s "
                  f"({ratio['bfloat16']:.2f}x transformers), peak {fmt_bytes(cells[('interp', 'bfloat16')]['VmHWM'])}; "
                  f"float32 {ratio['float32']:.2f}x transformers"]
    return s


def main(argv=None) -> int:
    return section_main("scale", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
