"""Are a run's checkpoints what their steps say? A fingerprint of each checkpoint's weights, taken by the
sweep right after loading it, and what the fingerprints of a run say together.

In Pythia's published checkpoints 86 of 154 pythia-2.8b branches serve final-era weights (pythia#205):
a sweep over them draws a phase change that never happened. Two facts catch it:

- identical weights: checkpoints whose tensors are byte for byte the same (a hash over every tensor's
  name, shape, dtype and bytes, in name order: `weights`);
- a step out of place: a checkpoint whose weights are much closer to a later step's than to either of
  its neighbours' (distance between `sketch`es: a fixed sample of every floating tensor, the same
  positions in every checkpoint of the same shapes; closer means less than half the nearer neighbour's
  distance, so independent random weights, all about equally far apart, are never flagged).

The fingerprints are kept in the results (`fingerprints/<run>/<checkpoint>.json`, merged into
fingerprints.csv), named in the sweep's last lines and in the report's "Checkpoint integrity" section.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from interp.models.device import to_numpy
from interp.models.offload import named_weights

SKETCH = 2048  # sampled values per checkpoint, spread over its tensors
FAR = 0.5  # a later step "closer" than this fraction of the nearer neighbour's distance is out of place


def fingerprint(model) -> dict:
    """{"weights": a hash of every tensor of `model`'s state dict, "sketch": SKETCH sampled values}."""
    names = list(model.state_dict())
    per = max(1, SKETCH // max(1, len(names)))
    h = hashlib.blake2b(digest_size=16)
    sketch: list[float] = []
    for name, t in named_weights(model):  # sorted; an offloaded model's one unit at a time
        t = t.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        flat = t.reshape(-1).contiguous()
        if flat.numel():
            h.update(memoryview(to_numpy(flat.view(torch.uint8))))  # one tensor on the host at a time, not copied again
        if flat.is_floating_point() and flat.numel():
            k = min(per, flat.numel())  # evenly spaced, in integers: float32 cannot name every index of a big tensor
            index = torch.arange(k, device=flat.device, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)
            sketch += to_numpy(flat[index], np.float64).tolist()
    return {"weights": h.hexdigest(), "sketch": sketch}


def _distance(a, b) -> float | None:
    if len(a) != len(b) or not len(a):
        return None  # other shapes: not comparable
    return float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)))


def identical(prints: list[dict]) -> list[list[dict]]:
    """Groups (two or more) of one run's checkpoints with byte-identical weights, in step order."""
    groups: dict[tuple, list[dict]] = {}
    for p in prints:
        groups.setdefault((p["run"], p["weights"]), []).append(p)
    return [sorted(g, key=_order) for g in groups.values() if len(g) > 1]


def out_of_place(prints: list[dict]) -> list[dict]:
    """Checkpoints (with a neighbour on each side) whose weights are closer to a later step's than FAR times
    the nearer neighbour's distance: [{run, checkpoint, step, closest, closest_step, ratio}]."""
    found = []
    for run in sorted({p["run"] for p in prints}):
        ordered = sorted((p for p in prints if p["run"] == run), key=_order)
        for i in range(1, len(ordered) - 2):
            me = ordered[i]
            near = [d for d in (_distance(me["sketch"], ordered[i - 1]["sketch"]),
                                _distance(me["sketch"], ordered[i + 1]["sketch"])) if d is not None]
            later = [(d, q) for q in ordered[i + 2:] if (d := _distance(me["sketch"], q["sketch"])) is not None]
            if len(near) < 2 or not later:
                continue
            d, q = min(later, key=lambda x: x[0])
            if d < FAR * min(near):
                found.append({"run": run, "checkpoint": me["checkpoint"], "step": me["step"],
                              "closest": q["checkpoint"], "closest_step": q["step"],
                              "ratio": d / min(near) if min(near) else 0.0})
    return found


def _order(p: dict):
    return (p["step"] is None, p["step"] if p["step"] is not None else 0, p["checkpoint"])


def findings(prints: list[dict]) -> list[str]:
    """One line per finding (identical weights, a step out of place); none when the run looks as its steps say."""
    lines = [f"{g[0]['run']}: identical weights at {', '.join(p['checkpoint'] for p in g)} (each checkpoint should "
             "differ: these serve the same tensors, byte for byte)" for g in identical(prints)]
    lines += [f"{f['run']}: {f['checkpoint']} is closer to the later {f['closest']} ({f['ratio']:.2f} of the distance "
              "to its nearer neighbour) than to the checkpoints beside it: its weights may not be its step's"
              for f in out_of_place(prints)]
    return lines
