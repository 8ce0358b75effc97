"""llama.cpp's own quantization: the base model's F16 GGUF, quantized by `llama-quantize`.

The checkpoint directory holds one `model.gguf` (what llama.cpp, Ollama and LM Studio load),
beside it the config.json and tokenizer files transformers reads (its quantization_config says
`gguf` and names the type) and the card. An importance matrix (`imatrix: true`) is computed by
`llama-imatrix` on the recipe's calibration windows, written out as text (never the evaluation
split). The card lists the type llama-quantize actually wrote for every tensor: K- and I-quants
need rows that are multiples of 256, and tensors that are not fall back to other types (the
default model's hidden size, 576, is not), so a recipe's name is not the whole truth.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

from quantbench.core.errors import UserError
from quantbench.engines import llamacpp
from quantbench.engines import llamacpp_build as build
from quantbench.quantize import (
    CHILD_RUNTIME,
    LLAMACPP_RUNTIME,
    Inputs,
    Produced,
    ProduceFootprint,
    Quantizer,
    calibration_card,
)
from quantbench.recipe import schemes
from quantbench.recipe.methods import GGUFSpec
from quantbench.sources.checkpoint import gguf_tensors
from quantbench.sources.models import source_gguf

log = logging.getLogger(__name__)

FILE = "model.gguf"
# Bits per weight of a whole model file in each llama-quantize type, as llama.cpp's quantize tool
# lists them for a 7-8B Llama (the embeddings and head take their own types): for the memory and
# disk plan before anything is quantized. Types not listed: 16.
NOMINAL_BITS = {
    "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q2_K": 3.35, "Q2_K_S": 3.2,
    "Q3_K_S": 3.5, "Q3_K_M": 3.91, "Q3_K_L": 4.27, "Q4_K_S": 4.58, "Q4_K_M": 4.85, "Q5_K_S": 5.54,
    "Q5_K_M": 5.69, "Q6_K": 6.56, "IQ1_S": 1.56, "IQ1_M": 1.75, "IQ2_XXS": 2.06, "IQ2_XS": 2.31,
    "IQ2_S": 2.5, "IQ2_M": 2.7, "IQ3_XXS": 3.06, "IQ3_XS": 3.3, "IQ3_S": 3.44, "IQ3_M": 3.66,
    "IQ4_NL": 4.5, "IQ4_XS": 4.25, "TQ1_0": 1.69, "TQ2_0": 2.06,
}  # fmt: skip


def file_bytes(file_type: str, shape) -> int:
    """The size of a model (`shape`, sources.shapes.Shape) quantized into a llama-quantize type.
    MXFP4_MOE (llama.cpp's llama-quant.cpp): a mixture of experts' 3-D expert tensors MXFP4, every
    other tensor Q8_0 (all of them in a dense model), each at its block's stored size."""
    if file_type.upper() == "MXFP4_MOE":
        experts, rest = schemes.GGUF_TUNE_TYPES["MXFP4"], schemes.GGUF_TUNE_TYPES["Q8_0"]
        return int(
            shape.expert_params * experts.bytes_per_block / experts.block
            + (shape.params - shape.expert_params) * rest.bytes_per_block / rest.block
        )
    return int(shape.params * NOMINAL_BITS.get(file_type.upper(), 16.0) / 8)


class GGUFQuantizer(Quantizer):
    library = "llama.cpp"
    format = "gguf"
    trains = False
    on_load = False
    takes_model = False  # llama.cpp reads the base's GGUF file, not this process's model
    mixes_per_layer = True  # a type per tensor (llama-quantize's --tensor-type)

    def __init__(self, spec: GGUFSpec):
        self.spec = spec
        self.calibrates = spec.imatrix
        self.tools: build.Tools  # set by prepare
        self.base: Path  # the base's F16 GGUF, set by prepare

    def quantization_config(self) -> dict:
        return {"quant_method": "gguf", "type": self.spec.scheme}

    @staticmethod
    def loaders() -> str:
        return "llama.cpp (llama-server, llama-cli), Ollama, LM Studio; transformers (+gguf, de-quantized on load)"

    def check(self, loaded, config) -> list[str]:
        tools, _ = build.find()
        if tools is None and (missing := build.missing_compilers()):
            return [
                f"{loaded.path}: {loaded.where('quantize', 'method')}: gguf needs llama.cpp, which is not built and "
                f"cannot be built here: no {', '.join(missing)} (Debian/Ubuntu: apt-get install build-essential cmake)"
            ]
        empty = [t for t, patterns in self.spec.layers.items() if not patterns]
        if empty:
            return [f"{loaded.path}: {loaded.where('quantize', 'layers')}: {', '.join(empty)} lists no tensors"]
        return []

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        """llama.cpp's tools (built on first use) and the base as an F16 GGUF (converted once,
        cached, its tokenizer verified), before any run exists: a model llama.cpp cannot convert
        is refused here (exit 2)."""
        self.tools = build.ensure("quantizing with llama.cpp")
        self.base = llamacpp.base_gguf(base.path, self.tools)
        unfit = [] if self.spec.fallback else llamacpp.unfit(self.base, self.spec.layers)
        if unfit:
            raise UserError(
                f"{loaded.path}: {loaded.where('quantize', 'layers')}: {len(unfit)} tensor(s) cannot hold the type "
                f"given them: {'; '.join(unfit[:4])}{' ...' if len(unfit) > 4 else ''}. llama-quantize would write "
                "another type instead; give them a type with blocks of 32 (Q4_0 ... Q8_0, IQ4_NL), or set "
                "quantize.fallback: true to let it"
            )
        return {}

    def prepared(self, base) -> bool:
        return llamacpp.base_gguf_path(base.path, base.fingerprint).is_file()

    def footprint(self, shape, loaded, compute: str) -> ProduceFootprint:
        """llama-imatrix maps the base's F16 GGUF and reads all of it at every window; llama-quantize
        then rounds a tensor at a time: its largest read as F16, converted to float32 and written
        (measured at 8B: Q8_0's produce 1.97 GiB with the job, 0.54 of it file pages, where the whole
        13.75 GiB file was planned). The F16 file is made once in prepare (llama.cpp's converter, a
        child process reading the safetensors) and kept in quantbench's cache."""
        f16 = shape.params * 2
        largest = max(shape.vocab, shape.intermediate) * shape.hidden
        size = file_bytes(self.spec.type, shape)
        out = size / shape.params  # bytes a weight, written
        held = [("llama-quantize, its largest tensor as F16, in float32 and written", int(largest * (2 + 4 + out))),
                ("llama.cpp", LLAMACPP_RUNTIME)]  # fmt: skip
        if self.spec.imatrix:  # before llama-quantize, and larger
            cal = loaded.recipe.calibration
            held = [("llama-imatrix mapping the base's F16 GGUF", f16), ("llama.cpp", LLAMACPP_RUNTIME),
                    ("llama-imatrix's activations", shape.window_activations(cal.seq_len))]  # fmt: skip
        # the converter reads the safetensors lazily, a tensor at a time: its largest in float32 and
        # as written (measured: 1.7 GiB for the job at 1B, 2.4 GiB at 8B, where the whole model was planned)
        converter = [("llama.cpp's converter, its largest tensor in float32 and F16", largest * 6),
                     ("the converter's Python", CHILD_RUNTIME)]  # fmt: skip
        # transformers' GGUF reader de-quantizes every tensor to float32 before the model takes it,
        # and a mixture of experts' stacked experts are gathered whole: measured in the job on the
        # moe-8x rung, the check held 0.66 GiB of anonymous memory beyond the runtime and the model
        # (Q8_0 and Q4_K_M alike; the experts are 0.56 GiB in 16 bits), counted as the experts in 16 bits
        stacked = shape.expert_params * 2
        return ProduceFootprint(
            held,
            size,
            takes_model=False,
            prepare_held=converter,
            prepare_disk=f16,
            reload_held=[("the experts as the GGUF reader gathers them", stacked)],
        )

    def produce(self, inputs: Inputs) -> Produced:
        inputs.drop_model()  # llama.cpp reads files, not this process's model
        spec = self.spec
        tools, base = self.tools, self.base
        cmd = [tools.tool("llama-quantize")]
        imatrix_line = "- Importance matrix: none"
        if spec.imatrix:
            imatrix = self.imatrix(inputs, tools, base)
            cmd += ["--imatrix", str(imatrix)]
            imatrix_line = (
                f"- Importance matrix: `llama-imatrix` on {len(inputs.calibration or [])} calibration windows"
            )
        for tensor_type, patterns in spec.layers.items():
            for pattern in patterns:
                cmd += ["--tensor-type", f"{pattern}={tensor_type.lower()}"]
        out = inputs.staging / FILE
        cmd += [str(base), str(out), spec.type, str(llamacpp.threads())]
        llamacpp.run_tool(cmd, inputs.log_path, f"llama-quantize to {spec.type}")
        self.write_companions(inputs, out)
        written = collections.Counter(kind for _, kind, _, _ in gguf_tensors(out))
        types = ", ".join(f"{kind} ×{n}" for kind, n in written.most_common())
        log.info("%s written: %s", FILE, types)
        card = [
            f"- llama.cpp type: {spec.type} (`llama-quantize`, {tools.describe()}) from the base's {llamacpp.BASE_TYPE} GGUF",
            imatrix_line,
            calibration_card(inputs) if spec.imatrix else "- Calibration: none",
            f"- Tensor types written: {types} (K- and I-quants need rows that are multiples of 256; "
            "other tensors fall back to another type)",
        ]
        if spec.layers:
            card.append(
                "- Per-tensor types asked: " + "; ".join(f"{t}: {', '.join(p)}" for t, p in spec.layers.items())
            )
        source_note = self.source_note(inputs.base.path)
        if source_note:
            card.append(source_note)
        return Produced(card="\n".join(card))

    def imatrix(self, inputs: Inputs, tools: build.Tools, base: Path) -> Path:
        """llama-imatrix over the calibration windows (decoded to text, one chunk per window)."""
        seq_len = inputs.loaded.recipe.calibration.seq_len
        windows = inputs.calibration or []
        return llamacpp.imatrix(tools, base, inputs.tokenizer, windows, seq_len, inputs.workdir, inputs.log_path)

    def write_companions(self, inputs: Inputs, gguf: Path) -> None:
        """config.json (read from the file by transformers, its quantization_config naming the
        file and type) and the base's tokenizer (the file's own was verified equal to it)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config.save_pretrained(gguf.parent)
        path = gguf.parent / "config.json"
        data = json.loads(path.read_text())
        data["quantization_config"] = {"quant_method": "gguf", "type": self.spec.type, "file": gguf.name}
        data["dtype"] = inputs.loaded.recipe.model.dtype  # what it de-quantizes to by default, as other formats
        path.write_text(json.dumps(data, indent=2))
        inputs.tokenizer.save_pretrained(gguf.parent)

    def source_note(self, base_path: Path) -> str:
        """The trap of re-quantizing a model that itself came from a quantized GGUF."""
        source = source_gguf(base_path)
        if source is None:
            return ""
        kinds = collections.Counter(kind for name, kind, _, _ in gguf_tensors(source) if name.startswith("blk."))
        main = kinds.most_common(1)[0][0] if kinds else "?"
        target = self.spec.type.split("_")[0]
        same = main.startswith(target) or (main.startswith("Q4") and target.startswith(("Q5", "Q6", "Q8")))
        note = f"- Source: the base model was converted from a GGUF whose blocks are mostly {main}"
        if same:
            note += (
                f"; {self.spec.type} holds that grid (or a finer one), so part of its fidelity comes from the source "
                "having been quantized already: a model that never was would lose more"
            )
        return note
