"""Knowledge distillation: a smaller student learns the teacher's next-token distribution.

The teacher is the recipe's `model:`; the student starts from a subset of the teacher's layers
(depth pruning), from the teacher's config with fields changed (random init), or from another
model that shares the tokenizer. The loss is the KL divergence from the teacher's to the
student's distribution at a temperature T (scaled by T^2), optionally mixed with the plain
next-token cross-entropy. transformers' Trainer runs the loop: AdamW, warm-up then linear decay,
bf16 autocast, and checkpoints every `save_steps` into a directory keyed by the recipe's hash, so
an interrupted job resumes from its last checkpoint when the same recipe runs again.

llm-compressor removed its distillation support, so it is not the library here; TRL's GKD
trainer adds on-policy generation this job does not need, so the Trainer is used directly.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from quantbench.core.errors import UserError
from quantbench.core.logs import relay
from quantbench.core.measures import compare, reference
from quantbench.quantize import Inputs, Produced, Quantizer
from quantbench.recipe import short
from quantbench.recipe.methods import DistillSpec
from quantbench.sources import data, models
from quantbench.sources.checkpoint import vocab_mismatch
from quantbench.tracking import TAG

log = logging.getLogger(__name__)
# the Trainer's bar (no description: "45%|####  | 81/180 [07:12<08:48]") is the training's progress: one bar of ours
relay(r"^\s*\d+%\|[^|]*\| *(\d+)/(\d+) \[", "distill (steps)", "step")

PREFIX = "distill/"  # MLflow metric prefix of the training curves


class DistillQuantizer(Quantizer):
    """A student trained against the loaded base model (the teacher), saved in bf16."""

    library = "transformers Trainer"
    format = "safetensors-bf16"
    calibrates = False
    trains = True
    on_load = False
    takes_model = True  # the base is the teacher

    @staticmethod
    def loaders() -> str:
        return f"plain bf16 safetensors (transformers {transformers.__version__}) — transformers, vLLM, SGLang"

    def __init__(self, spec: DistillSpec):
        self.spec = spec
        self.train_ids: list[int] = []
        self.bos: int | None = None
        self.student_base: models.ResolvedModel | None = None
        self.keep: list[int] | None = None
        self.init = ""

    def quantization_config(self) -> None:
        return None  # a plain 16-bit model

    # -----------------------------------------------------------------------------------------
    # prepare: every check before the run starts

    def check(self, loaded, config) -> list[str]:
        return []

    def prepare(self, loaded, teacher: models.ResolvedModel, tokenizer) -> dict[str, str]:
        """Check the student initialisation and read the training text; returns its sha."""
        from transformers import AutoConfig, AutoTokenizer

        spec, where = self.spec, str(loaded.path)
        config = AutoConfig.from_pretrained(teacher.path)
        student = spec.student
        if student.layers is not None:
            depth = config.num_hidden_layers
            keep = list(range(0, depth, 2)) if student.layers == "every-other" else list(student.layers)
            bad = [i for i in keep if i >= depth]
            if bad:
                raise UserError(
                    f"{where}: {loaded.where('quantize', 'student', 'layers')}: the teacher has "
                    f"{depth} layers (0..{depth - 1}); no layer {', '.join(map(str, bad))}"
                )
            self.keep = sorted(keep)
            self.init = f"{len(keep)} of the teacher's {depth} layers ({_ranges(self.keep)})"
        elif student.config is not None:
            unknown = [k for k in student.config if not hasattr(config, k)]
            if unknown:
                raise UserError(
                    f"{where}: {loaded.where('quantize', 'student', 'config')}: the teacher's config "
                    f"({type(config).__name__}) has no field {', '.join(unknown)}"
                )
            if student.config.get("vocab_size", config.vocab_size) != config.vocab_size:
                raise UserError(
                    f"{where}: {loaded.where('quantize', 'student', 'config')}: vocab_size must stay "
                    f"{config.vocab_size}: the student learns the teacher's distribution over its vocabulary"
                )
            self.init = (
                "the teacher's config with "
                + ", ".join(f"{k}={short(v)}" for k, v in student.config.items())
                + " (random init)"
            )
        else:
            try:
                self.student_base = models.resolve(student.source, field="quantize.student.source")
            except UserError as exc:
                raise UserError([f"{where}: {p}" for p in exc.problems]) from None
            other = AutoTokenizer.from_pretrained(self.student_base.path)
            mismatch = vocab_mismatch(tokenizer, other, config, AutoConfig.from_pretrained(self.student_base.path))
            if mismatch:
                raise UserError(
                    f"{where}: {loaded.where('quantize', 'student', 'source')}: {student.source} does "
                    f"not share the teacher's tokenizer ({mismatch}); distillation compares "
                    "distributions token by token, so the vocabularies must be the same"
                )
            self.init = f"`{student.source}`"
        try:
            text = data.load_text(
                spec.data.source,
                field="quantize.data.source",
                text_field=spec.data.text_field,
                hub_split=spec.data.split,
            )  # builtin: the training split, never evaluation
        except UserError as exc:
            raise UserError([f"{where}: {p}" for p in exc.problems]) from None
        self.train_ids = data.text_ids(tokenizer, text)
        self.bos = data.bos_id(tokenizer)  # training windows start as the model expects, like every other window
        if len(self.train_ids) <= spec.seq_len:
            raise UserError(
                f"{where}: {loaded.where('quantize', 'seq_len')}: {spec.seq_len} is longer than the "
                f"training text ({len(self.train_ids)} tokens)"
            )
        return {"training": data.text_sha(text)}

    # -----------------------------------------------------------------------------------------
    # train

    def student(self, teacher) -> torch.nn.Module:
        """The untrained student, float32."""
        from transformers import AutoModelForCausalLM

        spec = self.spec.student
        if self.student_base is not None:
            return AutoModelForCausalLM.from_pretrained(self.student_base.path, dtype=torch.float32)
        config = teacher.config.__class__.from_dict(teacher.config.to_dict())
        if spec.config is not None:
            for key, value in spec.config.items():
                setattr(config, key, value)
            torch.manual_seed(self.spec.seed)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        assert self.keep is not None  # chosen in prepare for a pruned student
        return prune_layers(teacher, self.keep)

    def produce(self, inputs: Inputs) -> Produced:
        """Train the student, save it into the staging dir; the reload check bounds the saved
        student against the trained one in memory (`distill/ppl_after`, same text and windows)."""
        student, summary = self.train(inputs.take_model(), inputs.run, inputs.workdir, inputs.held_out)
        self.save(student, inputs.tokenizer, inputs.staging)
        return Produced(metrics=summary, reference_ppl=summary["distill/ppl_after"], card=self.card(inputs.base))

    def train(
        self, teacher, run, workdir: Path, held_out: tuple[list[int], int]
    ) -> tuple[torch.nn.Module, dict[str, float]]:
        """Train a student against `teacher`; checkpoints in `workdir` (resumed if any are there).
        `held_out` (token ids, window) scores the student against the teacher before and after
        training (`distill/kld_before`, `distill/kld_after`, `distill/ppl_*`). Returns the student
        and the run's distill/* summary metrics."""
        spec = self.spec
        teacher = teacher.float().eval().requires_grad_(False)  # bf16 autocast still runs its matmuls
        student: Any = self.student(teacher).eval()  # a transformers model (its config, its generation_config)
        student.config.use_cache = False
        student.generation_config = teacher.generation_config
        counts = {"distill/student_params": _params(student), "distill/teacher_params": _params(teacher)}
        log.info(
            "student: %s, %.1fM parameters (teacher %.1fM)",
            self.init,
            counts["distill/student_params"] / 1e6,
            counts["distill/teacher_params"] / 1e6,
        )
        ref = reference(teacher, *held_out)
        before = compare(student, *held_out, ref).metrics()
        counts.update({"distill/kld_before": before["quality/kld_mean"], "distill/ppl_before": before["quality/ppl"]})
        log.info(
            "untrained student: KLD to the teacher %.3f, perplexity %.1f",
            before["quality/kld_mean"],
            before["quality/ppl"],
        )
        run.log_metrics(counts)
        windows = training_windows(self.train_ids, spec.steps * spec.batch_size, spec.seq_len, spec.seed, self.bos)
        resume = last_checkpoint(workdir)
        start_step = _resumed_step(resume, spec.steps, run)
        args = self._training_arguments(workdir)
        trainer = DistillTrainer(
            teacher=teacher,
            temperature=spec.temperature,
            lm_loss_weight=spec.lm_loss_weight,
            tokens_per_step=spec.batch_size * spec.seq_len,
            run=run,
            model=student,
            args=args,
            train_dataset=windows,
        )
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        wall = time.perf_counter() - started
        trained_steps = trainer.state.global_step - start_step
        after = compare(student.eval(), *held_out, ref).metrics()
        summary = {
            **counts,
            "distill/kld_after": after["quality/kld_mean"],
            "distill/ppl_after": after["quality/ppl"],
            "distill/wall_s": wall,
            "distill/final_loss": trainer.last_loss if trainer.last_loss is not None else result.training_loss,
            "distill/steps": trainer.state.global_step,
            "distill/tokens": trainer.state.global_step * spec.batch_size * spec.seq_len,
            "distill/tokens_per_s": trained_steps * spec.batch_size * spec.seq_len / wall,
        }
        log.info(
            "trained %d steps in %.0f s (%.0f tokens/s), last logged loss %.4f; KLD to the teacher %.3f -> %.3f",
            trainer.state.global_step,
            wall,
            summary["distill/tokens_per_s"],
            summary["distill/final_loss"],
            summary["distill/kld_before"],
            summary["distill/kld_after"],
        )
        student.config.use_cache = True
        return student.eval(), summary

    def _training_arguments(self, workdir: Path):
        """transformers' TrainingArguments for the recipe: checkpoints into `workdir`, seeded, on the CPU
        where there is no GPU, bfloat16 autocast where the recipe asks for it."""
        from transformers import TrainingArguments

        spec = self.spec
        return TrainingArguments(
            output_dir=str(workdir),
            max_steps=spec.steps,
            per_device_train_batch_size=spec.batch_size,
            learning_rate=spec.learning_rate,
            warmup_steps=spec.warmup_steps,
            weight_decay=spec.weight_decay,
            lr_scheduler_type="linear",
            bf16=spec.autocasts(),
            logging_steps=spec.log_steps,
            save_steps=spec.save_steps,
            save_total_limit=2,
            seed=spec.seed,
            data_seed=spec.seed,
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            remove_unused_columns=False,
            disable_tqdm=False,
        )

    def save(self, model, tokenizer, dest: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(dest)
        tokenizer.save_pretrained(dest)

    def card(self, teacher: models.ResolvedModel) -> str:
        spec = self.spec
        mix = f"{1 - spec.lm_loss_weight:g}·KD + {spec.lm_loss_weight:g}·LM" if spec.lm_loss_weight else "KD only"
        return (
            f"- Distilled from the teacher {teacher.name} (`{teacher.source}`); student initialised from {self.init}\n"
            f"- Loss: KL(teacher ‖ student) at temperature {spec.temperature:g} ({mix}); "
            f"{spec.steps} steps × {spec.batch_size} × {spec.seq_len} tokens of `{spec.data.source}`"
            f"{' (training split)' if spec.data.source.startswith('builtin:') else ''}, lr {spec.learning_rate:g}, "
            f"warm-up {spec.warmup_steps}, seed {spec.seed}"
        )


class DistillTrainer(transformers.Trainer):
    """Trainer whose loss is distillation from a frozen teacher; logs its parts to MLflow."""

    def __init__(self, *, teacher, temperature: float, lm_loss_weight: float, tokens_per_step: int, run, **kwargs):
        super().__init__(**kwargs)
        self.teacher = teacher
        self.temperature = temperature
        self.lm_loss_weight = lm_loss_weight
        self.tokens_per_step = tokens_per_step
        self.run = run
        self.parts: dict[str, list[float]] = {"kd_loss": [], "lm_loss": []}
        self.last_loss: float | None = None
        self.clock = (time.perf_counter(), 0)  # (time, global step) at the last log

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        import torch.nn.functional as F

        ids = inputs["input_ids"]
        # accelerate autocasts the student's forward (bf16: true); the teacher is not "prepared",
        # so it gets the same autocast here (measured: 2.3x faster teacher forwards on this CPU)
        with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            target = self.teacher(input_ids=ids).logits.float()
        outputs = model(input_ids=ids)
        logits = outputs.logits.float()
        t = self.temperature
        kd = (
            F.kl_div(
                F.log_softmax(logits / t, -1).flatten(0, 1),
                F.log_softmax(target / t, -1).flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
            * t
            * t
        )
        lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss = (1 - self.lm_loss_weight) * kd + self.lm_loss_weight * lm
        self.parts["kd_loss"].append(kd.item())
        self.parts["lm_loss"].append(lm.item())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.parts["kd_loss"]:
            for key, values in self.parts.items():
                logs[key] = sum(values) / len(values)
                values.clear()
            now, step = time.perf_counter(), self.state.global_step
            if step > self.clock[1]:
                logs["tokens_per_s"] = (step - self.clock[1]) * self.tokens_per_step / (now - self.clock[0])
            self.clock = (now, step)
            self.last_loss = logs["loss"]
        super().log(logs, start_time)  # into state.log_history: a resumed run replays it
        if "loss" in logs:
            self.run.log_metrics(_curve({**logs, "step": self.state.global_step}), step=self.state.global_step)


def _resumed_step(resume: Path | None, steps: int, run) -> int:
    """The step a resumed training starts from (0 when fresh); the curve so far goes into `run`."""
    if resume is None:
        return 0
    state = json.loads((resume / "trainer_state.json").read_text())
    log.info("resuming from %s (step %d of %d)", resume, state["global_step"], steps)
    run.set_tags({TAG + "resumed_from_step": state["global_step"]})
    for entry in state.get("log_history", []):  # the curve so far, into this run
        run.log_metrics(_curve(entry), step=entry["step"])
    return state["global_step"]


def _curve(entry: dict) -> dict[str, float]:
    """A Trainer log entry -> the distill/* curve metrics."""
    names = {
        "loss": "loss",
        "kd_loss": "kd_loss",
        "lm_loss": "lm_loss",
        "learning_rate": "learning_rate",
        "grad_norm": "grad_norm",
        "tokens_per_s": "step_tokens_per_s",
    }
    return {PREFIX + out: float(entry[key]) for key, out in names.items() if isinstance(entry.get(key), (int, float))}


def prune_layers(teacher, keep: list[int]) -> torch.nn.Module:
    """A copy of `teacher` with only the decoder layers at `keep` (float32)."""
    from transformers import AutoModelForCausalLM

    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    renamed = {}
    for key, value in teacher.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in keep:
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{keep.index(index)}.", 1)
        renamed[key] = value.float()
    missing, unexpected = student.load_state_dict(renamed, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"pruning did not map the weights one to one: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    student.tie_weights()
    return student


def training_windows(ids: list[int], count: int, seq_len: int, seed: int, bos: int | None = None) -> list[dict]:
    """`count` windows of `seq_len` tokens at seeded random offsets (the text is reused as needed),
    each starting with `bos` when the tokenizer wants one (data.span: the text then fills seq_len - 1)."""
    rng = random.Random(seed)
    step = data.span(seq_len, bos)
    head = [] if bos is None else [bos]
    starts = [rng.randrange(0, len(ids) - step + 1) for _ in range(count)]
    return [{"input_ids": torch.tensor(head + ids[s : s + step])} for s in starts]


def last_checkpoint(workdir: Path) -> Path | None:
    """The newest complete Trainer checkpoint in `workdir` (one with its trainer_state.json)."""
    done = [p for p in workdir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.rsplit("-", 1)[1]), default=None)


def _params(model) -> float:
    """Parameters, each tensor once (tied ones share storage), as the float a metric is."""
    return float(sum({p.data_ptr(): p.numel() for p in model.parameters()}.values()))


def _ranges(indices: list[int]) -> str:
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if len(indices) > 2 and all(b - a == step for a, b in zip(indices, indices[1:])):
        return f"{indices[0]}..{indices[-1]} step {step}"
    return ", ".join(map(str, indices))
