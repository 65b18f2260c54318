"""`interp kv MODEL --out DIR`: what quantized KV caches do to a model, head by head, and a per-head
mixed-precision cache chosen by the analysis; with `--task passkey` (or `needle`), what per-head cache
policies (streaming, KIVI, H2O, SnapKV) cost in long-context retrieval, perplexity and bytes."""

from __future__ import annotations

HELP = "KV-cache study: precisions head by head, or cache policies on passkey retrieval (--task passkey)"
EPILOG = """examples:
  interp kv smollm2-135m --out out/kv                      # real text (the Python Language Reference), 2048 tokens
  interp kv smollm2-135m --out out/kv --precisions fp32,fp16,int8,int4
  interp kv attn-only-2l --out out/kv-zoo --seq-len 256
  interp kv smollm2-135m --out out/kv --data-file ids.npy  # token ids, one sequence per row, used as they are
  interp kv smollm2-135m --task passkey --out out/kv-passkey
  interp kv smollm2-135m --task passkey --policies 'full,kivi4,streaming(4,128)' --lengths 1024 --prompts 5 --out DIR
  interp kv smollm2-135m --task needle --out out/kv-needle   # the key hidden in real text, not filler
  interp kv gemma3-270m --task passkey --lengths 4096,32760 --policies 'full,window' --prompts 1 --out out/kv-long

--task precisions (default) writes kv.parquet, kv_heads.parquet, kv_mixed.parquet, kv_sensitivity.parquet;
--task passkey / needle writes kv_policies.parquet (policy, selection, budget, seed, length, depth, correct, n,
accuracy, perplexity, bytes_per_token) and kv_passkey_answers.parquet; both write report.html and report.md.
Policies: full, fp16, bf16, int8, fp8, int4, kivi4, kivi2, kivi4(G,R), streaming(S,W), h2o(B), h2o(B,R),
snapkv(B), snapkv(B,W,K) (quote the parentheses in a shell).
"""


def add_arguments(p) -> None:
    from .choices import KV_PRECISIONS

    p.add_argument("model", help="a real-model name, .gguf file, checkpoint folder, zoo name or Hugging Face repo id")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--precisions", default="fp32,int8,fp8,int4",
                   help=f"comma-separated, from {','.join(KV_PRECISIONS)} (default fp32,int8,fp8,int4)")
    p.add_argument("--text-file", default=None,
                   help="UTF-8 text (default: the Python Language Reference as interp ships it, pinned by sha256)")
    p.add_argument("--data-file", default=None, help="token ids (.npy or .pt), each row one sequence, no BOS added")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence of the default text (default 2048)")
    p.add_argument("--n-seqs", type=int, default=1, help="sequences of the default text (default 1)")
    p.add_argument("--sensitivity-tokens", type=int, default=1024,
                   help="tokens per sequence for the per-KV-head loss and gradient rankings (default 1024)")
    p.add_argument("--seeds", type=int, default=3, help="random selections per k (default 3)")
    from .choices import KV_POLICIES, KV_TASKS

    p.add_argument("--task", default="precisions", choices=KV_TASKS,
                   help="precisions: the quantization study (default); passkey / needle: cache policies on retrieval")
    p.add_argument("--policies", default=KV_POLICIES,
                   help=f"with --task passkey/needle: comma-separated (default {KV_POLICIES}, plus 'window' on a "
                        "model with sliding-window layers: each layer keeps only its own window)")
    p.add_argument("--lengths", default=None,
                   help="with --task: prompt lengths in tokens (default 1024,2048; with --select 1024)")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7", help="with --task: needle depths in [0, 1] (default 0.1,0.3,0.5,0.7)")
    p.add_argument("--prompts", type=int, default=2, help="with --task: prompts per (length, depth) (default 2)")
    p.add_argument("--seed", type=int, default=0, help="with --task: seed of the pass keys (default 0)")
    p.add_argument("--new-tokens", type=int, default=8, help="with --task: greedy tokens decoded per answer (default 8)")
    p.add_argument("--select", default=None,
                   help="with --task: head-role selections to compare, from retrieval,razor,loss,gates,random "
                        "(top-k KV heads full, the rest streaming(--sinks,--window))")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="with --select: fractions of the KV heads kept full")
    p.add_argument("--sinks", type=int, default=4, help="with --select: sink tokens of the streaming heads (default 4)")
    p.add_argument("--window", type=int, default=128, help="with --select: window of the streaming heads (default 128)")
    p.add_argument("--selection-seeds", type=int, default=3, help="with --select: random selections per budget (default 3)")
    p.add_argument("--scoring-prompts", type=int, default=6,
                   help="with --select: prompts that score retrieval heads (keys from another seed; default 6)")
    from .choices import GATE_STEPS

    p.add_argument("--gate-steps", type=int, default=GATE_STEPS,
                   help=f"with --select gates: seeded steps of DuoAttention gate training, the same gates on any "
                        f"machine (default {GATE_STEPS}: about 2 minutes for SmolLM2-135M on 2 CPU cores)")
    p.add_argument("--gate-seconds", type=float, default=None,
                   help="with --select gates: a time cap on gate training (default none); when it stops training "
                        "early the report says so, and the gates then depend on the machine's speed")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _source(spec, data_file: str | None) -> dict | None:
    """The study's data named by sha256: the text `spec` reads, or the token file."""
    from interp.analyses.sweep_data import DataSpec, data_source

    return data_source(spec if spec is not None else DataSpec(kind="file", path=data_file))


