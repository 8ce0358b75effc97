"""GPTQ and AWQ through GPTQModel, saved in the GPTQ / AWQ (GEMM) checkpoint formats.

AutoGPTQ and AutoAWQ are archived; GPTQModel is their maintained successor and writes the
formats their users load: `quantization_config.quant_method` "gptq" (transformers with optimum +
gptqmodel, vLLM, SGLang) or "awq" (transformers with gptqmodel, vLLM, SGLang). A recipe picks this
quantizer with `format: gptq` (method gptq) or `format: awq` (method awq); the same recipe with
`format: compressed-tensors` goes through llm-compressor.

GPTQModel runs in a child process (`python -m quantbench.quantize.gptqmodel`): an exception in
one of its worker threads ends the whole interpreter with `os._exit(1)` (threadx.py,
`_abort_process`), which would leave the MLflow run RUNNING and skip every cleanup. The child
loads the base model, quantizes, and saves into the staging directory; its output is shown and
kept in the run's log; a failed child fails the run with the end of that output.

Facts measured here (GPTQModel 7.6.0, the last release for torch 2.13): with one CPU worker
(its default on 2 cores) it stalls, so GPTQMODEL_CPU_WORKERS defaults to 2 here; it compiles a
small CPU packing extension on first use (~30 s, cached); AWQ's clip search needs every
quantized layer's output width to be a multiple of 64 (checked before anything runs);
transformers reloads both formats on CPU with GPTQModel's torch kernels.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from importlib.metadata import version as dist_version
from pathlib import Path

from quantbench.core.processes import stop_group
from quantbench.quantize import (
    Inputs,
    Produced,
    Quantizer,
    calibration_card,
    group_size_problem,
    recipe_layers,
)
from quantbench.quantize.stage import deterministic
from quantbench.recipe.methods import AWQSpec, GPTQSpec

if importlib.util.find_spec("gptqmodel") is None:  # named by the registry; the package is imported by the child only
    raise ModuleNotFoundError("No module named 'gptqmodel'", name="gptqmodel")

log = logging.getLogger(__name__)
AWQ_OUT_BLOCK = 64  # GPTQModel's AWQ clip search works on blocks of 64 (or 256) output channels


class GPTQModelQuantizer(Quantizer):
    """GPTQModel loads, quantizes and saves in a child process, straight into the staging dir."""

    library = "GPTQModel"
    calibrates = True
    trains = False
    on_load = False
    takes_model = False  # its child process loads its own copy

    def __init__(self, spec: GPTQSpec | AWQSpec):
        self.spec = spec
        self.format = spec.format  # "gptq" or "awq"

    def quantization_config(self) -> dict:
        return {"quant_method": self.format, "bits": 8 if self.spec.scheme == "W8A16" else 4}

    def check(self, loaded, config) -> list[str]:
        if self.format == "awq" and loaded.recipe.model.dtype == "float32":
            return [
                f"{loaded.path}: {loaded.where('model', 'dtype')}: GPTQModel's AWQ kernels run in bfloat16 or "
                "float16, not float32; use one of those (or format compressed-tensors)"
            ]
        problems = group_size_problem(loaded, config, self.spec.group_size) if self.spec.group_size else []
        if self.format == "awq":
            odd: dict[int, list[str]] = {}
            for name, _, width in recipe_layers(config, self.spec.ignore):
                if width % AWQ_OUT_BLOCK:
                    odd.setdefault(width, []).append(name)
            if odd:
                detail = "; ".join(f"output width {w} ({len(n)} layers, e.g. {n[0]})" for w, n in sorted(odd.items()))
                problems.append(
                    f"{loaded.path}: {loaded.where('quantize', 'format')}: GPTQModel's AWQ needs every quantized "
                    f"layer's output width to be a multiple of {AWQ_OUT_BLOCK}; these layers of "
                    f"{loaded.recipe.model.source} are not: {detail}. Use format compressed-tensors "
                    "(llm-compressor), or add them to quantize.ignore."
                )
        return problems

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        return {}

    def produce(self, inputs: Inputs) -> Produced:
        inputs.drop_model()  # the child loads its own copy
        model = inputs.loaded.recipe.model
        assert inputs.calibration is not None  # it calibrates: the job made the windows
        self.write(
            inputs.base.path,
            model.dtype,
            inputs.calibration,
            inputs.staging,
            inputs.log_path,
            inputs.loaded.recipe.calibration.seed,
            compute=self.computes_in(model),
        )
        return Produced(card=calibration_card(inputs))

    def computes_in(self, model) -> str:
        """The dtype GPTQModel computes in: AWQ's kernels refuse float32 (check), so that format
        computes in what it saves, even where that dtype is emulated; GPTQ in the job's."""
        return model.dtype if self.format == "awq" else model.computes_in()

    def loaders(self) -> str:
        version = dist_version("gptqmodel")
        if self.format == "gptq":
            return f"GPTQ (gptqmodel {version}) — transformers (+optimum, gptqmodel), vLLM, SGLang"
        return f"AWQ GEMM (gptqmodel {version}) — transformers (+gptqmodel), vLLM, SGLang"

    def write(
        self,
        base_path: Path,
        dtype: str,
        calibration: list[list[int]],
        dest: Path,
        log_path: Path,
        seed: int = 0,
        compute: str | None = None,
    ) -> None:
        """Quantize the base model with GPTQModel and save it into `dest`, in a child process
        (seeded and deterministic like the produce step: quantize/stage.py). It computes in `compute`
        (default: `dtype`) and saves the tensors it leaves unquantized in `dtype`."""
        job = {
            "base": str(base_path),
            "dtype": dtype,
            "compute": compute or dtype,
            "spec": self.spec.model_dump(mode="json"),
            "calibration": calibration,
            "dest": str(dest),
            "seed": seed,
        }
        env = dict(os.environ)
        if (os.cpu_count() or 1) <= 2:
            env.setdefault("GPTQMODEL_CPU_WORKERS", "2")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(job, handle)
        tail = b""
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "quantbench.quantize.gptqmodel", handle.name],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                with log_path.open("ab") as out:
                    assert proc.stdout is not None  # stdout=PIPE
                    while chunk := os.read(proc.stdout.fileno(), 65536):
                        sys.stderr.buffer.write(chunk)
                        sys.stderr.flush()
                        out.write(chunk)
                        tail = (tail + chunk)[-4000:]
                proc.wait()
            finally:
                stop_group(proc)  # on Ctrl-C / SIGTERM too: the child never outlives the job
        finally:
            os.unlink(handle.name)
        if proc.returncode != 0:
            last = tail.decode(errors="replace").replace("\r", "\n").strip().splitlines()[-12:]
            raise RuntimeError(f"GPTQModel failed (exit {proc.returncode}); the end of its output:\n" + "\n".join(last))


