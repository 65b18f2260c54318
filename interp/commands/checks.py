"""The study commands' checks, in one place: the options every study command shares, how they are
read, and `run_command`, which reads the model's config (no weights), checks the settings
(`Study.check`, pure) and the output folder, prints the notes (a default length fitted to the
model, in one line), and only then loads the model and runs the study (`interp.analyses.study.run`).

Every refusal is one line (a `UserError`, printed by `interp.cli`), before anything loads or is written.
Nothing heavy is imported at module level: `interp kv --help` must not import torch.
"""

from __future__ import annotations
from .choices import ROPE_SCALING_HELP


# ---- options ---------------------------------------------------------------------------------------
def add_text_data_options(p, title: str, n_seqs_help: str):
    """--data, --text-file, --n-seqs: the text a long-context study reads (`interp extrapolate`, `interp lengths`);
    the group, for a command's own data options."""
    d = p.add_argument_group(title)
    d.add_argument("--data", choices=("auto", "text", "corpus"), default="auto",
                   help="text (--text-file, default the Python Language Reference) or the zoo's held-out corpus; auto: "
                        "the corpus for byte-level zoo models, text otherwise")
    d.add_argument("--text-file", default=None, help="a UTF-8 text file (default: the Python Language Reference)")
    d.add_argument("--n-seqs", type=int, default=1, help=n_seqs_help)
    return d


def add_output_options(p) -> None:
    """--out, --force, --device, --rope-scaling, --no-progress: every study command's."""

    g = p.add_argument_group("output and machine (every study)")
    g.add_argument("--out", required=True,
                   help="output folder (created; a rerun of the same study replaces what interp wrote there; a folder "
                        "holding files interp did not write is refused)")
    g.add_argument("--force", action="store_true",
                   help="write over another study's or a sweep's results in --out (files interp did not write are "
                        "never touched)")
    g.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    add_offload_option(g)
    g.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR", help=ROPE_SCALING_HELP)
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_offload_option(p) -> None:
    """--offload and --device-map: every command that loads a model."""
    p.add_argument("--offload", choices=("disk", "cpu"), default=None,
                   help="run the model layer by layer past memory: its weights stay in the checkpoint's files (disk) or "
                        "in host memory (cpu), and each block is brought to --device for the whole batch, then released "
                        "(same numbers; gradients are refused; native models)")
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="split the blocks over several GPUs: auto (evenly, in contiguous runs, over the CUDA devices "
                        "torch sees) or LAYERS:DEVICE,... such as 0-15:cuda:0,16-31:cuda:1 (embed, ln_final, unembed "
                        "may be named too; what is left out follows the block before it); same numbers; native models; "
                        "not with --offload")


def placement_of(args):
    """Where the command loads the model: the `Placement` of --device, --offload and --device-map
    (`interp.models.placement.choice`), refused in one line when made (a device this machine lacks, a malformed
    map, a map beside an offload). A study's settings make the same value from the same options (`common`)."""
    from interp.models.placement.choice import Placement  # start-up time: imports torch

    return Placement(getattr(args, "device", None), args.offload, args.device_map)


