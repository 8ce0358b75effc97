"""Quantization backends, one module each, imported only when a recipe names their method.

A backend is a class built from the recipe's `quantize` section with:
- `needs_calibration`: whether `quantize` wants calibration windows;
- `format`: the checkpoint format it writes;
- `quantize(model, calibration)`: compress the loaded model in place; or, with
  `loads_quantized = True`, `load(base_path, dtype)`: a new model quantized as it loads; or, with
  `writes_checkpoint = True`, `write(base_path, dtype, calibration, dest, log_path)`: quantize and
  save in one step (GPTQModel, in a child process); or, with `trains = True`,
  `prepare_training(...)` at prepare time and `train(teacher, tokenizer, run, workdir, held_out)`:
  a new model trained against the loaded one (distillation);
- `save(model, tokenizer, dest)`: write the checkpoint into `dest`.
"""

from __future__ import annotations

import importlib

from quantbench.errors import UserError, did_you_mean

# method (or method/format, where a recipe's `format:` picks another engine) -> "module:object";
# `quantbench --help` and most tests import none of these.
BACKENDS = {
    "gptq": "quantbench.quantize.llmcompressor:LLMCompressorBackend",
    "awq": "quantbench.quantize.llmcompressor:LLMCompressorBackend",
    "fp8": "quantbench.quantize.llmcompressor:LLMCompressorBackend",
    "smoothquant": "quantbench.quantize.llmcompressor:LLMCompressorBackend",
    "bnb": "quantbench.quantize.bnb:BnbBackend",
    "distill": "quantbench.quantize.distill:DistillBackend",
    "gptq/gptq": "quantbench.quantize.gptqmodel:GPTQModelBackend",
    "awq/awq": "quantbench.quantize.gptqmodel:GPTQModelBackend",
}
# the package a backend module needs, for a clear error when it is missing
PACKAGES = {"quantbench.quantize.llmcompressor": "llmcompressor", "quantbench.quantize.bnb": "bitsandbytes",
            "quantbench.quantize.distill": "transformers", "quantbench.quantize.gptqmodel": "gptqmodel"}


def get_backend(method: str, format: str | None = None):
    key = f"{method}/{format}" if f"{method}/{format}" in BACKENDS else method
    if key not in BACKENDS:
        methods = [m for m in BACKENDS if "/" not in m]
        raise UserError(f"quantize.method: unknown method '{method}'." + did_you_mean(method, methods))
    module_name, _, attr = BACKENDS[key].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        package = PACKAGES.get(module_name, exc.name)
        what = f"'{method}' with format '{format}'" if "/" in key else f"'{method}'"
        raise UserError(f"quantize.method: {what} needs the package '{package}', which is not installed ({exc})") from None
    return getattr(module, attr)