def config(spec: GPTQSpec | AWQSpec):
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD

    bits = 8 if spec.scheme == "W8A16" else 4
    group = spec.group_size or -1  # -1: one scale per output channel
    # lm_head stays unquantized
    skip: dict[str, dict] = {f"-:{_pattern(name)}": {} for name in spec.ignore if name != "lm_head"}
    if isinstance(spec, AWQSpec):
        return QuantizeConfig(
            bits=bits,
            group_size=group,
            sym=spec.symmetric,
            quant_method=METHOD.AWQ,
            format=FORMAT.GEMM,
            dynamic=skip or None,
        )
    return QuantizeConfig(
        bits=bits,
        group_size=group,
        sym=spec.symmetric,
        desc_act=spec.desc_act,
        damp_percent=spec.dampening_frac,
        format=FORMAT.GPTQ,
        dynamic=skip or None,
    )


def _pattern(name: str) -> str:
    """llm-compressor's ignore entry (a module name or `re:REGEX`) as a GPTQModel dynamic regex."""
    return name.removeprefix("re:") if name.startswith("re:") else re.escape(name) + "$"


def _cast_unquantized(model, dtype) -> None:
    """The floating-point tensors GPTQModel left unquantized (embeddings, norms, ignored layers) in
    the dtype the checkpoint is saved in, and its config saying so. The quantized layers keep the
    format's own dtypes (int32 packs, float16 scales) whatever the job computed in."""
    import torch
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    if model.config.dtype == dtype:
        return
    cast: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, BaseQuantLinear):
            continue
        # meta ones too: GPTQModel materializes them from the source files in the parameter's dtype;
        # a tied parameter (the output head sharing the embeddings) stays one parameter
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
                module._parameters[name] = cast[id(param)]
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[name] = buffer.to(dtype)
    model.config.dtype = dtype


def _child(job_file: str) -> None:
    """The child: load, quantize with the calibration windows, save."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoTokenizer

    job = json.loads(Path(job_file).read_text())
    spec = (AWQSpec if job["spec"]["method"] == "awq" else GPTQSpec).model_validate(job["spec"])
    with deterministic(job["seed"]):
        model = GPTQModel.load(job["base"], config(spec), dtype=getattr(torch, job["compute"]))
        rows = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in job["calibration"]]
        # the kernel for GPTQModel's own forward passes after each layer (torch: runs on a CPU)
        kernel = (
            BACKEND.AUTO
            if torch.cuda.is_available()
            else BACKEND.AWQ_TORCH
            if spec.format == "awq"
            else BACKEND.GPTQ_TORCH
        )
        model.quantize(rows, batch_size=1, backend=kernel)  # calibration_sort "desc": our windows, in a fixed order
        _cast_unquantized(model.model, getattr(torch, job["dtype"]))
        model.save(job["dest"])
    AutoTokenizer.from_pretrained(job["base"]).save_pretrained(job["dest"])


if __name__ == "__main__":
    _child(sys.argv[1])
