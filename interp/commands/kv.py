"""`interp kv precision|passkey|select MODEL --out DIR`: the KV-cache studies, one subcommand each; `interp kv static
MODEL`: the static retrieval score of every head, from the weights alone (printed; no folder, no forward pass).

precision: what quantized KV caches do to a model, head by head, and a per-head mixed-precision cache
chosen by the analysis (`interp.analyses.kv.precision_study`); passkey: what cache policies (KIVI,
StreamingLLM, H2O, SnapKV, ...) cost in long-context retrieval, perplexity and bytes
(`interp.analyses.kv.policies`); select: head roles (retrieval, RazorAttention, streaming loss,
DuoAttention's gates) compiled into cache policies at equal shares of the KV heads kept full
(`interp.analyses.kv.roles_study`); static: each head's share of query-key kernel energy on RoPE's low
frequencies and its effective rank (`interp.analyses.kv.static_scores`), with `--compare LENGTH` against the
retrieval score `select` measures. The checks are `interp.commands.checks`'.
"""

from __future__ import annotations

from . import checks
from .choices import GATE_STEPS, KV_POLICIES, KV_POLICY_FORMS, KV_PRECISIONS, LOSS_TOKENS

HELP = ("KV-cache studies: precisions head by head (precision), cache policies on retrieval (passkey), head roles "
        "(select); retrieval heads from the weights alone (static)")
EPILOG = """examples:
  interp kv precision smollm2-135m --out out/kv                      # real text (the Python Language Reference), 2048 tokens
  interp kv precision smollm2-135m --out out/kv --precisions fp32,fp16,int8,int4
  interp kv precision attn-only-2l --out out/kv-zoo --seq-len 256
  interp kv precision smollm2-135m --out out/kv --data-file ids.npy  # token ids, one sequence per row, used as they are
  interp kv passkey smollm2-135m --out out/kv-passkey
  interp kv passkey smollm2-135m --policies 'full,kivi4,streaming(4,128)' --lengths 1024 --prompts 5 --out DIR
  interp kv passkey smollm2-135m --needle --out out/kv-needle         # the key hidden in real text, not filler
  interp kv passkey smollm2-135m --policies 'h2o(132),h2o(132)+protect(10%),random(132)+protect(4,9)' --out DIR
  interp kv passkey gemma3-270m --lengths 4096,32760 --policies 'full,window' --prompts 1 --out out/kv-long
  interp kv select smollm2-135m --rankings retrieval,razor,loss,gates,random --out out/kv-roles
  interp kv select smollm2-135m --equal-bytes 'h2o+protect(10%)' --out DIR  # against a protected policy
  interp kv static gemma3-270m                                        # seconds, no forward pass: the top 20 heads
  interp kv static smollm2-135m --compare 1024                        # and against the measured retrieval score

precision writes kv.parquet, kv_heads.parquet, kv_mixed.parquet, kv_sensitivity.parquet; passkey writes
kv_policies.parquet (policy, selection, tokens_per_head, full_fraction, seed, length, depth, correct, n, accuracy,
perplexity, bytes_per_token) and kv_passkey_answers.parquet; select writes those and kv_head_roles.parquet; each
writes settings.json, report.html and report.md (CSV instead of parquet where pyarrow is missing); static prints
its table and writes nothing.
"""

STUDIES = ("precision", "passkey", "select")
STATIC_HELP = ("retrieval heads from the weights alone: each head's share of query-key kernel energy on RoPE's low "
               "frequencies and its effective rank, in seconds, no forward pass (printed)")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="kv_study", metavar="STUDY")
    for name, (add, help_) in {"precision": (add_precision, "quantized KV caches, head by head, and a mixed-precision "
                                                             "cache chosen by the analysis"),
                               "passkey": (add_passkey, "cache policies on passkey (or needle) retrieval, perplexity "
                                                        "and bytes"),
                               "select": (add_select, "head roles compiled into cache policies: which KV heads to keep "
                                                      "full"),
                               "static": (add_static, STATIC_HELP)}.items():
        q = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG,
                           formatter_class=p.formatter_class)
        q.add_argument("model", help="a real-model name, .gguf file, checkpoint folder, zoo name or Hugging Face repo id")
        add(q)
        if name in STUDIES:
            checks.add_output_options(q)
    p.set_defaults(_kv_help=p.print_help)


