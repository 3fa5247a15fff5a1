"""The engine's CPU acceleration, behind one seam: a model is prepared once, at load.

:func:`prepare` (``prepare(model, options) -> CpuPlan``) rewrites the model's linear layers in
place to run each weight shape's fastest kernel for a few rows of input (:mod:`.linear`),
builds the lean forward of a Llama (:mod:`.lean`, with :mod:`.layer`'s compiled layer for
passes of 1-2 tokens by default), turns on the small-query attention (:mod:`.attention`), compiles what it
will use into the node's inductor cache, and returns a :class:`CpuPlan` saying what it chose
and what that cost.  The engine prepares every model it runs when it is built; the runner
takes the plan of its model (:func:`plan_of`) and chooses nothing itself.  Which parts are on
is :class:`CpuOptions` (the job config's ``cpu:`` section, the environment overriding it),
read in :mod:`.options` alone.  What each part buys, and the measurements behind each
constant: ``docs/benchmarks.md``.
"""

from .attention import attention_implementation
from .options import PARTS, CpuOptions, with_environment
from .plan import CpuPlan, plan_of, prepare

__all__ = ["CpuOptions", "CpuPlan", "PARTS", "attention_implementation", "plan_of", "prepare", "with_environment"]
