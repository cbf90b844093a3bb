"""The FastAPI app: OpenAI-compatible routes, health, readiness and metrics."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from specpair_runtime.server.admission import check_model
from specpair_runtime.server.completions import add_generation_routes
from specpair_runtime.server.errors import install_error_handlers
from specpair_runtime.server.gate import GateMiddleware
from specpair_runtime.server.metrics import CONTENT_TYPE
from specpair_runtime.server.schemas import ModelCard, ModelList
from specpair_runtime.server.state import ServerState


def add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """/healthz (the process answers), /readyz (the pair serves) and /metrics."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        readiness = state.readiness.state
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def model_card(state: ServerState) -> ModelCard:
    config = state.config
    return ModelCard(
        id=state.model_id,
        created=int(time.time()),
        pair=config.pair.name,
        pair_version=config.pair.version,
        target=config.target.source,
        draft=config.draft.source,
    )


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(state)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        check_model(state, model_id)
        return model_card(state)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specpair runtime", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GateMiddleware, state=state)
    install_error_handlers(app, state.metrics)
    add_probe_routes(app, state)
    add_model_routes(app, state)
    add_generation_routes(app, state)
    return app
