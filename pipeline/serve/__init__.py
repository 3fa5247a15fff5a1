"""Online use of the batch job's engine: a Ray Serve application with an OpenAI-style API.

    python jobs/serve.py --config configs/summarize.yaml [--host 127.0.0.1] [--port 8000]
    serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (request fields: :mod:`pipeline.serve.protocol`).  Responses are OpenAI's
shapes plus a ``speculation`` object (the row statistics the batch job's Parquet holds:
acceptance rate, mean accepted length, draft / accepted tokens, verify steps, ...), on the
response and on each choice; ``"stream": true`` sends one server-sent event per block of
tokens the verifier commits, then ``data: [DONE]``.

Batching.  Each replica (``serve.num_replicas`` of them, ``serve.gpus_per_replica`` GPUs
each) loads the job config's model pair and method once (:func:`pipeline.loading.load_engine`,
as the batch job's actors do) and keeps one
:class:`~pipeline.engine.scheduler.Scheduler` (continuous batching: up to
``serve.max_batch_size`` rows in flight, a finished row's slot taken by the next request
at once).  Requests are submitted from the replica's asyncio loop; one background thread
(:class:`EngineLoop`) steps the scheduler while rows are in flight, so concurrent requests
share every target pass, and hands each committed block and each final result back to the
loop with ``loop.call_soon_threadsafe``.  Rows whose sampling settings differ step in
their own group.  A greedy request's output is what the batch job writes for the same
prompt and settings (the engine is lossless and a row's output never depends on its batch).

Errors.  A bad request is refused before any decoding with a 400 whose JSON ``error.param``
names the field (unknown field, ``max_tokens`` <= 0, a prompt longer than the context, a
sampling value or draft length out of range, ...); an unknown ``model`` is a 404; a body
over ``serve.max_request_bytes`` is a 413, a request without the API key (when one is set)
a 401.  Should an engine step raise (a bug, out of memory), its rows are run again, each
alone, and only a row that fails alone gets a 500 (:class:`EngineLoop`); Serve's health
check restarts a replica only if its stepping thread died.  A client that disconnects
cancels its rows.

Modules, one idea each:

- :mod:`pipeline.serve.protocol` -- the request models, their mapping to engine settings,
  and the response shapes (the ``speculation`` object, usage, finish reasons, errors);
- :mod:`pipeline.serve.engine_loop` -- the scheduler's stepping thread and the asyncio side
  of a request's rows;
- :mod:`pipeline.serve.streaming` -- incremental detokenization with stop strings;
- :mod:`pipeline.serve.server` -- :class:`OpenAIServer`: the endpoints on one engine, no Ray;
- :mod:`pipeline.serve.app` -- the FastAPI routes, the Ray Serve deployment and application
  (:func:`app_builder`), and ``jobs/serve.py``'s command line (:func:`main`).
"""

from pipeline.serve.app import (
    absolute_paths, app_builder, build_app, build_application, deployment_options, main, preflight,
)
from pipeline.serve.engine_loop import EngineLoop
from pipeline.serve.server import OpenAIServer, served_model_name
from pipeline.serve.streaming import TextStream

__all__ = [
    "EngineLoop", "OpenAIServer", "TextStream", "absolute_paths", "app_builder", "build_app", "build_application",
    "deployment_options", "main", "preflight", "served_model_name",
]
