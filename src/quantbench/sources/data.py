"""Text corpora for calibration and evaluation.

- `builtin:python-docs`: Python's own documentation (`pydoc_data.topics`, ~465k characters of
  English prose that every CPython ships). Topics are assigned to a split by a hash of their
  name (one in five to evaluation), so the calibration and evaluation parts are disjoint and
  the same on every machine with the same Python.
- `builtin:numpy-license`: out-of-domain evaluation text, legal English of another kind than the
  Python docs: the licence file the installed numpy ships (`numpy-*.dist-info/LICENSE.txt`: numpy's
  BSD-3 licence, the notices of the libraries its wheel bundles and the text of the GNU GPL v3,
  about 11k tokens). Read where it is installed, never copied; evaluation only: a calibration or
  training field that names it is refused. numpy's wheels append platform-specific notices, so the
  text's sha (part of a suite's fingerprint) can differ between platforms.
- a local `.txt` file (the whole file) or `.jsonl` file (one JSON object a line, `text_field`);
- `hub:DATASET`: a Hugging Face dataset (`split`, `text_field`), only when the hub is reachable.

A user-supplied file is calibration text only: evaluation always scores the builtin evaluation
split unless a later stage names its own corpus.

Windows of token ids (calibration, sensitivity, the quality pass and the reload check) start the
way the model expects: with its BOS token where its tokenizer adds one (`bos_id`), then the next
window - 1 tokens of the text, so that a window keeps its length (`windows`).
"""

from __future__ import annotations

import hashlib
import json
import random
from importlib import metadata
from pathlib import Path
from pydoc_data.topics import topics
from typing import Literal

from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.paths import hub_reachable

BUILTIN_TEXTS = ("python-docs", "numpy-license")
EVALUATION_ONLY = ("numpy-license",)  # out-of-domain evaluation text: never calibration or training
Split = Literal["calibration", "evaluation"]


def python_docs_topics(split: Split) -> list[str]:
    """The topic names of one split: one topic in five (by a hash of its name) is evaluation."""

    def in_evaluation(key: str) -> bool:
        return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0

    return [k for k in sorted(topics) if in_evaluation(k) == (split == "evaluation")]


def python_docs(split: Split) -> str:
    """One split of the Python documentation, topics in sorted order joined by blank lines."""
    return "\n\n".join(topics[k] for k in python_docs_topics(split))


def numpy_license() -> str:
    """The licence file of the installed numpy (see the module docstring)."""
    for file in metadata.distribution("numpy").files or []:
        # numpy-X.dist-info/LICENSE.txt (or .../licenses/LICENSE.txt in newer wheels)
        if file.name == "LICENSE.txt" and (file.parent.name.endswith(".dist-info") or file.parent.name == "licenses"):
            return file.read_text()
    raise UserError("builtin:numpy-license: the installed numpy ships no LICENSE.txt")


def load_text(
    source: str, *, field: str, split: Split = "calibration", text_field: str = "text", hub_split: str = "train"
) -> str:
    """The text a source names (for a builtin, its `split`); UserError naming `field` if unusable."""
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_TEXTS:
            raise UserError(f"{field}: unknown builtin text '{name}'." + did_you_mean(name, BUILTIN_TEXTS))
        if name in EVALUATION_ONLY:
            if split != "evaluation":
                raise UserError(
                    f"{field}: '{source}' is held-out evaluation text (out of domain); it is never used "
                    "for calibration or training. Use builtin:python-docs or a file of your own"
                )
            return numpy_license()
        return python_docs(split)
    if source.startswith("hub:"):
        return _hub_text(source, field, text_field, hub_split)
    path = Path(source).expanduser()
    if not path.is_file():
        raise UserError(
            f"{field}: '{source}' does not exist (expected builtin:python-docs, a .txt/.jsonl file, or hub:DATASET)"
        )
    if path.suffix == ".txt":
        text = path.read_text(errors="replace")
    elif path.suffix == ".jsonl":
        text = _jsonl_text(path, field, text_field)
    else:
        raise UserError(f"{field}: '{source}' must be a .txt or .jsonl file")
    if not text.strip():
        raise UserError(f"{field}: '{source}' is empty")
    return text


