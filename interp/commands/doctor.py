"""`interp doctor`: what this machine gives interp, and whether its kernels are right here.

One command for a new machine and for bug reports: versions (Python, torch and its CUDA build,
Triton, the optional packages), the devices torch sees, which attention backends and streaming-statistics
kernels are live on the chosen device and which one ``backend="auto"`` picks there, then a short
correctness check on that device (about ten seconds at most):

* the streaming statistics of the torch kernel against the float64 materialised pattern
  (`interp.kernels.stats.reference`), on a random GQA problem with a window and left padding;
* the Triton kernel against the torch one on the same problem: on CUDA natively (float32 and bfloat16),
  and on a machine without CUDA in Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``);
* a small model's fused forward against its instrumented one (the two attention paths).

Exit status 0 when every check that ran passed, 1 when one failed (the line says which and by how much).
"""

from __future__ import annotations

HELP = "versions, devices, live attention and statistics backends, and a 10-second kernel check on this machine"
EPILOG = """examples:
  interp doctor                   # the default device (cuda when available, else cpu)
  interp doctor --device cuda:1
  interp doctor --device cpu

Paste its output into bug reports.
"""

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}  # max |diff| of any statistic (distance: relative)
OPTIONAL = ("triton", "transformers", "tokenizers", "gguf", "transformer_lens", "ray", "pyarrow")


def add_arguments(p) -> None:
    p.add_argument("--device", default=None, help="the device to check (default: cuda when available, else cpu)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens of the kernel check (default 2048 on CUDA, 384 on the CPU)")


def run(args) -> int:
    import platform

    import torch

    from interp.kernels import resolve_backend
    from interp.models.placement.device import available_devices, compute_record, device_name, resolve_device
    from interp.errors import check_int

    device = resolve_device(args.device)  # an unknown or absent device: one line, before any work
    if args.seq is not None:
        check_int("seq", args.seq, minimum=16, maximum=1 << 16)
    n = args.seq or (2048 if device.type == "cuda" else 384)

    print(f"interp {_version('interp') or 'unknown'} · Python {platform.python_version()} "
          f"({platform.system()} {platform.machine()})")
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    print(f"torch {torch.__version__} ({cuda}" + (f", cuDNN {torch.backends.cudnn.version()}"
                                                 if torch.backends.cudnn.is_available() else "") + ")")
    print("packages: " + ", ".join(f"{m} {_version(m) or 'not installed'}" for m in OPTIONAL))
    print("devices: " + "; ".join(f"{d} = {device_name(d)}" for d in available_devices()))
    record = compute_record(device)
    print(f"checking on {device} ({record['device_name']}), {record['threads']} torch threads")

    print("\nattention backends (model.attention(...); 'auto' runs fused unless a pattern is asked for):")
    for line in _attention_lines(device):
        print("  " + line)
    print("streaming statistics kernels (attention_stats(backend=...)):")
    print(f"  fused   live (torch's fused attention kernel + gathers, any device; not soft-capping; "
          "auto runs it off CUDA for statistics without max)")
    print(f"  torch   live (tiled, any device)")
    triton = _triton_state(device)
    print(f"  triton  {triton}")
    print(f"  auto -> {resolve_backend('auto', device)} on {device}")

    print(f"\ncorrectness on {device} (max |difference| over every statistic; a random GQA problem, "
          f"window and left padding, {n} tokens):")
    failed = 0
    for label, diff, tol in _checks(device, n):
        if diff is None:
            print(f"  {label}: skipped ({tol})")
            continue
        ok = diff <= tol
        failed += not ok
        print(f"  {label}: {diff:.2e} {'ok' if ok else 'FAILED'} (tolerance {tol:.0e})")
    print("\nall checks passed" if not failed else f"\n{failed} check(s) FAILED: please report this output")
    return 1 if failed else 0


# ---- what is live ------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    """A module's distribution version; "installed" when it imports without package metadata; None if absent."""
    import importlib.util

    from interp.models.placement.device import installed_version

    found = installed_version({"transformer_lens": "transformer-lens"}.get(module, module))
    if found is None and module != "interp" and importlib.util.find_spec(module) is not None:
        return "installed"
    return found


def _attention_lines(device) -> list[str]:
    import torch
    import torch.nn.functional as F

    from interp.kernels.attention import ATTENTION_BACKENDS

    lines = []
    for name, b in ATTENTION_BACKENDS.items():
        live = device.type in b.devices
        what = "never builds the pattern" if not b.materialises else "scores and patterns for hooks"
        lines.append(f"{name:13s} {'live' if live else 'not on ' + device.type} ({what})")
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 2, 64, 64, device=device, dtype=torch.bfloat16)
        kernels = []
        for kind in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                with sdpa_kernel(getattr(SDPBackend, kind)):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
                kernels.append(f"{kind.lower().replace('_attention', '')} yes")
            except (RuntimeError, AttributeError):
                kernels.append(f"{kind.lower().replace('_attention', '')} no")
        lines.append("  fused runs SDPA; bf16 kernels here: " + ", ".join(kernels))
    else:
        lines.append(f"  fused runs SDPA ({device.type}: its own fused kernel)")
    return lines