def _data_file(path: str):
    """Token ids as given: [n_seqs, seq_len] (a flat file is one sequence)."""
    from interp.analyses.sweep_data import read_token_file

    ids = read_token_file(path)
    return ids.reshape(1, -1) if ids.dim() == 1 else ids


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{flag} repeats {', '.join(map(str, repeated))}: give each value once")
    return values


def run(args) -> int:
    if args.task != "precisions":
        return _run_policies(args)

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
        source = _source(spec, args.data_file)
        from interp.loading import resolve
        from interp.models.formats.checkpoint import read_config

        cfg = read_config(resolve(args.model))
        n = ids.shape[1] if ids is not None else args.seq_len
        if n > cfg.n_ctx:
            raise ValueError(f"sequences of {n} tokens are longer than this model's context (n_ctx={cfg.n_ctx}); "
                             f"use --seq-len {cfg.n_ctx} or shorter rows")
        for p in precisions:
            code_shape(p, cfg.head_dim)  # int4 with an odd d_head fails here, as the cache would
        if ids is not None and int(ids.max()) >= cfg.d_vocab:
            raise ValueError(f"{args.data_file} holds token id {int(ids.max())}, outside the vocabulary [0, {cfg.d_vocab})")
        from interp.analyses.store import OutputFolder

        OutputFolder(args.out).check()  # a folder holding files interp did not write: refused before loading
    except (ValueError, FileNotFoundError) as e:  # the settings: printed by interp.cli, as every user error
        from interp.models.errors import UserError

        raise UserError(str(e)) from e

    import time

    import interp
    from interp.analyses.kv.precision_study import run_study
    from interp.models.device import resolve_device
    from interp.analyses.sweep_data import build_tokens

    start = time.perf_counter()
    model = interp.load(args.model, device=resolve_device(args.device))  # an unknown device: one line, before loading
    tokens = (ids if ids is not None else build_tokens(spec, model)).to(model.device)
    description = (f"{tokens.shape[0]} x {tokens.shape[1]} tokens from {args.data_file}" if ids is not None
                   else spec.describe())
    path = run_study(model, tokens, args.out, precisions=precisions, name=args.model, data_description=description,
                     seeds=tuple(range(args.seeds)), sensitivity_tokens=args.sensitivity_tokens,
                     progress_bar=False if args.no_progress else None, data_source=source)
    print(f"done in {time.perf_counter() - start:.0f} s; report: {path} (and report.md, kv*.parquet)")
    return 0


