"""Names the CLI's help and argument parsing need, without importing torch, pandas or the analyses.

`interp --help` and every subcommand's `--help` must answer in well under a second, and importing
torch alone takes about one. So the few names a parser shows (analysis names and defaults, data
kinds and sizes, executors, benchmark sections) are restated here, and `tests/interp/test_cli.py` checks
that every one equals its definition (`interp.analyses.atlas.registry`, `interp.analyses.atlas.sweep`, ...):
change one there and that test says what to update here.
"""

ANALYSES = ("ablation", "composition", "duplicate_token", "importance", "induction", "loss", "previous_token",
            "pruning", "retrieval", "sinks", "streaming", "viewer")  # interp.analyses.atlas.registry.ANALYSES, sorted
DEFAULT_ANALYSES = ("induction", "previous_token", "duplicate_token", "sinks", "viewer", "streaming", "composition",
                    "ablation", "pruning", "importance")  # interp.analyses.atlas.sweep.DEFAULT_ANALYSES
ATLAS_ANALYSES = ("induction", "previous_token", "duplicate_token", "sinks", "viewer", "streaming", "composition",
                  "pruning")  # interp.analyses.atlas.sweep.ATLAS_ANALYSES
DATA_KINDS = ("auto", "repeated_random", "corpus", "file", "text")  # interp.analyses.data.DATA_KINDS
DATA_N_SEQS, DATA_SEQ_LEN, DATA_SEED = 16, 256, 0  # interp.analyses.data.DataSpec()
EXECUTOR_KINDS = ("local", "ray")  # interp.analyses.atlas.executors.EXECUTOR_KINDS
BENCH_SECTIONS = ("forward", "cache", "long_context", "ablation", "generation", "patching", "real_model",
                  "gemma3", "scale", "head_scan", "kv_cache", "kv_policies", "window_bands", "stats_kernel", "wrapped",
                  "atlas", "saes", "gpu")  # interp.benchmarks.suite.ALL
KV_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4")  # interp.kernels.kv_quant.PRECISIONS
KV_POLICIES = "full,kivi4,kivi2,streaming(4,128),h2o(132),snapkv(132),knorm(132),tova(132)"  # interp.analyses.kv.policies.DEFAULT_POLICIES
KV_POLICY_FORMS = ("full", "fp32", "fp16", "bf16", "int8", "fp8", "int4", "kivi4", "kivi2", "streaming(sinks,window)",
                   "h2o(budget)", "snapkv(budget)", "knorm(budget)", "tova(budget)", "random(budget)")  # interp.models.kv.policies.policy_names()
GATE_STEPS = 32  # interp.analyses.kv.roles_study.GATE_STEPS
LOSS_TOKENS = 1024  # interp.analyses.kv.roles_study.LOSS_TOKENS
ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "llama3", "longrope")  # interp.models.rope.choice.ROPE_TYPES
ROPE_SCALING_HELP = ("run a rotary model with this RoPE scaling in place of its own, as TYPE:FACTOR[:ORIGINAL_LEN] "
                     "(e.g. yarn:2, or yarn:2:4096; the original length defaults to the model's trained context), "
                     "TYPE one of linear, dynamic, ntk, yarn, llama3, or default for plain RoPE; recorded in "
                     "settings.json and the report")
EXTRAPOLATE_SCALINGS = ("none", "linear", "ntk", "yarn")  # interp.analyses.extrapolation.extrapolate.SCALINGS
EXTRAPOLATE_FACTOR = 2.0  # interp.analyses.extrapolation.extrapolate.FACTOR
EXTRAPOLATE_DEPTHS = (0.25, 0.75)  # interp.analyses.extrapolation.extrapolate.DEPTHS
EXTRAPOLATE_REPAIR_FRACTION = 0.2  # interp.analyses.extrapolation.extrapolate.REPAIR_FRACTION
