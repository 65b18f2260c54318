"""`interp bench --quick` runs every section on a tiny configuration and writes every table, so the
benchmark cannot rot. The benchmark itself is not a test and never runs at full size here."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

from core_models import build, small, tokens  # noqa: E402

from interp.benchmarks import gpu, long_context, timing  # noqa: E402
from interp.benchmarks.kv_policies import PreparedCache  # noqa: E402
from interp.benchmarks.report import Options  # noqa: E402
from interp.cli import main as cli  # noqa: E402

TITLES = {
    "forward": "Forward pass: ours vs Hugging Face vs TransformerLens",
    "cache": "Cache overhead: run_with_cache, ours vs TransformerLens",
    "long_context": "Long-context head detection: streaming vs cached patterns",
    "ablation": "Ablation sweep: every head, mean ablation",
    "generation": "Generation: our KV cache vs Hugging Face generate vs TransformerLens",
}


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("bench") / "BENCHMARKS.md"
    threads = torch.get_num_threads()
    try:
        assert cli(["bench", "--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out.read_text()


def sections(text: str) -> dict[str, str]:
    """{title without its number: body} of the page's numbered sections."""
    parts = re.split(r"^## \d+\. ", text, flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p.split("\n", 1)[1] for p in parts}


def table_rows(body: str) -> list[list[str]]:
    """Rows (header and separator dropped) of every Markdown table in `body`."""
    rows, prev = [], ""
    for line in body.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            if prev.startswith("|"):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        prev = line if line.startswith("|") else ""
    return [r for r in rows if r]


def column(body: str, header: str) -> list[str]:
    """The cells under `header` in the first table of `body` that has that column."""
    tables, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    for table in tables:
        if header in table[0]:
            i = table[0].index(header)
            return [row[i] for row in table[2:]]
    raise KeyError(header)


def test_quick_run_writes_every_section(page):
    assert page.startswith("# Benchmarks")
    assert "- Command: `interp bench --quick --threads 1 --out " in page
    assert "- Torch threads: 1" in page
    assert "transformer-lens" in page and "transformers" in page
    found = sections(page)
    assert list(found)[: len(TITLES)] == list(TITLES.values())
    for title in TITLES.values():
        body = found[title]
        assert "Skipped" not in body.split("\n\n")[0], body[:300]
        assert table_rows(body), f"{title}: no table rows"
    gpu = [t for t in found if t.startswith("GPU")]
    assert gpu, "the GPU section is always on the page (skipped without CUDA)"
    if not torch.cuda.is_available():
        assert "Skipped: no CUDA device" in found[gpu[0]]
    heads = page.split("## Headline", 1)[1].split("\n## ", 1)[0]
    for word in ("forward", "cache", "long context", "ablation", "generation"):
        assert word in heads


def test_quick_run_numbers_agree(page):
    found = sections(page)
    forward = found[TITLES["forward"]]
    checks = [float(line.rsplit("=", 1)[1]) for line in forward.splitlines() if "max |logit difference|" in line]
    assert len(checks) == 2 and max(checks) < 1e-4  # the same weights in all three
    ablation = found[TITLES["ablation"]]
    diffs = [float(x) for x in column(ablation, "max abs loss diff vs ours") if x != "-"]
    assert len(diffs) == 2 and max(diffs) < 1e-4
    lc = found[TITLES["long_context"]]
    diffs = [float(x) for x in column(lc, "max abs score diff") if x != "-"]
    assert diffs and max(diffs) < 1e-4
    gen = found[TITLES["generation"]]
    assert set(column(gen, "HF same tokens")) == {"yes"}
    assert all(x == "yes" or x.endswith("%") for x in column(gen, "TL same tokens"))  # reported, not ours to fix
    sae = found["An SAE spliced in: run_with_saes against the clean forward and a hand-written hook"]
    checks = [float(line.rsplit(" ", 1)[1]) for line in sae.splitlines() if "max |spliced - hand hook| logits" in line]
    assert checks and max(checks) < 1e-4 and table_rows(sae)  # the splice is the hand hook's SAE, on the same model


