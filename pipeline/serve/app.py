"""The app of the online server: the FastAPI routes of an :class:`OpenAIServer`, the Ray
Serve deployment and application of a job config, and ``jobs/serve.py``'s command line.

    python jobs/serve.py --config configs/summarize.yaml [--host 127.0.0.1] [--port 8000]
    serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pipeline.config import ConfigError, JobConfig, load_config
from pipeline.flags import build_parser as build_job_parser
from pipeline.flags import config_overrides
from pipeline.loading import process_cpus
from pipeline.serve.protocol import APIError
from pipeline.serve.server import OpenAIServer, served_model_name

log = logging.getLogger("specbatch.serve")
REPO_ROOT = Path(__file__).resolve().parents[2]


def build_app(server: OpenAIServer, api_key: str | None = None, max_request_bytes: int = 2**20):
    """The FastAPI app of ``server``: the four endpoints, OpenAI-shaped errors.

    Args:
        api_key: when set, every ``/v1/`` route needs ``Authorization: Bearer <api_key>``
            (FastAPI's ``HTTPBearer``; compared in constant time), else a 401 in OpenAI's
            error shape (``code: invalid_api_key``), as vLLM's ``--api-key``; ``/health``
            stays open (load balancers and Serve's probes call it).
        max_request_bytes: a request body larger than this is refused with a 413 before it
            is read in full (by its ``Content-Length``, or while it streams in), so it is
            never parsed or tokenized.
    """
    app = FastAPI(title="specbatch", description="OpenAI-style completions on a speculative-decoding engine")
    bearer = HTTPBearer(auto_error=False)

    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError("Incorrect API key provided: send it as 'Authorization: Bearer <key>'" if given else
                           "Missing API key: send it as 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("request failed")
        body = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error").body()
        return JSONResponse(body, status_code=500)

    async def read_body(request: Request) -> bytes:
        too_big = APIError(f"the request body is larger than this server accepts (serve.max_request_bytes="
                           f"{max_request_bytes} bytes)", status=413)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def respond(handler, request: Request):
        out = await handler(await read_body(request))
        if isinstance(out, dict):
            return JSONResponse(out)
        return StreamingResponse(out, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @v1.post("/completions")
    async def completions(request: Request):
        return await respond(server.completions, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await respond(server.chat_completions, request)

    @v1.get("/models")
    async def models():
        return server.models()

    app.include_router(v1)

    @app.get("/health")
    async def health():
        info = server.health()
        return JSONResponse(info, status_code=200 if info["status"] == "ok" else 503)

    return app


# ---------------------------------------------------------------------------- Ray Serve
def _deployment():
    from ray import serve

    @serve.deployment(name="specbatch")
    @serve.ingress()
    class OpenAIDeployment:
        """One replica: the job config's model pair and method, one engine loop."""

        def __init__(self, config: dict[str, Any]):
            self.cfg = JobConfig.model_validate(config)
            self.server = OpenAIServer.from_config(self.cfg)

        def __serve_build_asgi_app__(self):
            return build_app(self.server, api_key=self.cfg.serve.api_key,
                             max_request_bytes=self.cfg.serve.max_request_bytes)

        def check_health(self) -> None:
            self.server.check_health()

    return OpenAIDeployment


def absolute_paths(cfg: JobConfig, base: Path | None = None) -> JobConfig:
    """``cfg`` with local model and template paths made absolute (replicas may start in
    another directory; hub ids are left as they are) and the API key resolved
    (``serve.api_key`` or ``SPECBATCH_API_KEY``)."""
    base = base or Path.cwd()
    cfg = cfg.model_copy(deep=True)
    cfg.serve.api_key = cfg.serve.effective_api_key()  # SPECBATCH_API_KEY of this process: replicas may lack it
    if cfg.serve.model_name is None:
        cfg.serve.model_name = served_model_name(cfg)
    for key in ("target", "drafter"):
        value = getattr(cfg.models, key)
        if value and (base / Path(value).expanduser()).is_dir():
            setattr(cfg.models, key, str((base / Path(value).expanduser()).resolve()))
    template = cfg.serve.chat_template_text(base)
    if template is not None:
        cfg.serve.chat_template = template
    return cfg


def preflight(cfg: JobConfig) -> None:
    """The checks that need no weights: model paths, tokenizer, chat template.

    Raises:
        ModelError, ConfigError (``ValueError``): naming the key.
    """
    from pipeline.models import check_models

    # the drafter's format by its method; the pair itself is checked when the replica builds its engine
    checked = check_models(cfg.models, cfg.uses_drafter, method=cfg.method.name, pair=False)
    tok = checked["tokenizer"]
    if cfg.serve.chat_template is None and not getattr(tok, "chat_template", None):
        log.warning("the target's tokenizer has no chat template and serve.chat_template is unset: "
                    "/v1/chat/completions will refuse requests")


def build_application(cfg: JobConfig):
    """The Serve application of a job config: ``serve.num_replicas`` replicas, each with
    ``serve.gpus_per_replica`` GPUs and ``serve.cpus_per_replica`` CPUs (unset: the batch
    job's ``compute.gpus_per_actor`` / ``compute.cpus_per_actor``)."""
    cfg = absolute_paths(cfg)
    return _deployment().options(**deployment_options(cfg)).bind(cfg.model_dump())


def deployment_options(cfg: JobConfig) -> dict[str, Any]:
    """Ray Serve's deployment options from ``serve:`` (GPUs and CPUs per replica default to
    the batch job's ``compute.gpus_per_actor`` / ``compute.cpus_per_actor``)."""
    gpus = cfg.serve.gpus_per_replica if cfg.serve.gpus_per_replica is not None else cfg.compute.gpus_per_actor
    cpus = process_cpus(cfg, serving=True)
    return {"num_replicas": cfg.serve.num_replicas, "max_ongoing_requests": cfg.serve.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus}, **SHUTDOWN_OPTIONS}


#: how a replica stops (Serve's defaults: a 2 s wait loop, 20 s before it is killed, which with the
#: controller's own wait made a SIGTERM take 35-50 s, "Controller failed to shut down within 30.0s"):
#: requests in flight get up to 5 s to finish
SHUTDOWN_OPTIONS = {"graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 5.0}


def app_builder(args: dict[str, str]):
    """``serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]``:
    the job config plus dotted overrides.  (Serve's own config chooses host and port there.)"""
    args = dict(args)
    path = args.pop("config", None)
    cfg = load_config(path, [f"{k}={v}" for k, v in args.items()])
    preflight(cfg)
    return build_application(cfg)


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    """The parser of ``jobs/serve.py`` (flags: :mod:`pipeline.flags`)."""
    return build_job_parser("serve", "OpenAI-style server on the job's engine (Ray Serve).",
                            defaults={"config": str(REPO_ROOT / "configs" / "summarize.yaml")})


def main(argv: list[str] | None = None) -> int:
    """``jobs/serve.py``: load and check the config, start Serve (embedded Ray unless
    ``ray.address`` / ``RAY_ADDRESS``), deploy, and serve until interrupted.

    What listens: Serve's HTTP proxy on ``serve.host:serve.port`` (127.0.0.1 by default;
    ``serve.api_key`` guards ``/v1/``).  An embedded Ray also listens, on every interface
    and on ports it picks: its GCS, raylet, object manager, worker and agent ports (Ray
    2.60 with the dashboard off, as :func:`pipeline.ray_setup.init_ray` starts it), guarded by
    Ray's token authentication (on by default; ``RAY_AUTH_MODE=disabled`` turns it off,
    which no shared machine should do).  Keep such a machine behind a firewall that admits
    only the Serve port, or run the server on a Ray cluster set up as Ray's security guide
    says.

    Exit status: 0 after Ctrl-C, 2 for a bad config or model path (before Ray starts).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = config_overrides("serve", args)

    from pipeline.models import ModelError

    try:
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(json.dumps(cfg.resolved(), indent=2))
            return 0
        preflight(cfg)
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from ray import serve

    from pipeline.ray_setup import init_ray

    if cfg.serve.effective_api_key() is None and cfg.serve.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who reaches port %d can use the model; set "
                    "--api-key (serve.api_key, or SPECBATCH_API_KEY)", cfg.serve.host, cfg.serve.port)
    init_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(build_application(cfg), name="specbatch", route_prefix="/")
    print(f"serving {cfg.serve.model_name or cfg.models.target} ({cfg.method.name}) on "
          f"http://{cfg.serve.host}:{cfg.serve.port}/v1 (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a plain kill shuts down as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
