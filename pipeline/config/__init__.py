"""Job configuration: YAML files validated on load, with command-line overrides.

A job config has twelve sections (see ``configs/summarize.yaml`` for a commented one)::

    input:      uri, format, id_column, text_column, preflight_read_max_bytes, split_rows
    task:       name (summarize | translate), source_lang, target_lang, prompt_template,
                system_prompt, chat_template (auto | true | false)
    models:     target, drafter, gguf_file, drafter_gguf_file, dtype, device_map, trust_remote_code
    method:     name (a method of pipeline.engine.METHODS) + SpeculationSettings fields
    generation: max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
                repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens,
                suppress_tokens, seed, eos_token_id, stop_strings (GenerationSettings'
                fields; unset ones take the target checkpoint's generation_config)
    compute:    num_actors, gpus_per_actor, cpus_per_actor, rows_per_batch, max_batch_size,
                draft_length, max_actor_restarts, max_batch_retries, actor_start_timeout_s,
                stall_timeout_s
    cpu:        kernels, onednn, transposed, smallm, rowdot, small_query_attention, lean_pass,
                compiled_layer, compile_cache (CpuOptions' fields: the engine's CPU acceleration;
                the environment's SPECBATCH_CPU_<KEY> overrides each)
    output:     uri, overwrite, allow_foreign_files, partition_by_date, run_date, max_rows_per_file,
                lease_timeout_s, storage_options
    retry:      storage calls: attempts, initial_backoff_s, max_backoff_s (transient errors),
                connect_timeout_s, read_timeout_s, deadline_s
    audit:      fraction, seed (re-decode a sample with plain decoding, count mismatches)
    ray:        address (optional; default: the cluster of RAY_ADDRESS, else an embedded one)
    serve:      host, port, num_replicas, gpus_per_replica, cpus_per_replica, max_batch_size,
                max_ongoing_requests, model_name, chat_template, max_request_bytes, max_tokens_cap,
                max_rows_per_request, max_stop_strings, max_stop_string_chars, max_bad_words,
                max_bad_word_tokens, api_key (the online server, jobs/serve.py)

Every section refuses unknown keys and bad values; :class:`ConfigError` names the
offending key as a dotted path (``generation.temperature``).  Method parameters are a
pass-through to :class:`pipeline.engine.SpeculationSettings`: any field of that
dataclass is accepted under ``method:`` and the engine's own ``validate()`` runs at load
time, so new engine methods and parameters need no change here.

Overrides use dotted keys, ``--set generation.max_new_tokens=32`` (values parsed as
YAML scalars: ``true``, ``null``, ``0.5``, ``[a, b]``).
"""

from pipeline.config.job import JobConfig, ServeConfig, apply_overrides, load_config, parse_override, read_yaml
from pipeline.config.sections import (DEFAULT_TEMPLATES, MAX_LEASE_TIMEOUT_S, RAY_RESOURCE_UNIT, AuditConfig,
                                      ComputeConfig, ConfigError, CpuConfig, GenerationConfig, InputConfig,
                                      JobRefused, MethodConfig, ModelsConfig, OutputConfig, RayConfig, RetryConfig,
                                      TaskConfig, foreign_method_params, ray_resource, template_fields)

__all__ = ["DEFAULT_TEMPLATES", "MAX_LEASE_TIMEOUT_S", "RAY_RESOURCE_UNIT", "AuditConfig", "ComputeConfig",
           "ConfigError", "CpuConfig", "GenerationConfig", "InputConfig", "JobConfig", "JobRefused", "MethodConfig",
           "ModelsConfig", "OutputConfig", "RayConfig", "RetryConfig", "ServeConfig", "TaskConfig", "apply_overrides",
           "foreign_method_params", "load_config", "parse_override", "ray_resource", "read_yaml", "template_fields"]
