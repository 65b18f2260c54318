"""Model classes by what they are (issue 54, part 5; issue 56, D6): one base (`HookedModel`) under interp's
own transformer and the wrapped model, native-only capabilities on the native class with the wrapped
model's refusal written once, `generate` taking a `Sampling` (the old keywords folded into it), and
`interp generate` on a wrapped model as transformers' own greedy generate gives it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import interp
from interp.models import HookedModel, HookedTransformer, Sampling
from interp.models.base import NativeOnly
from interp.models.generate import generate

ROOT = Path(__file__).resolve().parents[2]
NATIVE_ONLY = ("process_weights_", "new_kv_cache", "window_policy", "save", "rescale_rope_",
               "set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in")


def zoo():
    return interp.load("attn-only-2l")


def test_one_base_under_both_and_native_only_on_the_native_class():
    from interp.models.wrapped import WrappedModel

    assert issubclass(HookedTransformer, HookedModel) and issubclass(WrappedModel, HookedModel)
    assert not issubclass(WrappedModel, HookedTransformer)  # no inheritance only to skip an __init__
    for name in ("run_with_cache", "run_with_hooks", "hooks", "attention_stats", "prepare", "to_tokens",
                 "attention", "loss_fn", "enable_compatibility_mode"):
        assert hasattr(HookedModel, name), name
    for name in NATIVE_ONLY:
        assert not hasattr(HookedModel, name), name  # the base offers nothing it must then refuse
        assert name in vars(HookedTransformer) and name in vars(WrappedModel), name


def test_the_wrapped_rope_refusal_is_written_once():
    said = [p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("models/**/*.py"), ROOT / "interp/loading.py"]
            if "transformers runs (wrapped)" in p.read_text()]
    assert said == ["models/src/base.py"], said


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("module", ["models/src/generate.py", "models/src/native/transformer.py", "models/src/base.py",
                                   "models/src/wrapped/model.py", "models/src/wrapped/attention_function.py",
                                   "models/src/wrapped/architectures.py", "interp/commands/generate.py"])
def test_no_function_over_100_lines_and_no_public_one_over_12_parameters(module):
    for fn in _functions(ROOT / module):
        assert fn.end_lineno - fn.lineno + 1 <= 100, (module, fn.name)
        a = fn.args
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
        if not fn.name.startswith("_"):
            assert n <= 12, (module, fn.name, n)


def test_generate_takes_a_sampling_and_a_policy():
    params = inspect.signature(generate).parameters
    assert list(params)[:4] == ["model", "tokens", "max_new_tokens", "sampling"] and "policy" in params
    assert len([p for p in params.values() if p.kind != p.VAR_KEYWORD]) <= 9
    assert inspect.signature(HookedTransformer.generate) == inspect.signature(generate)


def test_old_keywords_fold_into_the_sampling():
    model = zoo()
    t = model.to_tokens("def f(x):")
    kw = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.2)
    assert torch.equal(model.generate(t, 10, **kw), model.generate(t, 10, Sampling(**kw)))
    # a keyword beside a Sampling replaces that field only
    assert torch.equal(model.generate(t, 10, Sampling(**{**kw, "seed": 4}), seed=3), model.generate(t, 10, **kw))
    assert torch.equal(model.generate(t, 10, kv_policy="streaming(2,4)"), model.generate(t, 10, policy="streaming(2,4)"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_n'") as e:
        model.generate(t, 10, top_n=3)
    assert "\n" not in str(e.value) and "top_k" in str(e.value)
    with pytest.raises(ValueError, match="not both"):
        model.generate(t, 10, policy="full", kv_policy="full")


def test_code_that_takes_a_model_checks_the_base():
    """Nothing in the package asks whether a model is a HookedTransformer when a wrapped one would do."""
    hits = []
    for path in [*ROOT.glob("interp/**/*.py"), *ROOT.glob("models/**/*.py"), *ROOT.glob("analyses/**/*.py")]:
        for line in path.read_text().splitlines():
            if re.search(r"isinstance\([^)]*HookedTransformer", line):
                hits.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not hits, hits


# ---- issue 56, D6: `interp generate` on a wrapped model ----------------------------------------------------
@pytest.fixture(scope="module")
def wrapped_folder(tmp_path_factory):
    """A saved transformers folder of a wrapped architecture (StarCoder2: biases, a window of 5, so a
    40-token continuation runs past it) with a word-level tokenizer ("t0 t1 ...")."""
    pytest.importorskip("transformers")
    from analyses_fixtures import word_tokenizer
    from wrapped_cases import VOCAB, build_wrapped_hf

    path = tmp_path_factory.mktemp("wrapped-generate")
    build_wrapped_hf("starcoder2").save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return path


def test_interp_generate_on_a_wrapped_model_is_transformers_greedy_generate(wrapped_folder, capsys, monkeypatch):
    """The default command line (greedy, 40 tokens, no cache policy) runs transformers' own generate through
    interp's attention: the tokens it prints are those of transformers' greedy generate on the same
    folder, loaded by transformers alone (its own attention). Before: "generate(seed=, kv_policy=...) needs
    interp's own implementation" for every wrapped model."""
    from transformers import AutoModelForCausalLM

    from interp.cli import main as cli
    from interp.models.placement.device import resolve_device

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompt = "t5 t17 t5 t17 t9"
    assert cli(["generate", str(wrapped_folder), prompt]) == 0
    printed = capsys.readouterr().out
    model = interp.load(wrapped_folder)
    assert not model.native
    device = resolve_device(None)
    hf = AutoModelForCausalLM.from_pretrained(wrapped_folder).eval().to(device)
    ids = model.to_tokens(prompt).to(device)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                           eos_token_id=model.tokenizer.eos_token_id, pad_token_id=model.tokenizer.pad_token_id)
    new = want[0, ids.shape[1]:]
    assert len(new) > 0
    assert printed.startswith(prompt + model.to_string(new) + "\n"), printed
    assert f"[{len(new)} new tokens in" in printed and "greedy" in printed
    # and the same tokens from the Python call the command makes
    assert torch.equal(model.generate(ids, 40).to(device), want)


def test_interp_generate_says_in_one_line_what_a_wrapped_model_cannot_do(wrapped_folder, capsys):
    from interp.cli import main as cli

    assert cli(["generate", str(wrapped_folder), "t5 t6", "--kv-policy", "streaming(2,4)"]) == 2
    err = capsys.readouterr().err.strip()
    assert "KV-cache policy" in err and "'starcoder2' is wrapped" in err and "\n" not in err, err
    model = interp.load(wrapped_folder)
    with pytest.raises(NativeOnly, match="capture_queries"):
        model.generate(model.to_tokens("t5 t6"), 4, capture_queries=True)


def test_a_wrapped_model_samples_reproducibly_and_returns_text_as_natively(wrapped_folder):
    model = interp.load(wrapped_folder)
    t = model.to_tokens("t5 t6 t7")
    a = model.generate(t, 8, do_sample=True, temperature=0.8, seed=1)
    assert torch.equal(a, model.generate(t, 8, Sampling(do_sample=True, temperature=0.8, seed=1)))
    greedy = model.generate(t, 8)
    text = model.generate("t5 t6 t7", 8)
    assert isinstance(text, str) and text == model.to_string(greedy[0, 1:])  # without the BOS, as TransformerLens
