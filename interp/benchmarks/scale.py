"""Models at the size researchers study: a Llama-3.2-1B-shaped (1.24B) and a Llama-3.1-8B-shaped (8.03B)
bf16 checkpoint, random weights in safetensors shards: load, a forward and `interp analyze`, interp vs
transformers, each cell in a fresh process.

    python -m interp.benchmarks.scale --threads 2
    interp bench --sections scale
    INTERP_SCALE_SIZES=8b INTERP_SCALE_PARTS=analyze interp bench --sections scale   # a part of it

The folders are written once under `$INTERP_SCALE_DIR` (default ~/.cache/interp-scale; 2.5 GB and
16 GB) and reused: tensor names and shapes from a meta-device `LlamaForCausalLM`, each tensor drawn
(std 0.02, norms 1.0) and written shard by shard, so the writer never holds more than a shard; the folder
is written under a temporary name, checked by loading it with transformers, then renamed.
`INTERP_SCALE_SIZES` (1b,8b: the default) and `INTERP_SCALE_PARTS` (load,analyze: the default) choose;
`INTERP_SCALE_TIMEOUT` (default 900) limits each process, in seconds: a timeout is a row, not a crash.

Each cell runs in a fresh process, which reports its wall time and, from /proc/self/status, the peak
resident set (VmHWM), what is resident after the step split into anonymous memory (RssAnon: what the
process owns) and file-backed pages (RssFile: memory-mapped checkpoint pages, which the kernel can drop
and re-read), and the peak of each of the two as sampled every 0.2 s by a thread. The whole process is
counted, torch and the interpreter included. A load cell goes on with a forward of 512 random tokens
(batch 1, seed 0, no_grad) in the same process; VmHWM is reset (/proc/self/clear_refs) between the
two, so the forward's peak is its own (the loaded model included). An `interp analyze` cell runs the
command's `main` in the measured process: `--analyses previous_token,induction,sinks --n-seqs 2
--seq-len 512`, in memory (the command's default dtype: float32 on the CPU) and with `--offload disk`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .entry import section_main
from .report import Options, Section, Table
from .timing import fmt_bytes

GiB = 1024 ** 3
ROPE_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Size:
    key: str
    folder: str
    label: str
    config: dict  # LlamaConfig keyword arguments
    shard_bytes: int
    load_dtypes: tuple[str, ...]
    layer: dict = field(default_factory=dict)


SIZES = {
    "1b": Size("1b", "llama-1.2b-bf16", "1.2B (Llama-3.2-1B shape)", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={**ROPE_LLAMA3, "factor": 32.0}), 700_000_000, ("bfloat16", "float32")),
    "8b": Size("8b", "llama-8b-bf16", "8B (Llama-3.1-8B shape)", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={**ROPE_LLAMA3, "factor": 8.0}), 4_000_000_000, ("bfloat16",)),
}
# Llama-3.1-70B, for the extrapolation only (never written).
SHAPE_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)

FORWARD_TOKENS = 512
CELL_TIMEOUT = int(os.environ.get("INTERP_SCALE_TIMEOUT", "900"))  # seconds per fresh process (a timeout is a row)
ANALYZE_ARGS = ["--analyses", "previous_token,induction,sinks", "--n-seqs", "2", "--seq-len", "512",
                "--data", "repeated_random", "--no-progress", "--no-report"]

_WRITE_SCRIPT = """
import json, os, shutil, sys, torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, AutoModelForCausalLM
kwargs, final, shard_bytes = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
cfg = LlamaConfig(**kwargs)
cfg.dtype = torch.bfloat16
with torch.device("meta"):
    shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
if cfg.tie_word_embeddings:
    shapes.pop("lm_head.weight", None)  # the head is the embedding: stored once, as save_pretrained does
tmp = final + ".partial"
shutil.rmtree(tmp, ignore_errors=True)  # a write killed before: never renamed, never read
os.makedirs(tmp)
groups, size = [[]], 0
for name, shape in shapes.items():
    nbytes = 2 * torch.Size(shape).numel()
    if groups[-1] and size + nbytes > shard_bytes:
        groups.append([]); size = 0
    groups[-1].append(name); size += nbytes
