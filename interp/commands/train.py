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
    from interp.models.zoo.training import train

    recipe = get_recipe(args.name)
    out = args.out or f"runs/{recipe.name}"
    train(recipe, out, steps=args.steps, seed=args.seed, threads=args.threads, progress=not args.no_progress)
    return 0
