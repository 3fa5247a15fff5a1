"""specbatch: speculative decoding for offline batch jobs.

``pipeline.engine`` holds the batched speculative-decoding engine (many rows in flight, each
exact); the other modules of this package are the Ray Data stages that read prompts, run the
engine on actors and write Parquet (``read``, ``write`` / ``output``, ``run``), the online
server (``pipeline.serve``) and the tuner (``pipeline.tune``).
"""
