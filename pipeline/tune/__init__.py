"""Autotuning of a job: method, draft length and batch size chosen from a pilot sample of
the job's own input, with the run's speed predicted before it starts.

- :mod:`pipeline.tune.tuner` -- the stages, top to bottom (:func:`tune`);
- :mod:`pipeline.tune.measure` -- the pilot sample, pilot runs, confirmation runs;
- :mod:`pipeline.tune.predict` -- tokens/s of every (method, k, B) from the measurements;
- :mod:`pipeline.tune.report` -- the tuned config, ``tune_report.md`` and its plots.

The engine side: :mod:`pipeline.engine.profile` (measured costs) and
:mod:`pipeline.engine.cost_model` (the formula, shared with the engine's draft length by load).
"""
