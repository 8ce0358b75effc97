"""How far one unit quantized alone moves a model's output: the units (the layers that read one
input, found from a forward pass), a scheme's rounding of their weights and inputs, and the two
measures of sensitivity.py: the measured KLD (`measured_kld`, replayed from the unit's block) and
its second-order proxy (`fisher_proxy`). sensitivity.py chooses the windows, calls these and stores
what they return."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from quantbench.core.logs import terminal
from quantbench.recipe import schemes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _under(mode: str):
    """The function runs under torch's `mode` (inference_mode, no_grad), torch imported when it is
    called: tune's modules load without torch (`quantbench --help` imports them)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            import torch

            with getattr(torch, mode)():
                return fn(*args, **kwargs)

        return inner

    return wrap


@dataclass
class Unit:
    name: str  # the layer's name, or the block prefix + the fused layers' short names (self_attn.q+k+v_proj)
    layers: list[str]
    in_features: int
    out_features: list[int]
    block: int | None  # index of the decoder block it sits in

    @property
    def params(self) -> int:
        return sum(self.in_features * out for out in self.out_features)

    def bits(self, scheme: schemes.Scheme, dtype_bits: int = 16) -> float | None:
        """Total stored bits of the unit under `scheme`; None when the scheme does not fit."""
        if not scheme.fits(self.in_features):
            return None
        return sum(scheme.bits(self.in_features, out, dtype_bits) * self.in_features * out for out in self.out_features)

    @property
    def kind(self) -> str:
        """The unit's name without its block index (self_attn.q+k+v_proj), for the heat map."""
        return re.sub(r"^.*?\.\d+\.", "", self.name) if self.block is not None else self.name


@_under("inference_mode")
def find_units(model, ids: torch.Tensor, fuse: bool = True) -> list[Unit]:
    """The model's quantizable Linear layers (all but the output head) in forward order, grouped
    into units: layers of one block that receive the very same input tensor (with `fuse`; without,
    every layer is a unit of its own)."""
    import torch

    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    seen: dict[str, tuple] = {}
    order: list[str] = []
    hooks = []
    for name, module in linears.items():

        def hook(mod, args, name=name):
            x = args[0]
            seen[name] = (x.data_ptr(), tuple(x.shape), x.stride())
            order.append(name)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    units: list[Unit] = []
    by_input: dict[tuple, Unit] = {}
    for name in order:
        module = linears[name]
        parent = name.rsplit(".", 1)[0]
        key_ = (parent, seen[name]) if fuse else (name,)
        block = _block_index(name)
        if key_ in by_input:
            unit = by_input[key_]
            unit.layers.append(name)
            unit.out_features.append(module.out_features)
            continue
        unit = Unit(name, [name], module.in_features, [module.out_features], block)
        by_input[key_] = unit
        units.append(unit)
    for name in linears:  # a layer the forward never reached (unused): a unit of its own, last
        if name not in seen:
            units.append(
                Unit(name, [name], linears[name].in_features, [linears[name].out_features], _block_index(name))
            )
    for unit in units:
        if len(unit.layers) > 1:
            parent = unit.layers[0].rsplit(".", 1)[0]
            unit.name = f"{parent}.{'+'.join(n.rsplit('.', 1)[1] for n in unit.layers)}"
    return units