def _run_policies(args) -> int:
    """interp kv MODEL --task passkey|needle: every setting checked before the model loads."""
    from interp.models.errors import as_user_errors

    with as_user_errors(ValueError, FileNotFoundError):
        from interp.analyses.kv.policies import PolicyRun, policy_runs
        from .choices import KV_POLICIES
        from interp.models.kv.policies import WINDOW
        from interp.analyses.sweep_data import DataSpec, check_data
        from interp.analyses.store import OutputFolder
        from interp.loading import resolve
        from interp.models.formats.checkpoint import read_config
        from interp.models.errors import check_int

        runs = policy_runs(args.policies)
        lengths = _numbers(args.lengths or ("1024" if args.select else "1024,2048"), int, "--lengths")
        selections = fractions = None
        if args.select:
            from interp.analyses.kv.roles import check_selection

            selections = [s.strip() for s in args.select.split(",") if s.strip()]
            fractions = _numbers(args.fractions, float, "--fractions")
            check_int("--selection-seeds", args.selection_seeds, minimum=1)
            check_int("--scoring-prompts", args.scoring_prompts, minimum=1)
            check_int("--gate-steps", args.gate_steps, minimum=1)
            if args.gate_seconds is not None:
                from interp.models.errors import check_real

                check_real("--gate-seconds", args.gate_seconds, minimum=0.0, strict=True)
            check_selection(selections, fractions, 10**9)  # names and (0, 1]; k checked with the model's heads
            from interp.models.kv.policies import Streaming

            runs = [PolicyRun("streaming", Streaming(args.sinks, args.window))]  # checked against the lengths below
        depths = _numbers(args.depths, float, "--depths")
        for depth in depths:  # nan fails both comparisons
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"--depths {depth:g}: a depth is the fraction of the filler before the needle, "
                                 "between 0 (the start) and 1 (right before the question)")
        check_int("--prompts", args.prompts, minimum=1)
        check_int("--new-tokens", args.new_tokens, minimum=1)
        check_int("--seed", args.seed, minimum=0)
        if args.data_file and args.text_file:
            raise ValueError("give --data-file (token ids) or --text-file (text), not both")
        ids = _data_file(args.data_file) if args.data_file else None
        spec = None if ids is not None else DataSpec(kind="text", n_seqs=1, seq_len=args.seq_len, path=args.text_file)
        if spec is not None:
            check_data(spec)
        source = _source(spec, args.data_file)
        cfg = read_config(resolve(args.model))
        if selections:
            check_selection(selections, fractions, cfg.n_layers * cfg.kv_heads)
        for length in lengths:
            if not 1 <= length <= cfg.n_ctx - args.new_tokens:
                raise ValueError(f"--lengths {length}: prompts plus {args.new_tokens} answer tokens must fit this model's "
                                 f"context (n_ctx={cfg.n_ctx}): use lengths up to {cfg.n_ctx - args.new_tokens}")
        from interp.models.device import resolve_device
        from interp.models.memory import check_fits

        check_fits(cfg, 1, max(lengths) + args.new_tokens, resolve_device(args.device), what="--lengths")
        n_text = ids.shape[1] if ids is not None else args.seq_len
        if n_text > cfg.n_ctx:
            where = f"{args.data_file}'s rows" if ids is not None else "--seq-len"
            raise ValueError(f"the perplexity text of {n_text} tokens ({where}) is longer than this model's context "
                             f"(n_ctx={cfg.n_ctx}); use --seq-len {cfg.n_ctx} or shorter rows")
        if ids is not None and int(ids[:1].max()) >= cfg.d_vocab:
            raise ValueError(f"{args.data_file} holds token id {int(ids[:1].max())}, outside the vocabulary "
                             f"[0, {cfg.d_vocab})")
        if args.policies == KV_POLICIES and not args.select and any(w is not None for w in cfg.windows()):
            runs.insert(1, PolicyRun(WINDOW, WINDOW))  # a windowed model (Gemma): the cache its layers ask for
        for run in runs:  # a window or budget beyond the shortest prompt or the text is refused here
            for max_len in (min(lengths) + args.new_tokens, n_text):
                run.grid_for(cfg, max_len)
        if selections:  # SnapKV at the selections' bytes: its budget must fit the perplexity text too
            from interp.analyses.kv.roles import equal_bytes_budget

            need = max(equal_bytes_budget(f, n, args.sinks, args.window) for f in fractions for n in lengths)
            if need > n_text:
                raise ValueError(f"--select compares SnapKV at the selections' bytes, {need} tokens per head at the "
                                 f"longest length and largest fraction, more than the {n_text}-token perplexity text "
                                 f"holds: pass --seq-len {need} or more, or shorter --lengths or smaller --fractions")
        OutputFolder(args.out).check()

    import time

    import interp
    from interp.analyses.kv.policies import run_policy_study
    from interp.models.device import resolve_device
    from interp.analyses.sweep_data import build_tokens
    from interp.analyses.kv.tasks import retrieval_prompts

    start = time.perf_counter()
    model = interp.load(args.model, device=resolve_device(args.device))  # an unknown device: one line, before loading
    with as_user_errors(ValueError):
        prompts = retrieval_prompts(model, lengths, depths, args.prompts, args.seed, variant=args.task)
    tokens = (ids[:1] if ids is not None else build_tokens(spec, model)).to(model.device)
    description = (f"{tokens.shape[1]} tokens from {args.data_file}" if ids is not None else spec.describe())
    if selections:
        from interp.analyses.kv.roles_study import run_roles_study

        path = run_roles_study(model, args.out, prompts=prompts, text_tokens=tokens, selections=selections,
                               fractions=fractions, seeds=tuple(range(args.selection_seeds)), sinks=args.sinks,
                               window=args.window, n_scoring=args.scoring_prompts, seed=args.seed,
                               gate_seconds=args.gate_seconds, gate_steps=args.gate_steps, name=args.model,
                               data_description=description, max_new_tokens=args.new_tokens,
                               progress_bar=False if args.no_progress else None, data_source=source)
        print(f"done in {time.perf_counter() - start:.0f} s; report: {path} (and report.md, kv_policies.parquet, "
              "kv_head_roles.parquet)")
        return 0
    path = run_policy_study(model, args.out, runs=runs, prompts=prompts, text_tokens=tokens, name=args.model,
                            data_description=description, max_new_tokens=args.new_tokens,
                            progress_bar=False if args.no_progress else None, data_source=source)
    print(f"done in {time.perf_counter() - start:.0f} s; report: {path} (and report.md, kv_policies.parquet)")
    return 0