g = torch.Generator().manual_seed(0)
weight_map, total = {}, 0
for i, names in enumerate(groups):
    file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    shard = {}
    for name in names:
        if name.endswith("norm.weight"):
            shard[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
        else:
            shard[name] = torch.randn(shapes[name], generator=g).mul_(0.02).to(torch.bfloat16)
        weight_map[name] = file
        total += shard[name].numel() * 2
    save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
    del shard
    print(f"wrote {file} ({len(names)} tensors)", flush=True)
with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
cfg.save_pretrained(tmp)
# The check that the layout is transformers' own: every weight found, none left over.
model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, output_loading_info=True)
bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
if bad:
    sys.exit(f"transformers did not load the written folder cleanly: {bad}")
del model
os.rename(tmp, final)
"""

# Peak memory of this process: /proc/self/status, and a thread sampling RssAnon and RssFile every 0.2 s.
_PROBE = """
import json, os, sys, threading, time
def _status():
    out = {}
    for l in open("/proc/self/status"):
        k = l.split(":")[0]
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(l.split()[1]) * 1024
    return out
_peak = {"RssAnon": 0, "RssFile": 0}
_t0 = time.perf_counter()
def _sample():
    # Every 10 s a "sample" line with the peaks so far: what a timed-out cell still reports.
    n = 0
    while True:
        s = _status()
        for k in _peak:
            _peak[k] = max(_peak[k], s[k])
        n += 1
        if n % 50 == 0:
            print(json.dumps({"phase": "sample", "elapsed": time.perf_counter() - _t0, "VmHWM": s["VmHWM"],
                              "peak_RssAnon": _peak["RssAnon"], "peak_RssFile": _peak["RssFile"]}), flush=True)
        time.sleep(0.2)
threading.Thread(target=_sample, daemon=True).start()
def _reset():
    # A new phase: VmHWM from now (clear_refs 5 resets it), the sampled peaks from now.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    s = _status()
    _peak.update(RssAnon=s["RssAnon"], RssFile=s["RssFile"])
def _report(phase, seconds, **extra):
    s = _status()
    print(json.dumps({"phase": phase, "seconds": seconds, **s, "peak_RssAnon": max(_peak["RssAnon"], s["RssAnon"]),
                      "peak_RssFile": max(_peak["RssFile"], s["RssFile"]), **extra}), flush=True)
"""

_LOAD_SCRIPT = _PROBE + """
import torch
which, dtype, folder, n = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], int(sys.argv[4])
if which == "interp":
    import interp
else:
    from transformers import AutoModelForCausalLM
start = time.perf_counter()
if which == "interp":
    model = interp.load(folder, dtype=dtype)
else:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
_report("load", time.perf_counter() - start, params=sum(p.numel() for p in model.parameters()))
if n:
    vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    tokens = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    _reset()
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(tokens) if which == "interp" else model(input_ids=tokens).logits
    _report("forward", time.perf_counter() - start, finite=bool(torch.isfinite(logits).all()))
"""

_ANALYZE_SCRIPT = _PROBE + """
from interp.cli import main
start = time.perf_counter()
rc = main(sys.argv[1:])
_report("analyze", time.perf_counter() - start, rc=rc)
"""


def scale_dir() -> Path:
    return Path(os.environ.get("INTERP_SCALE_DIR", Path.home() / ".cache" / "interp-scale"))


def folder(size: str = "1b") -> Path:
    """The folder of `size` (a key of SIZES), written when it is not there yet (the 1.2B about a minute,
    the 8B about ten, shard by shard: the writer holds one shard, at most ~4 GB, at a time)."""
    spec = SIZES[size]
    path = scale_dir() / spec.folder
    if not (path / "model.safetensors.index.json").exists():
        write(spec.config, path, spec.shard_bytes)
    return path


def write(config: dict, path: Path, shard_bytes: int, timeout: int = 3600) -> None:
    """Write a random-weight bf16 Llama checkpoint of `config` (LlamaConfig keywords) at `path`, in a fresh
    process, shards of at most `shard_bytes`, under `path`.partial until transformers has loaded it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _WRITE_SCRIPT, json.dumps(config), str(path), str(shard_bytes)],
                   check=True, timeout=timeout, cwd=tempfile.gettempdir())


def _env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads))