def add_text_options(p, seq_len: int, what: str, n_seqs: bool = False) -> None:
    """The text a study reads: --text-file or --data-file, --seq-len (a default that is longer than the
    model's context is fitted to it), and --n-seqs when the study reads several sequences."""
    g = p.add_argument_group(f"data ({what})")
    g.add_argument("--text-file", default=None,
                   help="UTF-8 text (default: the Python Language Reference as interp ships it, pinned by sha256)")
    g.add_argument("--data-file", default=None, help="token ids (.npy or .pt), each row one sequence, no BOS added")
    g.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence of the text (default {seq_len}, or the model's context when shorter)")
    if n_seqs:
        g.add_argument("--n-seqs", type=int, default=1, help="sequences of the text (default 1)")


def add_prompt_options(p, lengths: str) -> None:
    """The retrieval prompts of `interp kv passkey` and `interp kv select`."""
    g = p.add_argument_group("retrieval prompts (kv passkey and kv select)")
    g.add_argument("--lengths", default=None,
                   help=f"prompt lengths in tokens (default {lengths}, each at most the model's context less the "
                        "answer)")
    g.add_argument("--depths", default="0.1,0.3,0.5,0.7", help="needle depths in [0, 1] (default 0.1,0.3,0.5,0.7)")
    g.add_argument("--prompts", type=int, default=2, help="prompts per (length, depth) (default 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default 0)")
    g.add_argument("--new-tokens", type=int, default=8, help="greedy tokens decoded per answer (default 8)")
    g.add_argument("--needle", action="store_true",
                   help="hide the key in real text (the Python Language Reference) instead of repeated filler")


# ---- reading them ------------------------------------------------------------------------------------
def numbers(text: str, kind, flag: str) -> list:
    """Comma-separated numbers of `kind`, each once: "1024,2048" -> [1024, 2048]; else one line naming `flag`."""
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


def names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def text_data(args, seq_len: int, *, rows: int | None = None):
    """The `StudyData` of --text-file / --data-file / --seq-len (/ --n-seqs): token ids as given (their
    first `rows` rows), or windows of the text; a --seq-len left out is the default `seq_len`, which
    `Study.check` fits to the model."""
    from interp.analyses.study import StudyData  # start-up time: imports torch
    from interp.analyses.data import DataSpec

    if args.data_file and args.text_file:
        raise ValueError("give --data-file (token ids) or --text-file (text), not both")
    if args.data_file:
        return StudyData.from_file(args.data_file, rows=rows)
    spec = DataSpec(kind="text", n_seqs=getattr(args, "n_seqs", 1), seq_len=seq_len if args.seq_len is None
                    else args.seq_len, path=args.text_file)
    return StudyData.of(spec, default_length=args.seq_len is None)


def data_kind(args, path: str) -> str:
    """The data kind of --data (auto, text, corpus) with --text-file: the text when one is given, refused in
    one line beside --data corpus (which reads the zoo's corpus, not the file), else `resolve_kind`'s choice
    for the model at `path`."""
    from interp.analyses.data import resolve_kind  # start-up time: imports torch

    if args.text_file and args.data == "corpus":
        raise ValueError(f"--data corpus reads the zoo's held-out corpus and --text-file {args.text_file} is other "
                         "text: give one of them (--data text, or auto, reads the file)")
    return "text" if args.text_file else resolve_kind(args.data, [path])


def prompt_settings(args) -> dict:
    """The `RetrievalSettings` fields of the prompt options."""
    return dict(lengths=None if args.lengths is None else tuple(numbers(args.lengths, int, "--lengths")),
                depths=tuple(numbers(args.depths, float, "--depths")), prompts=args.prompts, seed=args.seed,
                variant="needle" if args.needle else "passkey", max_new_tokens=args.new_tokens)


def common(args) -> dict:
    """The `StudySettings` fields every study command reads the same way (device, offload and device_map are
    checked as one `Placement` when the settings are made: `StudySettings.placement`)."""
    return dict(model=args.model, device=args.device, offload=args.offload, device_map=args.device_map,
                progress=False if args.no_progress else None)


# ---- running -----------------------------------------------------------------------------------------
def run_command(study, args, settings, *, path=None) -> int:
    """Check, then load and run. `settings` (a function of no arguments, so that its own checks raise
    inside the checks) builds the study's settings; `path`: the checkpoint to load (default: the one
    `args.model` names). `--rope-scaling` is checked against the model's config with the rest, and the
    model loads with it (`interp.load(rope_scaling=)`; the study records what the model ran with)."""
    import time

    from interp.analyses.study import check_folder, run
    from interp.errors import as_user_errors
    from interp.models.formats.checkpoint import check_placement, read_config, rope_scaling_for
    from interp.models.rope.choice import rope_spec

    with as_user_errors(ValueError, FileNotFoundError, ImportError):
        rope = None if args.rope_scaling is None else rope_spec(args.rope_scaling)  # the spelling, before any name
        settings = settings()
        if path is None:
            from interp.loading import resolve  # start-up time: --help and argument errors never import torch

            target = resolve(args.model)
        else:
            target = str(path)
        cfg = read_config(target)
        placement = settings.placement  # made (and checked) with the settings: --device, --offload, --device-map
        check_placement(target, placement, cfg=cfg)
        if rope is not None:
            rope_scaling_for(target, rope, cfg=cfg)
        settings, notes = study.check(cfg, settings)
        why = ("reads interp's KV cache, which holds every layer on one device" if study.uses_kv_cache(settings)
               else study.one_device)
        if why is not None:
            placement.refuse_split(cfg, f"interp {study.name} {why}")
        check_folder(study, args.out, force=args.force)

    import interp  # start-up time: --help and argument errors never import torch

    for note in notes:
        print(note)
    start = time.perf_counter()
    # the checkpoint the checks read (a name resolved once, above: a Hub name is not looked up again), under the
    # name the user gave
    model = interp.load(target, rope_scaling=rope, **placement.resolved().keywords())
    model.loaded_as(args.model if path is None else str(path))
    report = run(study, model, args.out, settings, force=args.force)
    print(f"done in {time.perf_counter() - start:.0f} s; report: {report} (and {study.files()})")
    return 0
