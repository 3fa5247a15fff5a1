"""Preparing a model for the CPU, once at load: :func:`prepare` -> :class:`CpuPlan`."""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import attention, lean, payoff
from .compiling import INDUCTOR_MIN_ELEMENTS
from .linear import PREPARED_DTYPES, SMALL_MAX_ROWS, ShapeKernels, prepare_linears, restore_linears
from .measure import Costs, best_of
from .options import CpuOptions, use_compile_cache, with_environment


@dataclass
class CpuPlan:
    """What :func:`prepare` did to one model: an explicit record, and the state its passes use.

    Attributes:
        options: the options it was prepared with (the environment's overrides applied).
        role: what the model is to its engine (``target``, ``drafter``...), for the record.
        why_off: why nothing was prepared (``None``: something was).
        kernels: ``(shape, dtype) -> ShapeKernels``: each weight shape's kernel per row count
            (the model's linear layers and the lean pass's fused projections).
        lean: the lean forward (:class:`.lean.LeanPass`), or ``None``: the model's own forward.
        small_query_attention: masked passes of the model's own forward take
            :func:`.attention.small_query_attention`.
        threads: torch's intra-op threads when the kernels were measured.
        compile_s, measure_s, prepare_s: wall-clock seconds spent compiling (inductor),
            timing candidates, and preparing in all.
        compile_cache: inductor's cache folder (``None`` when nothing was compiled).
        compiling: whether each inductor part's graphs were compiled, and why
            (:class:`.payoff.Decision`, in the order decided: the row-dot kernels, then the
            compiled layer per token count).
    """

    options: CpuOptions
    role: str = "model"
    why_off: str | None = None
    kernels: dict = field(default_factory=dict)
    lean: lean.LeanPass | None = None
    small_query_attention: bool = False
    threads: int = 1
    compile_s: float = 0.0
    measure_s: float = 0.0
    prepare_s: float = 0.0
    compile_cache: str | None = None
    compiling: list[payoff.Decision] = field(default_factory=list)

    def forward_of(self, model, inputs: torch.Tensor, kwargs: dict):
        """The lean forward for this pass of ``model``, or ``None`` for the model's own: the
        pass feeds token ids, asks for nothing but hidden states, runs without autograd, and no
        forward hook other than transformers' own is installed (it would not be called)."""
        p = self.lean
        if (p is None or inputs.dim() != 2 or not kwargs.keys() <= {"output_hidden_states"}
                or torch.is_grad_enabled() or p.has_hooks(model)):
            return None
        return p

    def describe(self) -> dict:
        """Plain data for the run summary and reports: the options, each weight shape's kernel
        per row count, which passes run the lean forward and the compiled layer, the seconds
        spent; ``why_off`` when nothing was prepared."""
        return {
            "role": self.role, "why_off": self.why_off, "options": self.options.to_dict(), "threads": self.threads,
            "linear_kernels": [k.describe() for k in self.kernels.values()],
            "lean_pass": self.lean is not None,
            "compiled_layer_tokens": sorted(self.lean.graphs) if self.lean is not None else [],
            "small_query_attention": self.small_query_attention,
            "compile_s": round(self.compile_s, 3), "measure_s": round(self.measure_s, 3),
            "prepare_s": round(self.prepare_s, 3), "compile_cache": self.compile_cache,
            "compiling": [d.to_dict() for d in self.compiling],
        }

    def summary(self) -> str:
        """One line: the parts in use and the kernels of each weight shape (a run's printed summary)."""
        if self.why_off:
            return f"{self.role}: off ({self.why_off})"
        parts = [name for name, on in (("lean pass", self.lean is not None), ("small-query attention",
                                                                               self.small_query_attention)) if on]
        if self.lean is not None and self.lean.graphs:
            parts.append("compiled layer for passes of " + " or ".join(map(str, sorted(self.lean.graphs))) + " tokens")
        shapes = "; ".join(f"{k.shape[0]}x{k.shape[1]} " + "/".join(k.choice) + f" then {k.default}"
                           for k in self.kernels.values())
        return (f"{self.role}: {', '.join(parts) or 'no lean pass'}; linear kernels by rows 1-{SMALL_MAX_ROWS}: {shapes or 'none'}; "
                f"{self.compiling_line()}, measured {self.measure_s:.1f} s")

    def compiling_line(self) -> str:
        """What was compiled at load and why: ``"compiled 6 graphs, 8.1 s: expected saving 40.2 s
        (...)"`` or ``"not compiled: ..."`` with each part's decision (:mod:`.payoff`)."""
        made = [d for d in self.compiling if d.pays]
        why = "; ".join(d.line() for d in self.compiling)
        if not made:
            return f"not compiled: {why}" if why else f"compiled {self.compile_s:.1f} s"
        saving = sum(d.saving_s for d in made)
        expected = "unknown tokens" if saving == float("inf") else f"{saving:.1f} s"
        return (f"compiled {sum(d.graphs for d in made)} graphs, {self.compile_s:.1f} s: expected saving {expected}"
                f" ({why})")


