"""Where models and texts come from: model sources (builtin, directories, GGUF files converted and
verified, hub, runs), checkpoints on disk, the texts quality and calibration read. Imports core and
tracking only."""