def add_precision(p) -> None:

    g = p.add_argument_group("the precision study")
    g.add_argument("--precisions", default="fp32,int8,fp8,int4",
                   help=f"comma-separated, from {','.join(KV_PRECISIONS)} (default fp32,int8,fp8,int4)")
    g.add_argument("--seeds", type=int, default=3, help="random selections per k (default 3)")
    g.add_argument("--sensitivity-tokens", type=int, default=1024,
                   help="tokens per sequence for the per-KV-head loss and gradient rankings (default 1024)")
    checks.add_text_options(p, 2048, "the text every cache reads", n_seqs=True)


def add_passkey(p) -> None:

    g = p.add_argument_group("the policy study")
    g.add_argument("--policies", default=KV_POLICIES,
                   help=f"comma-separated, from {', '.join(KV_POLICY_FORMS)} (quote the parentheses in a shell; each "
                        f"policy's class says what it keeps); default {KV_POLICIES}, plus 'window' on a model with "
                        "sliding-window layers: each layer keeps only its own window. An eviction policy (h2o, snapkv, "
                        "knorm, tova, random(budget)) takes boundary protection after '+': h2o(132)+protect(4,9) never "
                        "evicts the first 4 and last 9 tokens, h2o(132)+protect(10%%) splits 10%% of the budget between "
                        "them (a third first), inside the same budget")
    checks.add_prompt_options(p, "1024,2048")
    checks.add_text_options(p, 2048, "the perplexity text")


def add_select(p) -> None:

    g = p.add_argument_group("the head-roles selection")
    g.add_argument("--rankings", default="retrieval,razor,loss,gates,random",
                   help="head-role rankings to compare, from retrieval,razor,loss,gates,static,random (top-k KV heads "
                        "full, the rest streaming(--sinks,--window); static: from the weights alone, `kv static`; "
                        "default retrieval,razor,loss,gates,random)")
    g.add_argument("--fractions", default="0.1,0.25,0.5", help="fractions of the KV heads kept full (default 0.1,0.25,0.5)")
    g.add_argument("--sinks", type=int, default=4, help="sink tokens of the streaming heads (default 4)")
    g.add_argument("--window", type=int, default=128, help="window of the streaming heads (default 128)")
    g.add_argument("--selection-seeds", type=int, default=3, help="random selections per fraction (default 3)")
    g.add_argument("--scoring-prompts", type=int, default=6,
                   help="prompts that score retrieval heads (keys from another seed; default 6)")
    g.add_argument("--gate-steps", type=int, default=GATE_STEPS,
                   help=f"seeded steps of DuoAttention gate training, the same gates on any machine (default "
                        f"{GATE_STEPS}: about 2 minutes for SmolLM2-135M on 2 CPU cores)")
    g.add_argument("--gate-seconds", type=float, default=None,
                   help="a time cap on gate training (default none); when it stops training early the report says "
                        "so, and the gates then depend on the machine's speed")
    g.add_argument("--equal-bytes", default="snapkv", metavar="POLICY",
                   help="the policy every head runs at each selection's bytes per token, for comparison: snapkv, h2o, "
                        "knorm, tova or random, with any boundary protection, e.g. 'h2o+protect(10%%)' (default "
                        "snapkv; 'none': no comparison)")
    g.add_argument("--loss-tokens", type=int, default=LOSS_TOKENS,
                   help=f"the streaming-loss ranking reads the perplexity text's first this many tokens (default "
                        f"{LOSS_TOKENS}; more text, other heads: docs/kv_cache.md, head roles)")
    checks.add_prompt_options(p, "1024")
    checks.add_text_options(p, 2048, "the perplexity text")