def _run_cell(script: str, args: list[str], threads: int, timeout: int) -> tuple[list[dict], str | None]:
    """Run `script` in a fresh process: its JSON lines, and None or what went wrong (a timeout, a crash)."""
    code = f"import torch; torch.set_num_threads({threads})\n" + script
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                              env=_env(threads), cwd=tempfile.gettempdir())
        out, err, problem = proc.stdout, proc.stderr, None
        if proc.returncode != 0:
            problem = f"exit {proc.returncode}: " + " | ".join(err.strip().splitlines()[-3:])
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        problem = f"timeout ({timeout} s)"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if err.strip():
        lines.append({"phase": "stderr", "text": err.strip()[-4000:]})
    return lines, problem


def load_cell(which: str, dtype: str, path: Path, threads: int, forward_tokens: int = 0,
              timeout: int = CELL_TIMEOUT) -> dict:
    """Load (and, given `forward_tokens`, run a forward) in a fresh process: {"load": ..., "forward": ...,
    "problem": None or a line}."""
    lines, problem = _run_cell(_LOAD_SCRIPT, [which, dtype, str(path), str(forward_tokens)], threads, timeout)
    cell = {line["phase"]: line for line in lines}  # the last "sample": the peaks so far, if it timed out
    cell["problem"] = problem
    if "load" not in cell:  # refused or failed: the row says why (its last stderr line)
        err = [x for x in cell.get("stderr", {}).get("text", "").splitlines() if x.strip()]
        cell["problem"] = (problem or "failed") if not err or (problem or "").startswith("timeout") else err[-1]
    return cell


def offload_available() -> bool:
    """Whether `interp analyze` has `--offload` (being added; until then the offloaded cells say so)."""
    from interp.cli import build_parser  # imported when the section runs: a section loads only what it measures

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return any("--offload" in a.option_strings for a in sub.choices["analyze"]._actions)


def analyze_cell(path: Path, out: Path, threads: int, offload: str | None = None, timeout: int = CELL_TIMEOUT) -> dict:
    """`interp analyze` in a fresh, measured process: its numbers, rc, and the last stderr lines."""
    shutil.rmtree(out, ignore_errors=True)
    args = ["analyze", str(path), "--out", str(out), *ANALYZE_ARGS, "--device", "cpu"]
    if offload:
        args += ["--offload", offload]
    lines, problem = _run_cell(_ANALYZE_SCRIPT, args, threads, timeout)
    samples = [line for line in lines if line["phase"] == "sample"]
    cell = next((line for line in lines if line["phase"] == "analyze"), dict(samples[-1]) if samples else {})
    err = next((line["text"] for line in lines if line["phase"] == "stderr"), "")
    cell.update(problem=problem, stderr=err, command="interp " + " ".join(args))
    return cell


