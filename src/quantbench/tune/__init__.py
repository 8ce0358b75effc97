"""Per-layer mixed precision: sensitivity of each layer, the allocation under a budget, and the
search that quantizes, measures and gates candidates (as jobs)."""