def test_forward_module_cli_still_works(capsys):
    from interp.benchmarks import forward

    threads = torch.get_num_threads()
    try:
        assert forward.main(["--shape", "tiny", "--seq", "16", "--repeats", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "HF sdpa / ours" in capsys.readouterr().out


def test_unknown_section_is_refused(capsys):
    assert cli(["bench", "--sections", "forward,nope", "--out", "-"]) == 2
    err = capsys.readouterr().err  # one line on stderr, as every user error
    assert "unknown sections ['nope']" in err and err.startswith("error: ") and err.count("\n") == 1


def test_compare_times_rounds_follow_the_budget():
    calls = {"a": 0, "b": 0}

    def bump(k):
        calls[k] += 1

    t, rounds = timing.compare_times({"a": lambda: bump("a"), "b": lambda: bump("b")}, repeats=4, warmup=1)
    assert rounds == 4 and calls == {"a": 5, "b": 5} and set(t) == {"a", "b"}
    calls.update(a=0, b=0)
    timing.compare_times({"a": lambda: bump("a"), "b": lambda: bump("b")}, repeats=4, warmup=0, focus=["a"])
    assert calls == {"a": 4, "b": 2}  # the rest stop after min_repeats rounds
    slow = {"a": lambda: timing.time.sleep(0.02)}
    _, rounds = timing.compare_times(slow, repeats=10, warmup=0, budget=0.001, min_repeats=2)
    assert rounds == 2


def test_peak_memory_sees_an_allocation():
    peak, out = timing.peak_memory(lambda: torch.ones(64 * 2**20 // 4))
    if peak is None:
        pytest.skip("no VmHWM reset on this system")
    assert out.numel() == 2**24
    assert 60 * 2**20 < peak < 200 * 2**20


def test_memory_extrapolation():
    quad = [(1000, 1e6), (2000, 4e6)]
    value, p = long_context.predict(quad, 4000, 1.0)
    assert p == pytest.approx(2.0) and value == pytest.approx(16e6)
    measured, reach, p = long_context.longest_within(quad, 16e6, 1.0)
    assert measured == 2000 and reach == pytest.approx(4000, rel=1e-6)
    _, p = long_context.predict([(1000, 5e6), (2000, 5.1e6)], 4000, 2.0)
    assert p == 1.0  # flat growth is clamped to linear: never extrapolate optimistically


def test_quick_options_are_tiny():
    quick = Options.quick_config()
    assert max(quick.seqs) <= 64 and max(quick.long_seqs) <= 256 and quick.repeats == 1
    assert Options.quick_config(seqs=(8,)).seqs == (8,)


def test_gpu_steps_run_on_the_cpu():
    """The GPU section's three steps, run on the CPU (no CUDA needed): the kernel table (fused and torch
    backends, with and without a window), the model table and the exactness table."""
    table = gpu.kernel_table(Options.quick_config(long_seqs=(64,)), device="cpu", dims=(16,), dtypes=(torch.float32,),
                             windows=(None, 32), backends=("fused", "torch"))
    assert [r[:4] for r in table.rows] == [[64, 16, "float32", "-"], [64, 16, "float32", 32]]
    col = table.headers.index("fused / SDPA")
    assert all(isinstance(r[col], float) for r in table.rows)
    assert table.rows[1][table.headers.index("materialised ms")] == "-"  # no windowed materialised baseline
    late = gpu.kernel_table(Options.quick_config(long_seqs=(64,)), device="cpu", dims=(16,), dtypes=(torch.float32,),
                            windows=(None,), backends=("fused",), deadline=gpu.Deadline(0))
    assert late.rows[0][4] == "skipped: step time limit"
    exact = gpu.exactness_table("cpu")
    assert exact.headers[2:] == ["fused", "torch", "fused (torch-ops call)"]
    assert all(cell.endswith(" ok") for row in exact.rows for cell in row[2:]), exact.rows


def test_head_scan_section_compares_both_methods(page):
    found = sections(page)
    scan = next(body for title, body in found.items() if title.startswith("Head scan"))
    diffs = [float(x) for x in column(scan, "max abs diff")]
    assert diffs and max(diffs) < 1e-5  # patterns and streaming give the same scores
    assert set(column(scan, "auto picks")) <= {"pattern", "streaming"}


def test_kv_cache_section_measures_what_theory_says(page):
    found = sections(page)
    kv = next(body for title, body in found.items() if title.startswith("Quantized KV caches"))
    assert [float(r) for r in column(kv, "ratio")] == [1.0] * 6  # measured bytes per token = theoretical
    assert set(column(kv, "precision")) == {"fp32", "fp16", "bf16", "int8", "fp8", "int4"}


def test_kv_policies_section_holds_what_theory_says(page):
    found = sections(page)
    title, body = next((t, b) for t, b in found.items() if t.startswith("Per-head KV-cache policies"))
    assert "Skipped" not in body.split("\n\n")[0], body[:300]
    rows = table_rows(body)
    assert len(rows) == 2 * 9  # two contexts, the plain KVCache and eight policies each
    policies = [r[0] for r in rows]
    assert set(policies) == {"KVCache (plain)", "full", "fp16", "int8", "kivi4", "kivi2", "streaming(4,28)",
                             "h2o(32)", "snapkv(32)"}
    assert {float(r[6]) for r in rows} == {1.0}  # measured bytes per token = the theoretical figure
    for r in rows:
        if r[0] == "full":
            assert float(r[3]) == 1.0
        if r[0] in ("streaming(4,28)", "h2o(32)", "snapkv(32)"):
            assert float(r[1]) == 32  # a head holds its budget, not the context
    heads = page.split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert "KV policies, decode time vs the full cache" in heads


@pytest.mark.parametrize("policy", ["full", "int8", "kivi4(8,8)", "streaming(2,8)", "h2o(12)", "snapkv(12,4,3)"])
def test_kv_policies_rounds_start_from_the_same_cache(policy):
    """Every timed round decodes from the cache as it held the context: a reset dense cache, or a copy
    made before the timing (KIVI flushes a group, streaming / H2O / SnapKV evict, during the steps)."""
    model = build(small(positional="rotary", normalization="rmsnorm", act_fn="silu", gated_mlp=True, d_model=48,
                        n_heads=6, n_kv_heads=2, n_ctx=96, n_layers=2))
    toks = tokens(1, 36, seed=5)
    with torch.no_grad():
        cache = model.new_kv_cache(1, 36, policy=policy)
        model(toks[:, :30], kv_cache=cache)
        prepared = PreparedCache(cache, calls=3)
        runs = []
        for _ in range(3):
            state = prepared.fresh()
            runs.append(torch.cat([model(toks[:, i : i + 1], kv_cache=state) for i in range(30, 36)], dim=1))
            assert state.length == 36
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    with torch.no_grad():  # and that state is the one a fresh prefill leaves
        again = model.new_kv_cache(1, 36, policy=policy)
        model(toks[:, :30], kv_cache=again)
        want = torch.cat([model(toks[:, i : i + 1], kv_cache=again) for i in range(30, 36)], dim=1)
    assert torch.equal(runs[0], want)


def test_the_gpu_placement_step_runs_on_the_cpu():
    """Step 4 of the GPU section (whole, offloaded to host and disk, device_map), run on the CPU: every
    placement gives the logits of the model held whole."""
    table = gpu.placement_table(Options.quick_config(), device="cpu", n=16)
    assert [r[0] for r in table.rows] == ["whole", "offload cpu", "offload disk", "device_map auto"]
    assert all(r[3] == 0.0 for r in table.rows), table.rows