#: the plan of each model prepared in this process (keyed weakly: the plan keeps the model's
#: modules, never the model, so a model no one holds goes, and its plan with it)
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, CpuPlan]" = weakref.WeakKeyDictionary()


def plan_of(model) -> CpuPlan | None:
    """The plan :func:`prepare` made for ``model``, or ``None`` (its passes then run PyTorch's
    default kernels through its own forward)."""
    try:
        return _PLANS.get(model)
    except TypeError:  # not weak-referenceable: never prepared
        return None


def _why_off(model, options: CpuOptions) -> str | None:
    if not options.kernels:
        return "cpu.kernels is off"
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params or params[0].device.type != "cpu":
        return "the model is not on the CPU"
    if not any(p.dtype in PREPARED_DTYPES + (torch.float64,) for p in params):
        return f"the model's dtype {params[0].dtype} is not served"
    return None


def _rowdot_layers(model, options: CpuOptions) -> list[torch.nn.Module]:
    """The linear layers whose shapes may be offered the row-dot kernels (float32, contiguous,
    :data:`.compiling.INDUCTOR_MIN_ELEMENTS` or more)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu" and m.weight.numel() >= INDUCTOR_MIN_ELEMENTS
            and m.weight.is_contiguous()] if options.part_on("rowdot") else []


def _rowdot_shapes(model, layers: list, options: CpuOptions) -> list[tuple[int, int]]:
    """The weight shapes the row-dot kernels would be compiled for: ``layers``'s, and the lean
    pass's fused q/k/v and gate/up projections when it will be built."""
    shapes = {tuple(m.weight.shape) for m in layers}
    if layers and options.part_on("lean_pass") and lean.supports(model):
        a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
        hidden = a.q_proj.weight.shape[1]
        fused = [(a.q_proj.weight.shape[0] + a.k_proj.weight.shape[0] + a.v_proj.weight.shape[0], hidden),
                 (m.gate_proj.weight.shape[0] + m.up_proj.weight.shape[0], hidden)]
        shapes.update(s for s in fused if s[0] * s[1] >= INDUCTOR_MIN_ELEMENTS)
    return sorted(shapes)


def _rowdot_decision(model, options: CpuOptions, ledger: payoff.Ledger, rows_in_flight: int | None,
                     costs: Costs) -> tuple[payoff.Decision, str] | None:
    """Whether the row-dot kernels pay (:mod:`.payoff`), with their ledger key; ``None``: none is offered.
    Their per-token saving is estimated from the eager time of the layers they would serve for
    one token (``F.linear``, measured here on the CPU clock) times ``1 - ratio``."""
    layers = _rowdot_layers(model, options)
    if not layers:
        return None
    shapes = _rowdot_shapes(model, layers, options)
    key = payoff.graph_key("rowdot", shapes, torch.float32)
    graphs = len(shapes) * SMALL_MAX_ROWS
    cached = ledger.cached(key)
    token_saving = 0.0
    if options.expected_tokens is not None:
        weights = [m.weight.detach() for m in layers]
        xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
        with torch.inference_mode(False), torch.no_grad():
            eager = best_of(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], costs=costs, clock=time.process_time)
        token_saving = eager * (1 - ledger.ratio(key, "rowdot"))
    decision = payoff.decide("row-dot kernels", graphs=graphs, expected_tokens=options.expected_tokens,
                             token_saving_s=token_saving, compile_s=ledger.cost(key, graphs), cached=cached,
                             share=payoff.served_share(SMALL_MAX_ROWS, rows_in_flight))
    return decision, key