def read_speed(path: Path, limit: int = 2 * GiB) -> float | None:
    """Bytes per second reading the first `limit` bytes of the folder's largest shard cold: its pages are
    dropped from the page cache first (posix_fadvise DONTNEED), so the disk is read. None where unsupported."""
    shard = max(path.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    try:
        fd = os.open(shard, os.O_RDONLY)
    except OSError:
        return None
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start, done = time.perf_counter(), 0
        while done < limit:
            block = os.read(fd, 16 << 20)
            if not block:
                break
            done += len(block)
        return done / (time.perf_counter() - start)
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


def layer_params(cfg: dict) -> int:
    """Parameters of one Llama block (attention, MLP, two norms)."""
    d, f, h, kv, dh = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim"))
    return 2 * d * h * dh + 2 * d * kv * dh + 3 * d * f + 2 * d


def model_params(cfg: dict) -> int:
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    return cfg["num_hidden_layers"] * layer_params(cfg) + embed * (1 if cfg["tie_word_embeddings"] else 2) + cfg["hidden_size"]


def _choice(var: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    raw = os.environ.get(var, ",".join(allowed))
    chosen = tuple(x.strip().lower() for x in raw.split(",") if x.strip())
    bad = [x for x in chosen if x not in allowed]
    if bad or not chosen:
        raise ValueError(f"{var}={raw!r}: choose from {', '.join(allowed)}")
    return chosen


def _gib(n) -> str:
    return fmt_bytes(n) if isinstance(n, (int, float)) else "-"


def _secs(cell: dict | None) -> str:
    return f"{cell['seconds']:.1f}" if cell and "seconds" in cell else "-"


def section(opts: Options) -> Section:
    title = "Models at scale: 1.2B and 8B checkpoints (Llama shapes, bf16 shards), interp vs transformers"
    if opts.quick:
        return Section("scale", title, skipped="--quick leaves it out (2.5 GB and 16 GB folders, loads, forwards and "
                                               "analyses of 1.2B and 8B parameters)")
    import torch

    sizes = _choice("INTERP_SCALE_SIZES", tuple(SIZES))
    parts = _choice("INTERP_SCALE_PARTS", ("load", "analyze"))
    threads = torch.get_num_threads()
    paths = {s: folder(s) for s in sizes}
    load_rows, fwd_rows, analyze_rows, disk_rows, notes, headline = [], [], [], [], [], []
    measured: dict = {}
    for s in sizes:
        spec, path = SIZES[s], paths[s]
        per_layer = layer_params(spec.config)
        speed = read_speed(path)
        measured[s] = {"read": speed, "layer_bytes": 2 * per_layer}
        disk_rows.append([spec.label, f"{model_params(spec.config) / 1e9:.2f}B",
                          _gib(sum(p.stat().st_size for p in path.glob("*.safetensors"))),
                          len(list(path.glob("*.safetensors"))), f"{per_layer / 1e6:.0f}M", _gib(2 * per_layer),
                          f"{speed / 1e6:,.0f} MB/s" if speed else "-"])
    if "load" in parts:
        for s in sizes:
            spec = SIZES[s]
            for dtype in spec.load_dtypes:
                for which in ("interp", "transformers"):
                    c = load_cell(which, dtype, paths[s], threads, FORWARD_TOKENS)
                    measured[s][(which, dtype)] = c
                    ld, fw = c.get("load"), c.get("forward")
                    if not ld:
                        load_rows.append([spec.label, which, dtype, c["problem"], "-", "-", "-", "-"])
                        fwd_rows.append([spec.label, which, dtype, "not run (no load)", "-", "-", "-", "-"])
                        continue
                    load_rows.append([spec.label, which, dtype, _secs(ld), _gib(ld["VmHWM"]), _gib(ld["peak_RssAnon"]),
                                      _gib(ld["RssAnon"]), _gib(ld["RssFile"])])
                    if fw:
                        fwd_rows.append([spec.label, which, dtype, _secs(fw), _gib(fw["VmHWM"]),
                                         _gib(fw["peak_RssAnon"]), _gib(fw["peak_RssFile"]),
                                         "yes" if fw.get("finite") else "NO"])
                    else:
                        fwd_rows.append([spec.label, which, dtype, c["problem"] or "failed", "-", "-", "-", "-"])
            i, t = measured[s].get(("interp", "bfloat16")), measured[s].get(("transformers", "bfloat16"))
            if i and t and i.get("load") and t.get("load"):
                line = (f"{spec.label} bf16: interp loads in {i['load']['seconds']:.1f} s "
                        f"({i['load']['seconds'] / t['load']['seconds']:.2f}x transformers), peak "
                        f"{_gib(i['load']['VmHWM'])} (transformers {_gib(t['load']['VmHWM'])})")
                if i.get("forward") and t.get("forward"):
                    line += (f"; a {FORWARD_TOKENS}-token forward {i['forward']['seconds']:.1f} s vs "
                             f"{t['forward']['seconds']:.1f} s")
                headline.append(line)
    if "analyze" in parts:
        analyze_rows = _analyze_rows(sizes, paths, threads, measured, headline)
    notes += _extrapolation(measured, sizes)
    tables = [Table("The folders: size, shards, one block's parameters and bf16 bytes, a cold read of the largest shard",
                    ["model", "params", "on disk", "shards", "params/layer", "bytes/layer (bf16)", "disk read"],
                    disk_rows)]
    if load_rows:
        tables += [
            Table(f"Load, fresh process each, {threads} thread(s)",
                  ["model", "loader", "dtype", "seconds", "peak (VmHWM)", "peak RssAnon (sampled)", "RssAnon after",
                   "RssFile after"], load_rows),
            Table(f"A forward of {FORWARD_TOKENS} tokens right after the load (same process, batch 1, no_grad; "
                  f"timeout {CELL_TIMEOUT} s per process)",
                  ["model", "loader", "dtype", "seconds", "peak (VmHWM, forward)", "peak RssAnon (sampled)",
                   "peak RssFile (sampled)", "finite logits"], fwd_rows)]
    if analyze_rows:
        tables.append(Table("`interp analyze MODEL --analyses previous_token,induction,sinks --n-seqs 2 --seq-len 512`, "
                            "fresh process each", ["model", "mode", "result", "seconds", "s/layer", "peak (VmHWM)",
                                                   "peak RssAnon (sampled)", "peak RssFile (sampled)"], analyze_rows))
    s = Section("scale", title, intro=__doc__.split("\n\n", 2)[2].strip(), tables=tables, notes=notes)
    s.headline = headline
    return s


def _analyze_rows(sizes, paths: dict, threads: int, measured: dict, headline: list) -> list[list]:
    """The `interp analyze` table's rows, in memory and offloaded for each size; each cell's numbers go into
    `measured`, an offloaded success into `headline`."""
    rows = []
    has_offload = offload_available()
    for s in sizes:
        spec, n_layers = SIZES[s], SIZES[s].config["num_hidden_layers"]
        for offload in (None, "disk"):
            mode = "--offload disk" if offload else "in memory"
            if offload and not has_offload:
                rows.append([spec.label, mode, "not run: `interp analyze` has no --offload yet",
                         "-", "-", "-", "-", "-"])
                continue
            c = analyze_cell(paths[s], scale_dir() / f"analyze-{s}-{'offload' if offload else 'memory'}",
                             threads, offload)
            measured[s][("analyze", offload)] = c
            if c.get("rc") == 0 and not c["problem"]:
                result = "ok"
            else:
                lines = [x for x in c["stderr"].splitlines() if x.strip()]
                result = c["problem"] or (lines[-1] if lines else f"exit {c.get('rc')}")
                if c.get("rc") not in (0, None) and lines:
                    result = lines[-1]
            ok = result == "ok"
            if c["problem"] and c["problem"].startswith("timeout") and "elapsed" in c:
                result += f" (peaks until {c['elapsed']:.0f} s)"
            rows.append([spec.label, mode, result, _secs(c) if ok else "-",
                         f"{c['seconds'] / n_layers:.2f}" if ok else "-",
                         _gib(c.get("VmHWM")), _gib(c.get("peak_RssAnon")), _gib(c.get("peak_RssFile"))])
            if offload and ok:
                headline.append(f"{spec.label} `interp analyze --offload disk` (3 analyses, 2 x 512 tokens): "
                                f"{c['seconds']:.0f} s ({c['seconds'] / n_layers:.1f} s/layer), peak RssAnon "
                                f"{_gib(c['peak_RssAnon'])}, VmHWM {_gib(c['VmHWM'])}")
    return rows


def _extrapolation(measured: dict, sizes: tuple[str, ...]) -> list[str]:
    """Notes: 70B's block against the largest measured one, and what its measured seconds and bytes per
    layer would become at 70B (FLOPs per token per layer scale with the block's parameters at 512 tokens)."""
    big = sizes[-1]
    spec = SIZES[big]
    ratio = layer_params(SHAPE_70B) / layer_params(spec.config)
    notes = [f"Llama-3.1-70B: {model_params(SHAPE_70B) / 1e9:.1f}B parameters, {SHAPE_70B['num_hidden_layers']} "
             f"blocks of {layer_params(SHAPE_70B) / 1e6:.0f}M ({_gib(2 * layer_params(SHAPE_70B))} in bf16), "
             f"{ratio:.2f}x the {spec.label} block; {_gib(2 * model_params(SHAPE_70B))} in bf16"]
    c = measured[big].get(("analyze", "disk"))
    if c and c.get("rc") == 0 and not c.get("problem"):
        per_layer = c["seconds"] / spec.config["num_hidden_layers"]
        speed = measured[big]["read"]
        total = per_layer * ratio * SHAPE_70B["num_hidden_layers"]
        read = 2 * model_params(SHAPE_70B) / speed if speed else None
        notes.append(f"Extrapolated from the {spec.label} offloaded analyze ({per_layer:.1f} s/layer): 70B on this CPU "
                     f"~{per_layer * ratio:.0f} s/layer, ~{total / 60:.0f} min for the same analyze"
                     + (f"; reading its 141 GB once at the measured {speed / 1e6:,.0f} MB/s takes "
                        f"~{read / 60:.0f} min of that" if read else ""))
    return notes


def main(argv=None) -> int:
    return section_main("scale", section, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
