"""Compact patterns for sets of layer or tensor names: the tune's mixed-precision candidates name
their layers as llm-compressor targets (tune/candidates.py) and as llama-quantize patterns (tune/gguf.py)."""

from __future__ import annotations

import re


def block_groups(names: list[str]) -> tuple[list[tuple[str, tuple[int, ...], list[str]]], list[str]]:
    """Layer (or tensor) names grouped for compact patterns: (prefix, blocks, kinds) for each set of
    kinds taken in the same blocks (`model.layers`, (0, 3, 7), [self_attn.q_proj, self_attn.k_proj]),
    in order of first appearance, and the names outside numbered blocks."""
    kinds: dict[tuple[str, str], set[int]] = {}
    outside = []
    for name in names:
        match = re.fullmatch(r"(.*?)\.(\d+)\.(.*)", name)
        if match is None:
            outside.append(name)
            continue
        kinds.setdefault((match.group(1), match.group(3)), set()).add(int(match.group(2)))
    together: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for (prefix, suffix), blocks in kinds.items():
        together.setdefault((prefix, tuple(sorted(blocks))), []).append(suffix)
    return [(prefix, blocks, suffixes) for (prefix, blocks), suffixes in together.items()], outside


def targets(layers: list[str]) -> list[str]:
    """Compact targets for a set of layer names: one `re:` pattern per set of layer kinds taken in
    the same blocks (`re:^model\\.layers\\.(0|3|7)\\.self_attn\\.(q_proj|k_proj|v_proj)$`), exact names
    for layers outside blocks."""
    groups, out = block_groups(layers)
    for prefix, blocks, suffixes in groups:
        alternatives = "|".join(map(str, blocks))
        names = re.escape(suffixes[0]) if len(suffixes) == 1 else "(" + "|".join(map(re.escape, suffixes)) + ")"
        out.append(f"re:^{re.escape(prefix)}\\.({alternatives})\\.{names}$")
    return out
