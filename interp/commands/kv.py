"""`interp kv MODEL --out DIR`: what quantized KV caches do to a model, head by head, and a per-head
mixed-precision cache chosen by the analysis."""

from __future__ import annotations

HELP = "KV-cache compression study: perplexity and bytes per precision, which heads change, mixed precision"
EPILOG = """examples:
  interp kv smollm2-135m --out out/kv                      # real text (the Python Language Reference), 2048 tokens
  interp kv smollm2-135m --out out/kv --precisions fp32,fp16,int8,int4
  interp kv attn-only-2l --out out/kv-zoo --seq-len 256
  interp kv smollm2-135m --out out/kv --data-file ids.npy  # token ids, one sequence per row, used as they are

Writes kv.parquet, kv_heads.parquet, kv_mixed.parquet, kv_sensitivity.parquet, report.html and report.md.
"""


def add_arguments(p) -> None:
    from .choices import KV_PRECISIONS

    p.add_argument("model", help="a real-model name, .gguf file, checkpoint folder, zoo name or Hugging Face repo id")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--precisions", default="fp32,int8,fp8,int4",
                   help=f"comma-separated, from {','.join(KV_PRECISIONS)} (default fp32,int8,fp8,int4)")
    p.add_argument("--text-file", default=None, help="UTF-8 text (default: the Python Language Reference, pydoc_data.topics)")
    p.add_argument("--data-file", default=None, help="token ids (.npy or .pt), each row one sequence, no BOS added")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence of the default text (default 2048)")
    p.add_argument("--n-seqs", type=int, default=1, help="sequences of the default text (default 1)")
    p.add_argument("--sensitivity-tokens", type=int, default=1024,
                   help="tokens per sequence for the per-KV-head loss and gradient rankings (default 1024)")
    p.add_argument("--seeds", type=int, default=3, help="random selections per k (default 3)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _data_file(path: str):
    """Token ids as given: [n_seqs, seq_len] (a flat file is one sequence)."""
    from interp.analyses.sweep_data import read_token_file

    ids = read_token_file(path)
    return ids.reshape(1, -1) if ids.dim() == 1 else ids


def run(args) -> int:

    from interp.kernels.kv_quant import check_precision, code_shape

    try:
        precisions = [check_precision(p.strip()) for p in args.precisions.split(",") if p.strip()]
        if not precisions:
            raise ValueError("--precisions is empty")
        if args.data_file and args.text_file:
            raise ValueError("give --data-file (token ids) or --text-file (text), not both")
        ids = _data_file(args.data_file) if args.data_file else None
        from interp.analyses.sweep_data import DataSpec, check_data

        spec = None if ids is not None else DataSpec(kind="text", n_seqs=args.n_seqs, seq_len=args.seq_len,
                                                     path=args.text_file)
        if spec is not None:
            check_data(spec)
        from interp.loading import resolve
        from interp.models.checkpoint import read_config

        cfg = read_config(resolve(args.model))
        n = ids.shape[1] if ids is not None else args.seq_len
        if n > cfg.n_ctx:
            raise ValueError(f"sequences of {n} tokens are longer than this model's context (n_ctx={cfg.n_ctx}); "
                             f"use --seq-len {cfg.n_ctx} or shorter rows")
        for p in precisions:
            code_shape(p, cfg.head_dim)  # int4 with an odd d_head fails here, as the cache would
        if ids is not None and int(ids.max()) >= cfg.d_vocab:
            raise ValueError(f"{args.data_file} holds token id {int(ids.max())}, outside the vocabulary [0, {cfg.d_vocab})")
    except (ValueError, FileNotFoundError) as e:  # the settings: printed by interp.cli, as every user error
        from interp.models.errors import UserError

        raise UserError(str(e)) from e

    import time

    import torch

    import interp
    from interp.analyses.kv_study import run_study
    from interp.analyses.sweep_data import build_tokens

    start = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = interp.load(args.model, device=device)
    tokens = (ids if ids is not None else build_tokens(spec, model)).to(model.device)
    description = (f"{tokens.shape[0]} x {tokens.shape[1]} tokens from {args.data_file}" if ids is not None
                   else spec.describe())
    path = run_study(model, tokens, args.out, precisions=precisions, name=args.model, data_description=description,
                     seeds=tuple(range(args.seeds)), sensitivity_tokens=args.sensitivity_tokens,
                     progress_bar=False if args.no_progress else None)
    print(f"done in {time.perf_counter() - start:.0f} s; report: {path} (and report.md, kv*.parquet)")
    return 0
