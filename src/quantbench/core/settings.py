"""YAML settings text read safely: bounded in size and in alias expansion, a key given twice
refused (YAML would silently keep the last), errors naming the file and line. Recipes, suites,
profiles, policies, sweeps, stacks and model cards are all read through `parse_yaml`, their files
through `read_settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from quantbench.core.errors import UserError

# A settings file is small. These bound what one may become once parsed: YAML aliases let a few
# lines stand for gigabytes (an "alias bomb"), which validation or an error message would expand.
MAX_YAML_BYTES = 1_000_000


MAX_YAML_VALUES = 50_000  # scalars, lists and mappings, counted with every alias expanded


def read_settings(path: Path) -> str:
    """A settings file's text, decoded as UTF-8 whatever the locale says; UserError naming the file
    when it cannot be read or is not UTF-8 text (a file saved in Latin-1, or not text at all)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None


def parse_yaml(text: str, where: str, unique_keys: bool = True) -> tuple[Any, yaml.Node | None]:
    """Parse YAML text (and its node tree, for line numbers), refusing text that is too large or
    that becomes too large once its aliases are expanded, and (`unique_keys`) a key given twice in
    one mapping, where YAML would silently keep the last. UserError naming `where`."""
    if len(text) > MAX_YAML_BYTES:
        raise UserError(f"{where}: {len(text):,} characters; a settings file is small (at most {MAX_YAML_BYTES:,})")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        size = _expanded_size(node, {})
        if size > MAX_YAML_VALUES:
            raise UserError(
                f"{where}: the YAML expands to {size:,} values, more than {MAX_YAML_VALUES:,}: its aliases "
                "(*name) repeat anchored (&name) values many times over; write the values out"
            )
        duplicates = _duplicate_keys(node, set()) if unique_keys else []
        if duplicates:
            raise UserError([f"{where}: {d}" for d in duplicates])
        return yaml.safe_load(text), node
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: {_yaml_error(exc)}") from None
    except RecursionError:
        raise UserError(f"{where}: the YAML is nested too deeply") from None


def _duplicate_keys(node: yaml.Node | None, seen: set[int], path: tuple[str, ...] = ()) -> list[str]:
    """`quantize.method: given twice (lines 2 and 5); YAML keeps only the last` for every mapping
    key written more than once (each node visited once: aliases share theirs)."""
    if node is None or id(node) in seen:
        return []
    seen.add(id(node))
    found = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
            if name is not None and name != "<<":  # a merge key may repeat
                line = key.start_mark.line + 1
                if name in first:
                    field = ".".join((*path, name))
                    found.append(
                        f"{field}: given twice (lines {first[name]} and {line}); YAML would keep only the "
                        "last: remove one"
                    )
                else:
                    first[name] = line
            found += _duplicate_keys(value, seen, (*path, name or "?"))
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            found += _duplicate_keys(value, seen, (*path, str(i)))
    return found


def _expanded_size(node: yaml.Node | None, memo: dict[int, int]) -> int:
    """How many values `node` stands for with every alias expanded (shared nodes counted each time
    they are referred to; computed once per node)."""
    if node is None:
        return 0
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node that refers to itself (a cycle) stops here
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}YAML syntax error: {problem}"


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"quantize": {"group_size": 64}} -> {"quantize.group_size": 64}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
