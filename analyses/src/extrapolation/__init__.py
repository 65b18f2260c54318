"""Past the trained context: head scores by length (`lengths`, `interp lengths`), and perplexity,
passkey and every head's change per RoPE scaling with the per-head repair (`extrapolate`, the
measurements; `study`, `interp extrapolate`)."""
