"""Names that say what they mean (issue 44): every `interp.` path a docstring, comment or message names
resolves (a moved module's old path does not count), every repository file a docstring names exists,
each KV-cache policy class carries its own description and the documentation's list of policies (docs/kv_cache.md) is generated
from them, the CLI's help lists the registry's policies, and `budget` is split into what it meant."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
import warnings
from pathlib import Path

import pytest
from changelog import moved_modules

import interp

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("interp", "models", "kernels", "analyses")
DOTTED = re.compile(r"(?<![\w/-])interp(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"`((?:interp|models|kernels|analyses|tests|notebooks|docs)/[\w./-]+\.(?:py|ipynb|md|json))`")
# a moved module's old name, written as a module: `kv_cache_policy.PolicyKVCache`, `models.kv_cache_policy`; not the
# old names that are also today's (a module elsewhere, an argument or a function: `kv_cache`, `hook_aliases`)
TODAY = {f.stem for folder in FOLDERS for f in (ROOT / folder).rglob("*.py")} | {
    p.name for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.is_dir()}
MOVED = moved_modules()  # CHANGELOG.md's table: no old path is kept alive, and none may be named as a module
OLD = sorted({old.rsplit(".", 1)[1] for old in MOVED} - TODAY - {"kv_cache", "kv_policy", "hook_aliases",
                                                                         "format_ours", "format_hf"})
OLD_REF = re.compile(r"(?<![\w./])(?:(?:models|analyses)[./](?:" + "|".join(OLD) + r")\b|(?:" + "|".join(OLD)
                     + r")\.[A-Za-z_])")


def texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment, docstring and string constant of a Python source."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def resolves(dotted: str) -> bool:
    """Whether `interp.a.b.c` names a module, or an attribute of one; a moved module's old path does not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in MOVED:
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("interp"):
                return True  # behind an optional dependency: not ours to judge here
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale(source: str, root: Path = ROOT) -> list[str]:
    """`line: name` for each name in `source`'s comments, docstrings and strings that does not resolve."""
    bad = []
    for line, text in texts(source):
        bad += [f"{line}: {m}" for m in (d.rstrip(".") for d in DOTTED.findall(text)) if not resolves(m)]
        bad += [f"{line}: {m}" for m in FILE.findall(text) if not (root / m).exists()]
        bad += [f"{line}: {m.group(0)}" for m in OLD_REF.finditer(text)]
    return bad


def test_every_name_in_docstrings_comments_and_messages_resolves():
    found = {}
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f == ROOT / "interp" / "__init__.py":
                continue  # its table of moved modules names the old paths on purpose (the one-release shims)
            if bad := stale(f.read_text()):
                found[str(f.relative_to(ROOT))] = bad
    assert not found, found


def test_the_check_catches_a_stale_name():
    source = ('"""Scores from `interp.analyses.head_roles.retrieval_scores` and `interp.analyses.kv.roles.nope`;\n'
              'the cache is `kv_cache_policy.PolicyKVCache`, the gates `analyses/src/gates.py`."""\n'
              '# fine: interp.analyses.kv.roles.retrieval_scores, `analyses/src/kv/gates.py`, interp.load\n'
              'X = "see models.kv_cache_policy"\n')
    assert stale(source) == ["1: interp.analyses.head_roles.retrieval_scores", "1: interp.analyses.kv.roles.nope",
                             "1: analyses/src/gates.py", "1: kv_cache_policy.P", "4: models.kv_cache_policy"]


# ---- policies describe themselves --------------------------------------------------------------------------
def test_each_policy_class_carries_its_description():
    from interp.models.kv import policies

    classes = {c for c in vars(policies).values()
               if isinstance(c, type) and issubclass(c, policies.Policy) and c.__dict__.get("names")}
    assert {c.__name__ for c in classes} == {"Dense", "Kivi", "Streaming", "H2O", "SnapKV", "KNorm", "TOVA", "Random"}
    for cls in classes:
        doc = cls.__dict__.get("__doc__") or ""
        assert "Reads" in doc, f"{cls.__name__}: say which shapes it reads"
        if cls is not policies.Dense:
            assert re.search(r"\(\w+ et al\. 20\d\d, \"|\"[^\"]+\" \(arXiv \d{4}\.\d{4,5}\)", doc), \
                f"{cls.__name__}: cite the paper"
    assert not hasattr(policies, "CacheView")  # the old name of Candidates: gone (CHANGELOG.md)


def test_the_readmes_list_of_policies_is_the_registrys():
    block = re.search(r"<!-- policies: policy_table\(\) -->\n(.*?)<!-- /policies -->", (ROOT / "docs" / "kv_cache.md").read_text(),
                      re.S)
    from interp.models.kv.policies import policy_table

    assert block and block.group(1) == policy_table(), "regenerate docs/kv_cache.md's block from policy_table()"


def test_the_cli_help_lists_the_registrys_policies():
    from interp.commands import choices
    from interp.models.kv.policies import policy_names

    assert list(choices.KV_POLICY_FORMS) == policy_names(ours=True)


# ---- budget, split ---------------------------------------------------------------------------------------------
def test_budget_is_split_into_tokens_per_head_and_the_share_of_heads_kept_full():
    from interp.analyses.kv.policies import ANSWER_COLUMNS, COLUMNS, PolicyRun, policy_runs
    from interp.analyses.kv.roles import equal_bytes_runs, selection_runs

    for columns in (COLUMNS, ANSWER_COLUMNS):
        assert "budget" not in columns and {"tokens_per_head", "full_fraction"} <= set(columns)
    assert "budget" not in PolicyRun.__dataclass_fields__
    assert {r.label: r.tokens_per_head for r in policy_runs("full,streaming(4,32),h2o(64)")} == {
        "full": None, "streaming(4,32)": 36, "h2o(64)": 64}
    import pandas as pd

    ranked = pd.Series([3.0, 1.0, 2.0, 0.0], index=pd.MultiIndex.from_tuples([(0, 0), (0, 1), (1, 0), (1, 1)]))
    (run,) = selection_runs({"loss": ranked}, 2, 2, fractions=(0.5,), sinks=4, window=32)
    assert (run.full_fraction, run.full_heads, run.tokens_per_head) == (0.5, 2, None)
    (snap,) = equal_bytes_runs((0.5,), (100,), sinks=4, window=32)
    assert (snap.full_fraction, snap.tokens_per_head) == (0.5, 68)  # at the bytes of half the heads full


@pytest.mark.parametrize("module", ["interp.models.kv.policies", "interp.analyses.kv.roles_study"])
def test_no_module_restates_the_policy_list(module):
    """The drifted prose lists ("full, KIVI, streaming, H2O, SnapKV" and no more) are gone from the places
    that described every policy."""
    doc = importlib.import_module(module).__doc__
    assert "snapkv(B) snapkv(B,W,K)" not in doc and "h2o(B) h2o(B,R)" not in doc