def _block_index(name: str) -> int | None:
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def fake_quantize_weight(weight: torch.Tensor, scheme: schemes.Scheme, layer: str = "", rounding=None) -> torch.Tensor:
    """Round-to-nearest with min-max scales, through compressed-tensors' qparams and QDQ (NVFP4's FP8
    group scales under its float32 scale of the whole tensor, MXFP4's powers of two, as
    llm-compressor computes them); a llama.cpp type rounds as llama.cpp does (a type only
    llama-quantize quantizes, or any with an importance matrix: as `rounding` reads the layer's
    tensor back from its file)."""
    if rounding is not None and rounding.rounds(scheme):
        return rounding(layer, weight, scheme.name)
    if isinstance(scheme, schemes.GgufType):
        return scheme.fake_quantize(weight)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = QuantizationArgs(**scheme.weights)
    w = weight.detach().float()
    global_scale = None
    if scheme.group_size:
        grouped = w.view(w.shape[0], -1, scheme.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        if args.strategy == "tensor_group":  # NVFP4
            global_scale = generate_gparam(w.amin(), w.amax())
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    return fake_quantize(w, scale, zero, args, global_scale=global_scale).to(weight.dtype)


def fake_quantize_tokens(x: torch.Tensor, activations: dict) -> torch.Tensor:
    """Dynamic per-token quantization of a layer's input, as the serving kernels do it."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**activations)
    flat = x.float().reshape(-1, x.shape[-1])
    scale, zero = calculate_qparams(flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True), args)
    return fake_quantize(flat, scale, zero, args).reshape(x.shape).to(x.dtype)


class _Quantized:
    """Within the block, the unit's layers run with the scheme's weights (and activations)."""

    def __init__(self, modules: dict, unit: Unit, scheme: schemes.Scheme, rounding=None):
        self.modules, self.unit, self.scheme, self.rounding = modules, unit, scheme, rounding

    def __enter__(self):
        self.saved, self.hooks = {}, []
        for name in self.unit.layers:
            module = self.modules[name]
            self.saved[name] = module.weight.data
            module.weight.data = fake_quantize_weight(module.weight.data, self.scheme, name, self.rounding)
            if self.scheme.activations:
                acts = self.scheme.activations
                self.hooks.append(
                    module.register_forward_pre_hook(lambda m, args: (fake_quantize_tokens(args[0], acts), *args[1:]))
                )
        return self

    def __exit__(self, *exc):
        for name, weight in self.saved.items():
            self.modules[name].weight.data = weight
        for h in self.hooks:
            h.remove()


def _decoder_layers(model) -> torch.nn.ModuleList | None:
    import torch

    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


class _Replay:
    """Logits of the model from block `b` on, given block b's cached input: the decoder's layer
    list is cut to layers[b:] and the cached hidden states go in as `inputs_embeds`. `check()`
    proves on the unperturbed model that this reproduces its own logits; where it does not (an
    architecture that scales its embeddings, say), every measurement runs the full forward."""

    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids = model, ids
        self.layers = _decoder_layers(model)
        self.inputs: list[torch.Tensor] = []
        self.ok = False
        if self.layers is None:
            return
        hooks = [layer.register_forward_pre_hook(self._keep, with_kwargs=True) for layer in self.layers]
        try:
            self.base_logits = model(input_ids=ids).logits.float()
        finally:
            for h in hooks:
                h.remove()

    def _keep(self, module, args, kwargs):
        self.inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

    def logits(self, block: int | None) -> torch.Tensor:
        import torch

        if not self.ok or block is None or block == 0:
            return self.model(input_ids=self.ids).logits.float()
        full = self.layers
        inner = _decoder_layers(self.model)
        owner = getattr(self.model, getattr(self.model, "base_model_prefix", "model"))
        owner.layers = torch.nn.ModuleList(list(full)[block:])
        try:
            return self.model(inputs_embeds=self.inputs[block]).logits.float()
        finally:
            owner.layers = inner

    def check(self) -> str:
        import torch

        if self.layers is None or len(self.inputs) != len(self.layers):
            return "full forward (no decoder layer list found)"
        self.ok = True
        for block in sorted({1, len(self.layers) // 2, len(self.layers) - 1} - {0}):
            if not torch.allclose(self.logits(block), self.base_logits, atol=1e-3, rtol=1e-3):
                self.ok = False
                return f"full forward (replaying from block {block} did not reproduce the model's logits)"
        return "from the unit's block (checked against the model's own logits)"


@_under("inference_mode")
def measured_kld(model, modules, ids, units, scheme_list, rounding=None) -> tuple[list[list[float | None]], str]:
    """[unit][scheme]: the mean KL(base || the unit alone quantized) over the windows' positions
    (None where the scheme does not fit), and how the logits were replayed."""
    import torch

    replay = _Replay(model, ids)
    how = replay.check()
    log.info("sensitivity: replay %s", how)
    base = replay.base_logits if replay.layers is not None else model(input_ids=ids).logits.float()
    base_lp = torch.log_softmax(base, -1)
    neg_entropy = (base_lp.exp() * base_lp).sum(-1)
    base_p = base_lp.exp()
    del base, base_lp
    table: list[list[float | None]] = []
    work = sum(1 for u in units for s in scheme_list if s.quantized and s.fits(u.in_features))
    bar = tqdm(total=work, desc="sensitivity", unit="eval", leave=False, file=terminal())
    for unit in units:
        row: list[float | None] = []
        for scheme in scheme_list:
            if not scheme.fits(unit.in_features):
                row.append(None)
                continue
            if not scheme.quantized:
                row.append(0.0)
                continue
            with _Quantized(modules, unit, scheme, rounding):
                lp = torch.log_softmax(replay.logits(unit.block), -1)
            kld = (neg_entropy - (base_p * lp).sum(-1)).clamp(min=0)
            row.append(float(kld[:, :-1].mean()))
            bar.update(1)
        table.append(row)
    bar.close()
    return table, how


def fisher_proxy(model, modules, ids, units, scheme_list, rounding=None) -> list[list[float | None]]:
    """The second-order estimate of each unit's KLD, from one backward pass per window with labels
    sampled from the model (seeded): for the weights, 1/2 sum(F * dW^2) with F the diagonal Fisher
    of the weights; for dynamically quantized input activations (W8A8, FP8), 1/2 sum_t (g_t . e_t)^2
    with g_t the gradient at the unit's input and e_t the rounding error of that token, an
    unbiased estimate of e^T F e for the input's full Fisher."""
    import torch

    model.float()
    params = {name: modules[name].weight for unit in units for name in unit.layers}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    activations = _ActivationTerm(model, modules, units, [s for s in scheme_list if s.activations])
    generator = torch.Generator().manual_seed(0)
    try:
        for row in tqdm(ids, desc="sensitivity (fisher)", unit="window", leave=False, file=terminal()):
            activations.clear()
            _backward(model, row, generator)
            for name, p in params.items():
                fisher[name] += p.grad.float() ** 2
            activations.add()
    finally:
        activations.remove()
    for p in params.values():
        p.requires_grad_(False)
        p.grad = None
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    return _fisher_table(units, scheme_list, params, fisher, activations.total, tokens, rounding)


def _backward(model, row: torch.Tensor, generator: torch.Generator) -> None:
    """One window's backward pass, on the loss of labels sampled from the model's own output."""
    import torch

    logits = model(input_ids=row[None]).logits[0, :-1].float()
    with torch.no_grad():
        labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    model.zero_grad(set_to_none=True)
    loss.backward()


class _ActivationTerm:
    """The proxy's term for dynamically quantized inputs: each unit's input and the gradient at it,
    kept by hooks during a window's pass, and sum_t (g_t . e_t)^2 summed per (unit, scheme) over the
    windows in `total`. No hooks without such schemes."""

    def __init__(self, model, modules: dict, units: list[Unit], act_schemes: list[schemes.Scheme]):
        self.units, self.schemes = units, act_schemes
        self.total = {(u.name, s.name): 0.0 for u in units for s in act_schemes}
        self.inputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.hooks = []
        if act_schemes:
            # the embeddings' output carries a gradient, so even the first block's inputs get one
            embeddings = model.get_input_embeddings()
            self.hooks.append(embeddings.register_forward_hook(lambda m, args, out: out.requires_grad_()))
            for unit in units:
                keep = functools.partial(self._keep, unit.name)
                self.hooks.append(modules[unit.layers[0]].register_forward_pre_hook(keep))

    def _keep(self, name: str, module, args) -> None:
        x = args[0]
        self.inputs[name] = x.detach()
        if x.requires_grad:
            x.register_hook(lambda g: self.grads.__setitem__(name, g.detach()))

    def clear(self) -> None:
        self.inputs.clear()
        self.grads.clear()

    @_under("no_grad")
    def add(self) -> None:
        """The window just passed backward: its tokens' terms added to `total`."""
        for unit in self.units:
            if unit.name not in self.grads:
                continue
            x, g = self.inputs[unit.name].float(), self.grads[unit.name].float()
            for scheme in self.schemes:
                error = fake_quantize_tokens(x, scheme.activations).float() - x
                self.total[(unit.name, scheme.name)] += float(((g * error).sum(-1) ** 2).sum())

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


@_under("no_grad")
def _fisher_table(units, scheme_list, params, fisher, act_total, tokens: int, rounding) -> list[list[float | None]]:
    """[unit][scheme]: 1/2 (the weights' term + the inputs') per token; None where the scheme does not fit."""
    table: list[list[float | None]] = []
    for unit in units:
        row: list[float | None] = []
        for scheme in scheme_list:
            if not scheme.fits(unit.in_features):
                row.append(None)
            elif not scheme.quantized:
                row.append(0.0)
            else:
                total = 0.0
                for name in unit.layers:
                    w = params[name].detach()
                    total += float(
                        (
                            fisher[name] * (w.float() - fake_quantize_weight(w, scheme, name, rounding).float()) ** 2
                        ).sum()
                    )
                total += act_total.get((unit.name, scheme.name), 0.0)
                row.append(0.5 * total / tokens)
        table.append(row)
    return table
