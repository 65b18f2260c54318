"""The prompts of smollm2_passkey_1024.json, made by the project's own code. Run in the project's venv from the
repo root:  PYTHONPATH=. .venv/bin/python tests/data/kvpress/make_prompts.py OUT.json
(retrieval_prompts(model, [1024], [0.25, 0.75], 1, 0, variant="passkey") on smollm2-135m). Not a test."""
import json, sys
import interp
try:
    from analyses.kv.tasks import retrieval_prompts, is_correct  # if moved
except ImportError:
    from analyses.tasks import retrieval_prompts, is_correct
m = interp.load("smollm2-135m")
ps = retrieval_prompts(m, [1024], [0.25, 0.75], 1, 0, variant="passkey")
out = []
for p in ps:
    out.append(dict(variant=p.variant, length=p.length, depth=p.depth, seed=p.seed, key=p.key, text=p.text,
                    tokens=[int(t) for t in p.tokens[0].tolist()], key_span=list(p.key_span)))
    print(p.depth, p.key, p.n_tokens, p.key_span, repr(p.text[-200:]))
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/work/kvpress-oracle/prompts.json", "w"))
