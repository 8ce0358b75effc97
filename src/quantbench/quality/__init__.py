"""Quality against the base model: the reload check, the evaluate stage (perplexity, KL divergence,
top-1 agreement, answer flips, intervals), suites and lm-eval tasks. Independent of speed/ and
quantize/."""