def prepare(model, options: CpuOptions | None = None, role: str = "model",
            rows_in_flight: int | None = None) -> CpuPlan:
    """Prepare ``model`` for decoding on the CPU, once, at load: **rewrites the model's
    ``torch.nn.Linear`` modules in place** (their class becomes
    :class:`~.linear.PackedLinear`; same parameters and ``state_dict``), measures each weight
    shape's kernel for 1-8 rows of input over the model's own weights (:mod:`.linear`), builds
    the lean forward of a Llama (:mod:`.lean`), compiles what it will use with inductor into
    the node's cache (:func:`.options.use_compile_cache`) and times the compiled layer against
    the eager one.  An inductor part is compiled only where ``options.expected_tokens`` repay
    its compiling (:mod:`.payoff`; the plan's :attr:`CpuPlan.compiling` says why).  Nothing is
    chosen or compiled afterwards, in decoding.

    Preparing a model again without options, or with the same ones, returns its plan; with
    other options, it is restored and prepared anew.  A model not on the CPU, or with ``options.kernels`` off, is
    left as it is (the plan says why).

    Args:
        model: a model in eval mode (a causal LM, a draft head, a module of MTP layers).
        options: the parts to use (``None``: the model's plan when it has one, else the
            defaults); the environment overrides them (:func:`.options.with_environment`).
        role: what the model is to its engine, for the plan's record.
        rows_in_flight: the most rows its engine decodes at once (``None``: unknown), for the
            share of tokens a graph for passes of few tokens serves (:func:`.payoff.served_share`).

    Returns:
        The :class:`CpuPlan`: what was chosen and what it cost; the runner takes it from
        :func:`plan_of`.

    Raises:
        ValueError: an environment variable that is not a boolean word (naming it).
    """
    old = plan_of(model)
    if old is not None and (options is None or old.options == with_environment(options)):
        return old
    options = with_environment(options)
    if old is not None:  # its own layers only (a submodule prepared on its own keeps its plan)
        mine = set(map(id, old.kernels.values()))
        restore_linears(m for m in model.modules() if id(getattr(m, "kernels", None)) in mine)
    start = time.perf_counter()
    plan = CpuPlan(options, role=role, why_off=_why_off(model, options), threads=torch.get_num_threads())
    if plan.why_off is None:
        costs = Costs()
        ledger = payoff.Ledger(None)
        if options.rowdot or options.compiled_layer:
            plan.compile_cache = use_compile_cache(options)
            ledger = payoff.Ledger(plan.compile_cache)
        rowdot = _rowdot_decision(model, options, ledger, rows_in_flight, costs)
        linear_options = options if rowdot is None or rowdot[0].pays else dataclasses.replace(options, rowdot=False)
        plan.compiling += [rowdot[0]] if rowdot is not None else []
        plan.kernels = prepare_linears(model.modules(), linear_options, costs=costs)
        if options.part_on("lean_pass") and lean.supports(model):
            plan.lean = lean.LeanPass(model, linear_options, plan.kernels, costs, ledger=ledger,
                                      rows_in_flight=rows_in_flight)
            plan.compiling += plan.lean.compiling
        if rowdot is not None and rowdot[0].pays:
            layer_s = plan.lean.layer_compile_s if plan.lean is not None else 0.0
            ledger.record(rowdot[1], rowdot[0].graphs, costs.compile_s - layer_s)
        plan.small_query_attention = options.part_on("small_query_attention") and attention.applies(model)
        plan.compile_s, plan.measure_s = costs.compile_s, costs.measure_s
        if not plan.compile_s:
            plan.compile_cache = None
    plan.prepare_s = time.perf_counter() - start
    _PLANS[model] = plan
    return plan


__all__ = ["CpuPlan", "ShapeKernels", "plan_of", "prepare"]
