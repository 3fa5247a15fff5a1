"""specbatch: speculative decoding for offline batch jobs.

``pipeline.engine`` holds the single-sequence speculative loop; the other modules of
this package are the Ray Data stages that read prompts, run the engine on actors and
write Parquet.
"""