def _jsonl_text(path: Path, field: str, text_field: str) -> str:
    texts = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{field}: {path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
            raise UserError(f"{field}: {path}:{number}: no string field '{text_field}' (set calibration.text_field)")
        texts.append(row[text_field])
    return "\n\n".join(texts)


def _hub_text(source: str, field: str, text_field: str, split: str) -> str:
    if not hub_reachable():
        raise UserError(f"{field}: '{source}' needs the Hugging Face hub, which is not reachable from here (offline)")
    from datasets import load_dataset

    rows = load_dataset(source.removeprefix("hub:"), split=split)
    if text_field not in rows.column_names:
        raise UserError(f"{field}: dataset has no column '{text_field}'." + did_you_mean(text_field, rows.column_names))
    return "\n\n".join(rows[text_field])


def calibration_windows(
    token_ids: list[int], samples: int, seq_len: int, seed: int, *, field: str, bos: int | None = None
) -> list[list[int]]:
    """`samples` disjoint windows of `seq_len` tokens, chosen by `seed` from the tokenized text
    (`text_ids`), each starting with `bos` when the tokenizer wants one (`bos_id`)."""
    available = len(token_ids) // span(seq_len, bos)
    if available == 0:
        raise UserError(f"{field}: the text has {len(token_ids)} tokens, fewer than one window of seq_len={seq_len}")
    if samples > available:
        raise UserError(
            f"{field}: asked for {samples} samples of {seq_len} tokens but the text holds only {available} "
            f"such windows ({len(token_ids)} tokens); lower calibration.samples or calibration.seq_len"
        )
    starts = sorted(random.Random(seed).sample(range(available), samples))
    return windows(token_ids, seq_len, bos, starts)


def recipe_windows(tokenizer, text: str, calibration) -> list[list[int]]:
    """A recipe's calibration windows over `text` (`calibration`: its calibration section), as every
    method that calibrates takes them."""
    return calibration_windows(
        text_ids(tokenizer, text),
        calibration.samples,
        calibration.seq_len,
        calibration.seed,
        field="calibration.samples",
        bos=bos_id(tokenizer),
    )


# ---------------------------------------------------------------------------------------------
# Windows that start the way the model expects

BOS_PROBE = "The Python interpreter"


def bos_id(tokenizer) -> int | None:
    """The BOS id every window must start with, or None when the tokenizer adds no BOS to what it encodes.

    Asked of what the tokenizer does, not of its `add_bos_token` attribute: in transformers 5 that
    flag lives only on the object built with it (save_pretrained leaves it out of the config and a
    reload reads False), while the post-processor saved in tokenizer.json goes on adding the BOS.
    So a GGUF's `tokenizer.ggml.add_bos_token` (carried into the converted tokenizer, verify.py),
    a config's `add_bos_token` and a template post-processor all show here the same way."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    added = tokenizer(BOS_PROBE)["input_ids"]
    plain = tokenizer(BOS_PROBE, add_special_tokens=False)["input_ids"]
    return bos if added[:1] == [bos] and plain[:1] != [bos] else None


def bos_tag(tokenizer, bos: int | None) -> str:
    """What windows start with, as a run records it (the quantbench.bos tag): `<s> (id 1)`, or none."""
    return "none" if bos is None else f"{tokenizer.convert_ids_to_tokens(bos)} (id {bos})"


def text_ids(tokenizer, text: str) -> list[int]:
    """The text's token ids with nothing added: a BOS belongs at the start of each window
    (`windows`), not once at the start of the text."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def span(length: int, bos: int | None) -> int:
    """How many of the text's tokens a window of `length` holds: one fewer when it starts with BOS."""
    if bos is not None and length < 2:
        raise ValueError(f"a window of {length} token cannot hold a BOS and a token to predict")
    return length - (bos is not None)


def windows(token_ids: list[int], length: int, bos: int | None, picks=None) -> list[list[int]]:
    """Windows of exactly `length` tokens: `bos` (when not None) and then the next span of the text.
    The text is cut into consecutive spans (`span`; a short tail is left out) and `picks` chooses
    which, by index (default all). The BOS is context only: nothing scores a prediction of it."""
    step = span(length, bos)
    head = [] if bos is None else [bos]
    picks = range(len(token_ids) // step) if picks is None else picks
    return [head + token_ids[i * step : (i + 1) * step] for i in picks]


def framed(token_ids: list[int], length: int, bos: int | None) -> list[int]:
    """The text laid out as its `windows`, one after another, for the quality functions that cut a
    flat list at every `length` tokens (quality.perplexity, reference, compare); without a BOS, the
    text's ids themselves (unchanged)."""
    if bos is None:
        return token_ids
    return [t for window in windows(token_ids, length, bos) for t in window]


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