def _triton_state(device) -> str:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "not installed (pip install 'interp[triton]'; the torch kernel serves meanwhile)"
    if device.type != "cuda":
        return f"installed, not live on {device.type} (a CUDA kernel); checked below in Triton's CPU interpreter"
    return "live (the fused GPU kernel)"


# ---- checks ----------------------------------------------------------------------------------------
def problem(n: int, device, dtype, seed: int = 0) -> dict:
    """A random statistics problem: 2 sequences (the second left-padded by n // 5), 8 query heads over 2 KV
    heads, d_head 64, a window of n // 3, tokens that repeat (so duplicate / induction fire)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, n, 64, generator=g)
    k = torch.randn(2, 2, n, 64, generator=g) * 1.5
    half = torch.randint(0, 50, (2, (n + 1) // 2), generator=g)
    tokens = torch.cat([half, half], 1)[:, :n]
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[1, : n // 5] = False
    return dict(q=q.to(device, dtype), k=k.to(device, dtype), tokens=tokens.to(device),
                key_padding_mask=pad.to(device), window=max(1, n // 3))


def max_diff(a: dict, b: dict) -> float:
    """Max |a - b| over every statistic, where both are finite (distance relative to the sequence length);
    inf where one is NaN and the other is not."""
    import torch

    worst = 0.0
    for name in a:
        x, y = a[name].double().cpu(), b[name].double().cpu()
        if not torch.equal(x.isnan(), y.isnan()):
            return float("inf")
        ok = ~x.isnan()
        if ok.any():
            d = (x[ok] - y[ok]).abs().max().item()
            worst = max(worst, d / x.shape[-1] if name == "distance" else d)
    return worst


def _stats(backend: str, pb: dict) -> dict:
    from interp.kernels import Scoring, attention_stats

    return attention_stats(pb["q"], pb["k"], pb["tokens"], Scoring(window=pb["window"]),
                           key_padding_mask=pb["key_padding_mask"], backend=backend).to_dict()


def _checks(device, n: int):
    """(label, max difference or None, tolerance or the reason it was skipped), one per check."""
    import importlib.util

    import torch

    from interp.kernels import Scoring
    from interp.kernels.stats.reference import reference_stats

    f32 = problem(n, device, torch.float32)
    ref = reference_stats(f32["q"], f32["k"], f32["tokens"], Scoring(window=f32["window"]),
                          key_padding_mask=f32["key_padding_mask"])
    torch_stats = _stats("torch", f32)
    yield "torch kernel vs float64 materialised pattern (float32)", max_diff(torch_stats, ref), TOL["float32"]
    yield "fused route vs float64 materialised pattern (float32)", max_diff(_stats("fused", f32), ref), TOL["float32"]
    if device.type == "cuda":
        bf = problem(n, device, torch.bfloat16)
        yield ("fused route vs torch kernel (bfloat16 inputs)", max_diff(_stats("fused", bf), _stats("torch", bf)),
               TOL["float32"])
    if importlib.util.find_spec("triton") is None:
        yield "triton kernel vs torch kernel", None, "Triton is not installed"
    elif device.type == "cuda":
        yield "triton kernel vs torch kernel (float32)", max_diff(_stats("triton", f32), torch_stats), TOL["float32"]
        bf = problem(n, device, torch.bfloat16)
        yield ("triton kernel vs torch kernel (bfloat16 inputs)", max_diff(_stats("triton", bf), _stats("torch", bf)),
               TOL["bfloat16"])
    else:
        diff, why = _interpreted_triton_diff(min(n, 96))
        yield f"triton kernel (CPU interpreter, {min(n, 96)} tokens) vs torch kernel (float32)", diff, (
            TOL["float32"] if diff is not None else why)
    yield "fused vs instrumented attention (a 4-layer GQA model's logits, float32)", _paths_diff(device), 1e-4


def _interpreted_triton_diff(n: int, timeout: float = 60.0) -> tuple[float | None, str]:
    """The Triton kernel in its CPU interpreter against the torch kernel, in a subprocess (TRITON_INTERPRET
    must be set before Triton is imported)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    code = ("import json, torch; from interp.commands.doctor import problem, max_diff, _stats; "
            f"pb = problem({n}, torch.device('cpu'), torch.float32); "
            "print(json.dumps(max_diff(_stats('triton', pb), _stats('torch', pb))))")
    try:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return None, f"the interpreter took over {timeout:.0f} s"
    if done.returncode != 0:
        return None, "the interpreter failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return float(json.loads(done.stdout.strip().splitlines()[-1])), ""


def _paths_diff(device) -> float:
    import torch

    import interp  # start-up time: --help and argument errors never import torch

    cfg = interp.ModelConfig(n_layers=4, d_model=128, n_heads=8, n_kv_heads=2, d_head=16, d_mlp=256, d_vocab=256,
                             n_ctx=512, act_fn="silu", gated_mlp=True, normalization="rmsnorm", positional="rotary",
                             qkv_bias=False, attn_out_bias=False, mlp_bias=False)
    model = interp.HookedTransformer(cfg, seed=0).eval().to(device)
    tokens = torch.randint(0, cfg.d_vocab, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        fused = model(tokens)
        with model.attention("instrumented"):
            instrumented = model(tokens)
    return float((fused - instrumented).abs().max())
