"""`interp zoo`: the shipped runs, their checkpoints, sizes and the scores logged while training."""

from __future__ import annotations

HELP = "list the models shipped with interp (load one with interp.load(NAME) or NAME/step_XXXXX)"
EPILOG = """examples:
  interp zoo
  interp zoo attn-only-2l          # every checkpoint with its logged loss / ICL / head scores
"""


def add_arguments(p) -> None:
    p.add_argument("name", nargs="?", help="show one run's checkpoints")


def run(args) -> int:
    import json

    from interp.models.zoo import list_runs

    runs = list_runs()
    if args.name:
        runs = [r for r in runs if r.name == args.name]
        if not runs:
            print(f"no zoo run {args.name!r}; shipped: {[r.name for r in list_runs()]}")
            return 1
    for info in runs:
        cfg = json.loads((info.last / "config.json").read_text())["config"]
        from interp.models.config import ModelConfig

        n_params = ModelConfig.from_dict(cfg).n_params()
        steps = info.steps
        secs = info.run.get("train_seconds")
        print(f"{info.name:16s} {n_params / 1e6:.2f}M params  {len(steps)} checkpoints (steps {steps[0]}..{steps[-1]})  "
              f"{info.size_bytes() / 1e6:.1f} MB  trained {secs:.0f} s on {info.run.get('threads')} thread(s)"
              if secs is not None else f"{info.name:16s} {n_params / 1e6:.2f}M params  {len(steps)} checkpoints (in progress)")
        if args.name:
            print(f"  {'checkpoint':12s} {'loss':>7s} {'eval':>7s} {'icl':>7s} {'induct':>7s} {'prev':>7s}")
            for p in info.checkpoints:
                m = json.loads((p / "meta.json").read_text())
                print(f"  {p.name:12s} {m['loss']:7.3f} {m['eval_loss']:7.3f} {m['icl']:7.3f} "
                      f"{m['induction']:7.3f} {m['previous']:7.3f}")
            print("  induct: best head outside layer 0, prev: best layer-0 head (repeated random bytes); "
                  "icl: loss at the last token minus loss at token 50")
    return 0
