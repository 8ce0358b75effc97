"""Runs of stages: the pipeline (quantize -> reload check -> evaluate -> bench, and the later
stages on their own), the noise floor, sweeps, and where attempts run (here or on Ray)."""
