"""Benchmarks side by side with TransformerLens and Hugging Face (`interp bench` -> BENCHMARKS.md).

    suite.py         runs the chosen sections in one process, prints each table, writes the page
    report.py        Options (sizes, repeats), Section / Table, the Markdown page
    timing.py        interleaved medians (`compare_times`), peak memory, clocks, versions
    models.py        one set of random weights as a transformers model, ours and a TransformerLens bridge
    forward.py       1. forward: ours fused vs HF sdpa / eager vs the bridge's forward and run_with_cache
    caching.py       2. run_with_cache overhead (patterns / residuals / nothing), time and peak memory
    long_context.py  3. previous-token / induction / sink scores at long context: streaming vs cached patterns
    ablation.py      4. every-head mean-ablation sweep: ablate_heads vs a TransformerLens hook loop
    generation.py    5. tokens/s: our KV cache vs HF generate
    gpu.py           6. the same on CUDA, plus the Triton streaming kernel vs SDPA flash (skipped without CUDA)

They are not tests: timings are medians of interleaved repeats after warm-up, reported as ratios
because the machine is shared and noisy. `tests/interp/test_benchmarks.py` only checks that every section
runs on a tiny configuration (`interp bench --quick`) and writes its table.
"""
