"""``POST /rollout/generate``.

A client that disconnects has its queued work dropped (api.md): the engine call runs as a task raced
against a watcher that waits for the ASGI ``http.disconnect`` message; when the client goes first,
the task is cancelled, which cancels the job's future, and the worker drops a cancelled job before it
runs. A batch that already runs cannot be interrupted mid-loop (the other samples of the batch need
it finished): it completes, and the gone client's result is discarded without being encoded. The
per-request timeout is the engine's (``request_timeout_s`` -> 504).

Why a watcher on ``receive()`` and not ``request.is_disconnected()``: the latter peeks with an
already-cancelled scope, which never gets through the task group of a ``BaseHTTPMiddleware`` (the
app's request-id middleware was one until it became pure ASGI), so it cannot be relied on under
any middleware stack. Once the body has been read,
the only message ``receive()`` can still deliver is ``http.disconnect``, so waiting on it costs
nothing and needs no polling.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from diffusion_rollout.entrypoints.request_params import group_params
from diffusion_rollout.entrypoints.routers.common import (
    get_engine,
    refuse_unknown_fields,
    require_api_key,
    wire_response,
)
from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol import lean
from diffusion_rollout.protocol.dialects import log_ignored_once
from diffusion_rollout.protocol.requests import GenerateRequest
from diffusion_rollout.server.core.reward_runner import check_reward_names

logger = logging.getLogger(__name__)
router = APIRouter()

# Status recorded for a request whose client left (nginx's convention); nobody receives it.
CLIENT_CLOSED_REQUEST = 499


async def _client_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _generate_groups(engine, groups: list, limit: int) -> list:
    if len(groups) == 1:
        return await engine.generate(groups[0])
    total = sum(g.num_outputs_per_prompt for g in groups)
    if total > limit:
        raise RequestError(
            f"{len(groups)} prompts of num_outputs_per_prompt={groups[0].num_outputs_per_prompt} make "
            f"{total} outputs; the limit is {limit} (max_outputs_per_request)",
            field="prompt",
        )
    tasks = [asyncio.ensure_future(engine.generate(g)) for g in groups]
    try:
        answers = await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # one group failed, or the client left: the others' queued work goes too
            t.cancel()
    return [r for answer in answers for r in answer]


@router.post("/rollout/generate", dependencies=[Depends(require_api_key)])
async def rollout_generate(body: GenerateRequest, request: Request) -> Response:
    engine = get_engine(request)
    refuse_unknown_fields(request, body)
    if body.rewards:  # at the edge, so a cluster front refuses before any replica is asked
        check_reward_names(body.rewards, list(request.app.state.config.reward_specs()))
    # SGLang's rid, when the client sets one, names the request (POST /abort_request takes it).
    # A list prompt is one group per prompt (SGLang's in-process form): the groups run as requests
    # of their own, under the one request id, and answer in prompt order.
    groups = group_params(body, body.rid or request.state.request_id)
    ignored = body.ignored_fields
    if ignored:
        log_ignored_once("/rollout/generate", ignored)
    limit = request.app.state.config.max_outputs_per_request
    task = asyncio.ensure_future(_generate_groups(engine, groups, limit))
    watcher = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()  # the client left, or this handler itself was cancelled (shutdown)
        if gone:
            task.cancel()
    if gone:
        engine.metrics.request_cancelled("disconnect")
        logger.info("client disconnected: request cancelled, its queued work dropped")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    outputs = [r.to_dict() for r in task.result()]
    if ignored:  # fields of another dialect that changed nothing here (protocol/dialects.py)
        outputs = [{**o, "ignored_fields": ignored} for o in outputs]
    if body.lean_response:  # shared conditioning once, referenced by the other outputs (lean.py)
        outputs = lean.to_lean(outputs)
    return await wire_response(request, outputs, segments=True)
