"""Are a run's checkpoints what their steps say? A fingerprint of each checkpoint's weights, taken by the
sweep right after loading it, and what the fingerprints of a run say together.

In Pythia's published checkpoints 86 of 154 pythia-2.8b branches serve final-era weights (pythia#205):
a sweep over them draws a phase change that never happened. A fingerprint (`fingerprint`) holds

- `weights`: a hash over every tensor's name, shape, dtype and bytes, in name order;
- `sketch`: SKETCH numbers whose distances measure the distances of the whole weights: every value of every
  floating tensor, times a sign drawn for its (tensor, position), summed into bucket position mod SKETCH (a
  count sketch; the squared distance of two sketches estimates the squared distance of the two weights, to a
  few percent). One pass over the bytes the hash reads anyway, a million values at a time;
- `layout`: a hash of the tensors' names and shapes (sketches of other layouts are not compared).

The sweep keeps `files` beside it (name, size, mtime, ctime and inode of each of the checkpoint's files):
a fingerprint is trusted only while the files are those it was taken from (`files_stamp`).

What a run's fingerprints say together (`analyse`, over the whole run's distance matrix):

- identical weights: checkpoints whose tensors are byte for byte the same;
- near-copies: checkpoints whose mutual distance is tiny (under TINY) next to their distance to any other
  checkpoint, in all and per step (single linkage: a cluster is named when the distance at which it would join
  another checkpoint is more than 1/TINY times its own spread; a training run's steps move apart, so a smooth run
  has none, however fast or slow it moves). In each cluster one checkpoint fits its place (the checkpoints beside
  its step are nearest its weights; on a tie the latest) and the others are its copies: the finding blames them;
- a step out of place: a checkpoint (not a copy) much closer (under FAR) to another, non-adjacent checkpoint
  than to the checkpoints beside it, of the two the one whose neighbours fit it worse; and, against the last
  genuine checkpoint, a checkpoint much nearer to (or farther from) the final weights than both checkpoints
  beside it (a step's distance to the final weights falls as training goes).

The fingerprints are kept in the results (`fingerprints/<run>/<checkpoint>.json`, merged into
fingerprints.csv), read back through `kept` (which names a malformed, outdated or foreign file instead of
trusting it), named in the sweep's last lines, the report's "Checkpoint integrity" section and its headline.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from interp.models.placement.device import to_numpy
from interp.models.placement.offload import named_weights
from ..store import slug

FORMAT = 2  # 1 (unmarked): a sample of values as the sketch, no files; 2: the count sketch, files and layout
SKETCH = 2048  # buckets of the sketch
CHUNK = 1 << 20  # values read at a time (a multiple of SKETCH and of 64): host memory bounded for any tensor
TINY = 0.01  # near-copies: their spread is under this fraction of their distance to every other checkpoint
FAR = 0.5  # out of place: closer than this fraction of the distance to the checkpoints beside it
TIE = 1.05  # members of a cluster that fit their place within 5% of the best: the latest is the genuine one
AGREE = 1e-9  # two fingerprints of one hash whose sketches differ by more than this (relative): one is false

_HEX = {"weights": re.compile(r"[0-9a-f]{32}"), "layout": re.compile(r"[0-9a-f]{16}")}


# ---- taking one -------------------------------------------------------------------------------------------
def fingerprint(model) -> dict:
    """{"format", "weights": a hash of every tensor of `model`'s state dict, "layout": a hash of their names and
    shapes, "sketch": SKETCH numbers (None when a weight is NaN or inf: nothing to measure)}."""
    h, layout = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=8)
    sketch = np.zeros(SKETCH)
    for name, t in named_weights(model):  # sorted; an offloaded model's one unit at a time
        t = t.detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        layout.update(f"{name}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1).contiguous()
        if not flat.numel():
            continue
        raw = to_numpy(flat.view(torch.uint8))  # one tensor on the host at a time, not copied again
        h.update(memoryview(raw))
        if flat.is_floating_point():
            _project(sketch, name, raw, flat.dtype)
    finite = bool(np.isfinite(sketch).all())
    return {"format": FORMAT, "weights": h.hexdigest(), "layout": layout.hexdigest(),
            "sketch": sketch.tolist() if finite else None}


def _project(sketch: np.ndarray, name: str, raw: np.ndarray, dtype: torch.dtype) -> None:
    """Add the values of one tensor (its bytes, `raw`) to `sketch`: value i, times a sign drawn for (name, i),
    into bucket i mod SKETCH, summed in float64. The signs come from PCG64's raw stream (stable across numpy
    versions and machines), seeded by the tensor's name, so every checkpoint of a layout draws the same ones; a
    sign is applied by flipping the value's sign bit (exact, and the cheapest pass over the values)."""
    item = dtype.itemsize
    bits = np.random.PCG64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))
    for start in range(0, raw.size // item, CHUNK):
        u = _float_bits(raw[start * item:(start + CHUNK) * item], dtype)
        signs = np.unpackbits(bits.random_raw(-(-u.size // 64)).astype("<u8").view(np.uint8), count=u.size,
                              bitorder="little")
        flip = signs.astype(u.dtype) * u.dtype.type(1 << (8 * u.itemsize - 1))
        x = np.bitwise_xor(u, flip, out=flip).view(np.float32 if u.itemsize == 4 else np.float64)
        if pad := -x.size % SKETCH:
            x = np.concatenate([x, np.zeros(pad, x.dtype)])
        sketch += x.reshape(-1, SKETCH).sum(axis=0, dtype=np.float64)


def _float_bits(raw: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Bytes of `dtype` values as float32 bits (uint32; float64's as uint64), exactly the values (a view of `raw`
    where it can be; numpy has no bfloat16: its bits are float32's top half)."""
    if dtype == torch.float32:
        return raw.view(np.uint32)
    if dtype == torch.float64:
        return raw.view(np.uint64)
    if dtype == torch.bfloat16:
        return raw.view(np.uint16).astype(np.uint32) << 16
    if dtype == torch.float16:
        return raw.view(np.float16).astype(np.float32).view(np.uint32)
    return to_numpy(torch.from_numpy(raw.copy()).view(dtype).float()).view(np.uint32)  # float8 and the like


def files_stamp(path) -> list[list]:
    """[name, size, mtime_ns, ctime_ns, inode] of each file of a checkpoint (a folder's own files, or the file
    itself); [] when it cannot be read. A fingerprint is trusted while its checkpoint's stamp is unchanged."""
    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
        return [[q.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for q in files for st in [q.stat()]]
    except OSError:
        return []


# ---- reading the kept ones ----------------------------------------------------------------------------------
@dataclass
class Kept:
    """The fingerprint files of a sweep folder, judged (`kept`).

    prints        well-formed, of a checkpoint of the folder's runs, and trusted: what findings are made of
    malformed     "file: why" of each file that is not a fingerprint interp wrote (never trusted)
    outdated      well-formed ones not trusted: from an older interp (no distance sketch), or their checkpoint's
                  files changed since (with `check_files`)
    inconsistent  well-formed ones sharing a hash with another whose sketch differs: one of them is false
    orphans       well-formed ones of checkpoints that are not in the folder's runs
    """

    prints: list[dict] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    outdated: list[dict] = field(default_factory=list)
    inconsistent: list[dict] = field(default_factory=list)
    orphans: list[dict] = field(default_factory=list)

    def stored(self) -> list[dict]:
        """Every well-formed fingerprint of the folder's checkpoints, trusted or not."""
        return self.prints + self.outdated + self.inconsistent

    def notes(self, rerun: str = "rerun interp sweep with this --out to take it again") -> list[str]:
        """One line per kind of fingerprint that was not used, naming the files or checkpoints."""
        notes = [f"{m}: not a fingerprint interp wrote; {rerun}" for m in self.malformed]
        if self.outdated:
            notes.append(f"fingerprints not used, taken by an older interp or before their checkpoint's files changed: "
                         f"{checkpoints_of(self.outdated)}; {rerun}")
        if self.inconsistent:
            notes.append(f"fingerprints not used, their hashes agree and their sketches do not (a file was changed "
                         f"outside interp): {checkpoints_of(self.inconsistent)}; {rerun}")
        if self.orphans:
            notes.append(f"fingerprints ignored, of checkpoints not in this folder's runs: {checkpoints_of(self.orphans)}")
        return notes


def kept(out, runs: dict | None = None, check_files: bool = False) -> Kept:
    """The fingerprint files under `out`/fingerprints, judged: a file that is not JSON, not an object, lacks a field
    or sits at another checkpoint's path is `malformed`; one of a checkpoint missing from `runs` (settings.json's
    {run: {"checkpoints": [...]}}) is an orphan; one whose checkpoint files (`path`) changed since it was taken
    is outdated (`check_files`; a checkpoint whose files are gone keeps its fingerprint, the record of what was
    analysed); two of one hash whose sketches differ are inconsistent."""
    out, found = Path(out), Kept()
    listed = None if not isinstance(runs, dict) else {(r, c) for r, info in runs.items() if isinstance(info, dict)
                                                      for c in info.get("checkpoints", []) if isinstance(c, str)}
    for f in sorted((out / "fingerprints").glob("*/*.json")):
        rel = f.relative_to(out).as_posix()
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            found.malformed.append(f"{f} ({type(e).__name__})")
            continue
        if why := problem(record, rel):
            found.malformed.append(f"{f} ({why})")
        elif listed is not None and (record["run"], record["checkpoint"]) not in listed:
            found.orphans.append(record)
        elif record.get("format") != FORMAT or (check_files and Path(record["path"]).exists()
                                                 and files_stamp(record["path"]) != record["files"]):
            found.outdated.append(record)
        else:
            found.prints.append(record)
    by_hash: dict[tuple, list[dict]] = {}
    for p in found.prints:
        by_hash.setdefault((p["run"], p["weights"]), []).append(p)
    for group in by_hash.values():
        if len(group) > 1 and not all(_agree(group[0], p) for p in group[1:]):
            found.inconsistent += group
    found.prints = [p for p in found.prints if not any(p is q for q in found.inconsistent)]
    return found


def problem(record, rel: str) -> str | None:
    """Why `record`, read from the folder's `rel`, is not a fingerprint interp wrote; None when it is one. An
    older interp's (no "format") needs run, checkpoint, step and weights only; it is never trusted (`kept`)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in ("run", "checkpoint", "weights"):
        if not isinstance(record.get(key), str):
            return f"no {key!r}"
    step = record.get("step", False)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return "no 'step' (a whole number or null)"
    if not _HEX["weights"].fullmatch(record["weights"]):
        return "its 'weights' is not a 32-digit hash"
    if rel != (at := f"fingerprints/{slug(record['run'])}/{slug(record['checkpoint'])}.json"):
        return f"it names {record['run']}/{record['checkpoint']}, whose fingerprint is {at}"
    if "format" not in record:
        return None
    if record["format"] != FORMAT:
        return f"format {record['format']!r}, not {FORMAT}"
    if not isinstance(record.get("layout"), str) or not _HEX["layout"].fullmatch(record["layout"]):
        return "no 'layout' (a 16-digit hash)"
    sketch = record.get("sketch")
    if sketch is not None and not (isinstance(sketch, list) and len(sketch) == SKETCH and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in sketch)):
        return f"its 'sketch' is not {SKETCH} finite numbers"
    files = record.get("files")
    if not isinstance(record.get("path"), str) or "\0" in record["path"] or not isinstance(files, list) or not all(
            isinstance(e, list) and len(e) == 5 and isinstance(e[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in e[1:]) for e in files):
        return "no 'path' and 'files' (the checkpoint it was taken from)"
    return None


def _agree(a: dict, b: dict) -> bool:
    """Whether two fingerprints of one hash have the sketch one set of bytes gives (None for both: not finite)."""
    if a["sketch"] is None or b["sketch"] is None:
        return a["sketch"] is None and b["sketch"] is None
    x, y = np.asarray(a["sketch"]), np.asarray(b["sketch"])
    return a["layout"] == b["layout"] and float(np.linalg.norm(x - y)) <= AGREE * max(float(np.linalg.norm(x)), 1e-300)


def checkpoints_of(prints: list[dict]) -> str:
    """`run/checkpoint, ...` of fingerprints, in run and step order."""
    return ", ".join(f"{p['run']}/{p['checkpoint']}" for p in sorted(prints, key=lambda p: (p["run"], *_order(p))))


# ---- what a run's fingerprints say ------------------------------------------------------------------------------
def _order(p: dict):
    return (p["step"] is None, p["step"] if p["step"] is not None else 0, p["checkpoint"])


def identical(prints: list[dict]) -> list[list[dict]]:
    """Groups (two or more) of one run's checkpoints with byte-identical weights, in step order."""
    groups: dict[tuple, list[dict]] = {}
    for p in prints:
        groups.setdefault((p["run"], p["weights"]), []).append(p)
    return [sorted(g, key=_order) for g in groups.values() if len(g) > 1]


def near_copies(prints: list[dict]) -> list[dict]:
    """Clusters of one run's checkpoints that serve one set of weights, byte-identical or perturbed:
    [{run, checkpoints (in step order), genuine, copies, spread, apart, nearest, identical}]."""
    return [c for r in analyse(prints) for c in r["clusters"]]


def out_of_place(prints: list[dict]) -> list[dict]:
    """Checkpoints (not copies) whose weights are not their step's by the distances:
    [{run, checkpoint, step, kind ("closer", "nearer_final" or "farther_final"), other, other_step, ratio}]."""
    return [f for r in analyse(prints) for f in r["out_of_place"]]


def analyse(prints: list[dict]) -> list[dict]:
    """Per run: {run, clusters, out_of_place, nonfinite (checkpoints whose weights hold NaN or inf), final (the
    last genuine checkpoint), to_final {checkpoint: distance}} from the run's distance matrix."""
    results = []
    for run in sorted({p["run"] for p in prints}):
        ordered = sorted((p for p in prints if p["run"] == run), key=_order)
        nonfinite = [p["checkpoint"] for p in ordered if p.get("sketch") is None]
        layouts = [p["layout"] for p in ordered if p.get("sketch") is not None]
        main = max(set(layouts), key=layouts.count) if layouts else None  # a run of several layouts: the usual one
        ps = [p for p in ordered if p.get("sketch") is not None and p["layout"] == main]
        results.append({"run": run, "nonfinite": nonfinite, **_judge(run, ps)})
    return results


def _judge(run: str, ps: list[dict]) -> dict:
    """Clusters of copies, steps out of place and distances to the final weights of one run's comparable
    checkpoints `ps` (in step order)."""
    n = len(ps)
    if n < 3:
        return {"clusters": [], "out_of_place": [], "final": ps[-1]["checkpoint"] if ps else None,
                "to_final": {p["checkpoint"]: float(np.linalg.norm(np.subtract(p["sketch"], ps[-1]["sketch"])))
                             for p in ps}}
    x = np.asarray([p["sketch"] for p in ps], np.float64)
    d = np.stack([np.linalg.norm(x - row, axis=1) for row in x])  # a row at a time: no [n, n, SKETCH] array
    clusters, copies = [], set()
    for members, spread, apart in _isolated(d, [p["step"] for p in ps]):
        inside = set(members)
        score = {m: _fit(d, m, [j for j in range(n) if j not in inside]) for m in members}
        best = min(score.values())
        genuine = max(m for m in members if score[m] <= best * TIE)
        outside = [j for j in range(n) if j not in inside]
        nearest = min(outside, key=lambda j: d[genuine, j])
        copies |= inside - {genuine}
        clusters.append({"run": run, "checkpoints": [ps[m]["checkpoint"] for m in members],
                         "steps": [ps[m]["step"] for m in members], "genuine": ps[genuine]["checkpoint"],
                         "copies": [ps[m]["checkpoint"] for m in members if m != genuine],
                         "spread": float(spread), "apart": float(apart), "nearest": ps[nearest]["checkpoint"],
                         "identical": len({ps[m]["weights"] for m in members}) == 1})
    active = [i for i in range(n) if i not in copies]
    found: dict[int, dict] = {}
    while pair := _closest_elsewhere(d, active):  # the most out of place first: it skews its neighbours' distances
        i, k = pair
        blamed, other = (i, k) if _fit(d, i, [j for j in active if j != k]) >= _fit(d, k, [j for j in active
                                                                                       if j != i]) else (k, i)
        own = min(d[blamed, j] for j in _beside(active, blamed))
        found[blamed] = _misplaced(run, ps, blamed, other, "closer", d[blamed, other] / own if own else 0.0)
        active.remove(blamed)
    settled = active
    final = settled[-1]
    f = d[:, final]
    for pos in range(1, len(settled) - 2):  # the final weights' distance should fall with the step
        i, before, after = settled[pos], settled[pos - 1], settled[pos + 1]
        if f[i] < FAR * min(f[before], f[after]):
            found.setdefault(i, _misplaced(run, ps, i, final, "nearer_final", f[i] / min(f[before], f[after])))
        elif f[i] * FAR > max(f[before], f[after]):
            found.setdefault(i, _misplaced(run, ps, i, final, "farther_final", f[i] / max(f[before], f[after])))
    return {"clusters": clusters, "out_of_place": [found[i] for i in sorted(found)], "final": ps[final]["checkpoint"],
            "to_final": {p["checkpoint"]: float(f[i]) for i, p in enumerate(ps)}}


def _isolated(d: np.ndarray, steps: list) -> list[tuple[list[int], float, float]]:
    """(members, spread, apart) of each maximal cluster of the single-linkage tree of `d` whose spread (the
    distance that completed it) is under TINY times the distance `apart` at which it joins anything else, and,
    where the steps are known, under TINY times it per step too: two checkpoints one step apart between
    checkpoints a thousand steps apart are close because training moved them one step, not because one is a copy."""
    n = len(d)
    parent, members, born = list(range(n)), {i: [i] for i in range(n)}, {i: 0.0 for i in range(n)}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def per_step(c: int, dist: float, i: int, j: int) -> bool:
        inside = [steps[m] for m in sorted(members[c])]
        if None in inside or steps[i] is None or steps[j] is None:
            return True
        span = max(max(b - a for a, b in zip(inside, inside[1:])), 1)
        return born[c] * max(abs(steps[i] - steps[j]), 1) < TINY * dist * span

    found = []
    for dist, i, j in sorted((d[i, j], i, j) for i in range(n) for j in range(i + 1, n)):
        a, b = root(i), root(j)
        if a == b:
            continue
        for c in (a, b):
            if len(members[c]) > 1 and born[c] < TINY * dist and per_step(c, dist, i, j):
                found.append((sorted(members[c]), born[c], dist))
        parent[b] = a
        members[a] += members.pop(b)
        born[a] = dist
    return [f for f in found if not any(set(f[0]) < set(g[0]) for g in found)]


def _closest_elsewhere(d: np.ndarray, active: list[int]) -> tuple[int, int] | None:
    """(i, k) of the checkpoint of `active` most out of place: much closer (under FAR) to the checkpoint `k` than to
    the checkpoints beside it, by the smallest ratio; None when there is none."""
    best = None
    for i in active:
        beside = _beside(active, i)
        others = [j for j in active if j != i and j not in beside]
        if not beside or not others:
            continue
        k = min(others, key=lambda j: d[i, j])
        ratio = d[i, k] / min(d[i, j] for j in beside) if min(d[i, j] for j in beside) else math.inf
        if ratio < FAR and (best is None or ratio < best[0]):
            best = (ratio, i, k)
    return best and best[1:]


def _beside(order: list[int], i: int) -> list[int]:
    """The checkpoints either side of `i` in `order` (one at the ends)."""
    at = order.index(i)
    return [order[k] for k in (at - 1, at + 1) if 0 <= k < len(order)]


def _fit(d: np.ndarray, m: int, among: list[int]) -> float:
    """How far `m`'s weights are from the checkpoints beside its step among `among` (mean; inf when none)."""
    order = sorted(set(among) | {m})
    beside = _beside(order, m)
    return float(np.mean([d[m, j] for j in beside])) if beside else math.inf


def _misplaced(run: str, ps: list[dict], i: int, other: int, kind: str, ratio: float) -> dict:
    return {"run": run, "checkpoint": ps[i]["checkpoint"], "step": ps[i]["step"], "kind": kind,
            "other": ps[other]["checkpoint"], "other_step": ps[other]["step"], "later": other > i, "ratio": float(ratio)}


def _names(names: list[str], run_order: list[str]) -> str:
    """Checkpoint names, each stretch of three or more consecutive in the run as `first..last`, and how many
    there are when more than one."""
    pos = sorted(run_order.index(n) for n in names)
    spans, start = [], 0
    for k in range(1, len(pos) + 1):
        if k == len(pos) or pos[k] != pos[k - 1] + 1:
            stretch = [run_order[p] for p in pos[start:k]]
            spans.append(f"{stretch[0]}..{stretch[-1]}" if len(stretch) >= 3 else ", ".join(stretch))
            start = k
    return ", ".join(spans) + (f" ({len(pos)} checkpoints)" if len(pos) > 1 and any(".." in s for s in spans) else "")


def findings(prints: list[dict]) -> list[str]:
    """One line per finding (identical weights, near-copies and which of them are the copies, a step out of
    place, weights that cannot be measured); none when the run looks as its steps say."""
    lines = [f"{g[0]['run']}: identical weights at {', '.join(p['checkpoint'] for p in g)} (each checkpoint should "
             "differ: these serve the same tensors, byte for byte)" for g in identical(prints)]
    for r in analyse(prints):
        run, order = r["run"], [p["checkpoint"] for p in sorted((p for p in prints if p["run"] == r["run"]), key=_order)]
        for c in r["clusters"]:
            if not c["identical"]:
                lines.append(f"{run}: near-copies at {_names(c['checkpoints'], order)}: their weights lie within "
                             f"{c['spread']:.3g} of each other and {c['apart']:.3g} from any other checkpoint (the "
                             f"nearest, {c['nearest']}); training moves every step's weights, so these serve one set "
                             "of weights")
            g, many = c["genuine"], len(c["copies"]) > 1
            lines.append(f"{run}: {_names(c['copies'], order)} " + (
                f"hold copies of {g}'s weights ({g} fits its place between the checkpoints beside it; they do not): "
                f"their results are {g}'s, not their steps'" if many else
                f"holds a copy of {g}'s weights ({g} fits its place between the checkpoints beside it; it does not): "
                f"its results are {g}'s, not its step's"))
        for f in r["out_of_place"]:
            if f["kind"] == "closer":
                lines.append(f"{run}: {f['checkpoint']} is closer to the {'later' if f['later'] else 'earlier'} "
                             f"{f['other']} ({f['ratio']:.2f} of the distance to its nearer neighbour) than to the "
                             "checkpoints beside it: its weights may not be its step's")
            else:
                nearer = f["kind"] == "nearer_final"
                lines.append(f"{run}: {f['checkpoint']} is {'nearer to' if nearer else 'farther from'} the final "
                             f"weights ({f['other']}) than both checkpoints beside it ({f['ratio']:.2f} "
                             f"{'of' if nearer else 'times'} their distance): a step's distance to the final weights "
                             "should fall as training goes; its weights may not be its step's")
        if r["nonfinite"]:
            lines.append(f"{run}: the weights of {', '.join(r['nonfinite'])} hold NaN or inf: not compared with the "
                         "other checkpoints")
    return lines