def add_static(p) -> None:

    g = p.add_argument_group("the static score")
    g.add_argument("--cut", type=int, default=None,
                   help="a rotary plane is low-frequency when its wavelength 2 pi / theta exceeds this many tokens "
                        "(default: the model's trained context, n_ctx)")
    g.add_argument("--top", type=int, default=20, help="heads printed, highest score first (default 20; 0: every head)")
    g.add_argument("--compare", type=int, default=None, metavar="LENGTH",
                   help="also measure Wu et al.'s retrieval score as `kv select` does, on passkey prompts of LENGTH "
                        "tokens (a forward pass per prompt), and print Spearman's rho and the top-10 overlap")
    g.add_argument("--scoring-prompts", type=int, default=6, help="prompts that score retrieval with --compare (default 6)")
    g.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    checks.add_offload_option(g)


def run(args) -> int:
    study = getattr(args, "kv_study", None)
    if study is None:
        args._kv_help()
        return 0
    return {"precision": run_precision, "passkey": run_passkey, "select": run_select, "static": run_static}[study](args)


def run_precision(args) -> int:
    from interp.analyses.kv.precision_study import PrecisionSettings, PrecisionStudy  # start-up time: torch

    def settings():
        return PrecisionSettings(**checks.common(args), data=checks.text_data(args, 2048),
                                 precisions=checks.names(args.precisions), seeds=tuple(range(args.seeds)),
                                 sensitivity_tokens=args.sensitivity_tokens)

    return checks.run_command(PrecisionStudy(), args, settings)


def run_passkey(args) -> int:
    from interp.analyses.kv.policies import PolicySettings, PolicyStudy  # start-up time: torch

    def settings():
        return PolicySettings(**checks.common(args), **checks.prompt_settings(args),
                              data=checks.text_data(args, 2048, rows=1), policies=args.policies)

    return checks.run_command(PolicyStudy(), args, settings)


def run_select(args) -> int:
    from interp.analyses.kv.roles_study import RolesSettings, RolesStudy  # start-up time: torch

    def settings():
        from interp.errors import check_int

        check_int("--selection-seeds", args.selection_seeds, minimum=1)
        return RolesSettings(**checks.common(args), **checks.prompt_settings(args),
                             data=checks.text_data(args, 2048, rows=1), selections=checks.names(args.rankings),
                             fractions=tuple(checks.numbers(args.fractions, float, "--fractions")),
                             selection_seeds=tuple(range(args.selection_seeds)), sinks=args.sinks, window=args.window,
                             n_scoring=args.scoring_prompts, gate_steps=args.gate_steps, gate_seconds=args.gate_seconds,
                             loss_tokens=args.loss_tokens,
                             equal_bytes=None if args.equal_bytes.strip().lower() == "none" else args.equal_bytes)

    return checks.run_command(RolesStudy(), args, settings)


def run_static(args) -> int:
    import time

    from interp.errors import as_user_errors, check_int

    check_int("--top", args.top, minimum=0)
    check_int("--scoring-prompts", args.scoring_prompts, minimum=1)
    for flag, value in (("--cut", args.cut), ("--compare", args.compare)):
        if value is not None:
            check_int(flag, value, minimum=1)
    from interp.analyses.kv.roles_study import static_report  # start-up time: torch
    from interp.analyses.kv.static_scores import check_rotary
    from interp.loading import resolve
    from interp.models.formats.checkpoint import read_config

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        target = resolve(args.model)
        cfg = read_config(target)
        check_rotary(cfg)  # before loading: a model without RoPE is one line
        if args.compare is not None:
            check_int("--compare", args.compare, maximum=cfg.n_ctx, hint="passkey prompts within the model's context")
        placement = checks.placement_of(args)
    import interp

    start = time.perf_counter()
    model = interp.load(target, **placement.resolved().keywords())
    model.loaded_as(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s")
    print(static_report(model, cut=args.cut, top=args.top, compare=args.compare, n_scoring=args.scoring_prompts))
    return 0
