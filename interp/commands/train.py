"""`interp train NAME`: reproduce a zoo run from its recipe (see `interp.models.zoo.recipes`)."""

from __future__ import annotations

HELP = "train a zoo model from scratch on the Python stdlib sources (deterministic for a seed and thread count)"
EPILOG = """examples:
  interp train attn-only-2l                          # the shipped run, into runs/attn-only-2l
  interp train attn-only-2l --out models/src/zoo/attn-only-2l   # regenerate the shipped checkpoints
  interp train rope-gqa-4l --seed 1 --out runs/rope-s1
  interp train attn-only-2l --steps 20 --out /tmp/quick      # a quick smoke run
  interp train --list
"""


def add_arguments(p) -> None:
    p.add_argument("name", nargs="?", help="a zoo recipe name (see --list)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=None, help="seed for init and data order (default: the recipe's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the recipe's; bitwise reproduction needs the same count)")
    p.add_argument("--out", default=None, help="run folder to write (default: runs/NAME)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per checkpoint)")
    p.add_argument("--list", action="store_true", help="list the recipes and exit")


def run(args) -> int:
    from interp.models.zoo.recipes import RECIPES, get_recipe

    if args.list or not args.name:
        for name, r in RECIPES.items():
            print(f"{name:16s} {r.model.n_params() / 1e6:.2f}M params, {r.steps} steps, batch {r.batch_size} x {r.model.n_ctx}, "
                  f"{len(r.checkpoint_steps())} checkpoints, seed {r.seed}, {r.threads} thread(s)")
            print(f"{'':16s} {r.description}")
        return 0 if args.list else 2
    from interp.analyses.store import OutputFolder
    from interp.errors import as_user_errors, check_int, check_threads
    from interp.models.zoo.training import CHECKPOINT_NAMING, RESUME_FILE, RUN_FILE, train

    with as_user_errors(ValueError, KeyError):
        recipe = get_recipe(args.name)
        steps = check_int("--steps", recipe.steps if args.steps is None else args.steps, minimum=1)
        check_int("--seed", recipe.seed if args.seed is None else args.seed, minimum=0)
        check_threads(recipe.threads if args.threads is None else args.threads)  # all before the folder is made
    out = args.out or f"runs/{recipe.name}"
    # Through the one output folder, as every command that writes: every file claimed in its manifest before it is
    # first written, never a file interp did not write, never through a link. A run folder interp's training wrote
    # before manifests existed (the zoo's shipped runs) is adopted.
    folder = OutputFolder(out, adopt=_run_folder_layout)
    names = [RUN_FILE, RUN_FILE.replace(".json", ".tmp"), RESUME_FILE, RESUME_FILE + ".tmp"]
    for step in recipe.checkpoint_steps(steps):
        names += [f"{CHECKPOINT_NAMING % step}/{f}" for f in (*CHECKPOINT_FILES, "model.safetensors.tmp")]
    with folder.writing():
        folder.claim(*names)
        train(recipe, out, steps=steps, seed=args.seed, threads=args.threads, progress=not args.no_progress)
    return 0


CHECKPOINT_FILES = ("config.json", "model.safetensors", "meta.json", "tokenizer.json")


def _run_folder_layout(folder) -> set[str] | None:
    """The files of its own layout a run folder interp's training wrote holds (run.json naming its step_XXXXX
    checkpoints, each checkpoint's files, resume.pt), or None for any other folder."""
    import json

    from interp.models.zoo.training import CHECKPOINT_NAMING, RESUME_FILE, RUN_FILE

    try:
        record = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("checkpoint_naming") != CHECKPOINT_NAMING or "recipe" not in record:
        return None
    paths = {RUN_FILE} | ({RESUME_FILE} if (folder / RESUME_FILE).is_file() else set())
    for d in folder.glob("step_" + "[0-9]" * 5):
        if d.is_dir() and not d.is_symlink():
            paths.add(f"{d.name}/")
            paths.update(f"{d.name}/{f}" for f in CHECKPOINT_FILES if (d / f).is_file())
    return paths
