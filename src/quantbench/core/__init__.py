"""What every layer uses and that knows nothing of the others: errors, logs, child processes,
the hardware, the environment recorded with a run, intervals, the quality measures on logits,
cache paths and YAML settings text. Imports nothing of quantbench outside core/."""
