"""The FastAPI app: OpenAI routes, tokenizer routes, health/version/metrics, one guard middleware
(API key, body size limit, draining, in-flight count), and the exception handlers that turn errors
into OpenAI's error schema.

An OpenAI route takes its request down one way: preprocess.py (the request to prompts and
SamplingParams), generation.py (the engine requests, their outputs), responses.py (the response or
its SSE chunks); none of those imports another.

The engine loads in a background thread once the app starts, so that the port answers at once:
`/health` is 503 until the engine is loaded, 200 while it serves, and 503 again while draining.
"""
import asyncio
import json
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from kiln.runtime.sampling_params import InvalidRequestError
from kiln.serve.generation import ClientDisconnected, final_outputs, start, until_disconnected
from kiln.serve.metrics import ServerMetrics
from kiln.serve.preprocess import Preprocessor
from kiln.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 LoadLoraAdapterRequest, TokenizeRequest, UnloadLoraAdapterRequest, error_body,
                                 now, random_id)
from kiln.serve.responses import ResponseHead, Responses
from kiln.serve.served_models import ServedModels
from kiln.version import __version__

if TYPE_CHECKING:  # the runtime imports torch: loaded with the engine (ServerState.load), after the port answers
    from kiln.runtime.frontend.async_llm import AsyncLLM

log = logging.getLogger("kiln.serve")

# Answered while loading and draining, never counted as in flight, never behind the API key
# (probes and Prometheus carry no key; vLLM guards only /v1 too).
UNGUARDED = ("/health", "/metrics", "/version")


@dataclass
class ServeConfig:
    engine_dir: str
    engine_args: dict = field(default_factory=dict)
    served_model_names: list[str] = field(default_factory=list)
    chat_template: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = 16 << 20
    tool_call_parser: str | None = None  # kiln.serve.tools.PARSERS
    enable_auto_tool_choice: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT dir
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    metrics_names: str = "both"  # /metrics under vLLM's names, Kiln's or both (kiln.serve.metrics)

    def __post_init__(self):
        self.served_model_names = list(self.served_model_names) or [str(self.engine_dir)]


@dataclass
class Serving:
    """What the routes serve with, once the engine is loaded."""
    llm: "AsyncLLM"
    models: ServedModels
    preprocessor: Preprocessor
    responses: Responses


class ServerState:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.serving: Serving | None = None
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None  # the engine core died while serving
        self.draining = False
        self.in_flight = 0
        self.on_fatal = lambda: None  # set by the launcher: stop the server (the engine failed to load)
        self.metrics = ServerMetrics(config.served_model_names[0], self._stats, config.metrics_names)

    def _stats(self) -> dict | None:
        return self.serving.llm.stats() if self.serving is not None else None

    def load(self) -> None:
        from kiln.runtime.frontend.async_llm import AsyncLLM
        from kiln.runtime.frontend.tokenizer import load_tokenizer

        c = self.config
        start = time.monotonic()
        try:
            llm = AsyncLLM(c.engine_dir, on_dead=self._engine_died, **c.engine_args)
            # the server's own: tokenizers are not shared across threads
            tokenizer = None if c.engine_args.get("skip_tokenizer_init") else load_tokenizer(c.engine_dir)
            models = ServedModels(c.served_model_names, str(c.engine_dir), llm.input_processor)
            for name, path in c.lora_modules.items():
                models.add_lora(name, path)
            self.serving = Serving(llm, models, Preprocessor(models, tokenizer, c.chat_template, c.tool_call_parser,
                                                             c.enable_auto_tool_choice), Responses(tokenizer))
            log.info("engine %s loaded in %.1fs (ready %.1fs after the process started): serving it as %s",
                     c.engine_dir, time.monotonic() - start, time.time() - psutil.Process().create_time(),
                     ", ".join(c.served_model_names))
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            self.load_error = e
            log.error("failed to load the engine from %s: %s", c.engine_dir, e)
            self.on_fatal()

    def _engine_died(self, error: BaseException) -> None:
        self.engine_error = error
        log.error("%s: /health is 503 and the server stops (exit code 1)", error)
        self.on_fatal()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work and wait for the requests in flight. If the grace period runs out, abort
        what is left (streams end with finish_reason "abort") and return False."""
        self.draining = True
        if await self._settled(timeout):
            return True
        if self.serving is not None:
            ids = await asyncio.to_thread(self.serving.llm.abort_all)
            log.warning("drain timeout: aborted %d request(s) still in flight", len(ids))
        await self._settled(2.0)  # let the aborted streams send their last chunk
        return False

    async def _settled(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    def shutdown(self) -> None:
        if self.serving is not None:
            self.serving.llm.shutdown()


class Guard:
    """Pure ASGI middleware (streaming bodies pass straight through)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNGUARDED:
            return await self.app(scope, receive, send)
        state, config = self.state, self.state.config
        if state.draining:
            return await _reply(send, 503, error_body("the server is shutting down", "server_error"))
        if config.api_key and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(auth, f"Bearer {config.api_key}".encode()):
                return await _reply(send, 401, error_body("Incorrect or missing API key: send "
                                                          "`Authorization: Bearer <key>`",
                                                          code="invalid_api_key"))
        limit = config.max_request_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _reply(send, 413, _too_large(limit))
        received, started = 0, False

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body without Content-Length
                raise _BodyTooLarge(limit)
            return message

        async def tracked_send(message):
            nonlocal started
            started = True
            await send(message)

        state.in_flight += 1
        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await _reply(send, 413, _too_large(limit))
        finally:
            state.in_flight -= 1


def _type_tag(x) -> bool:
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x or x.startswith("function-"))


class _BodyTooLarge(HTTPException):  # FastAPI re-raises HTTPExceptions met while reading a body
    def __init__(self, limit: int):
        super().__init__(413, _too_large(limit)["error"]["message"])


def _too_large(limit: int) -> dict:
    return error_body(f"the request body is larger than this server's limit ({limit} bytes)",
                      code="request_too_large")


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def build_app(config: ServeConfig, state: ServerState | None = None) -> FastAPI:
    state = state or ServerState(config)

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="kiln-load", daemon=True).start()
        yield
        await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="Kiln", version=__version__, lifespan=lifespan)
    app.state.kiln = state
    app.add_middleware(Guard, state=state)

    def serving() -> Serving:
        if state.serving is None:
            raise APIError(503, "the engine is still loading" if state.load_error is None
                           else f"the engine failed to load: {state.load_error}")
        return state.serving

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request, e: InvalidRequestError):
        """The engine refused the request (its input processor, or SamplingParams): the one place such
        a refusal becomes a 400, naming the field the engine named. A chat's prompt is its messages."""
        param = e.parameter
        if param == "prompt" and request.url.path == "/v1/chat/completions":
            param = "messages"
        return JSONResponse(error_body(str(e), param=param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)

        def where(err):  # the field's path, without pydantic's union-branch tags ("str", "list[int]")
            return ".".join(str(x) for x in err.get("loc", ()) if x != "body" and not _type_tag(x))

        msg = "; ".join(f"{where(err) or 'body'}: {err.get('msg')}" for err in errors[:5])
        return JSONResponse(error_body(msg, param=(where(errors[0]) if errors else "") or None),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = "request_too_large" if isinstance(e, _BodyTooLarge) else None
        return JSONResponse(error_body(str(e.detail), "invalid_request_error" if e.status_code < 500
                                       else "server_error", code=code), status_code=e.status_code)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request, e):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if state.engine_error is not None:
            return JSONResponse(error_body(f"the engine died: {state.engine_error}", "server_error"), status_code=503)
        if state.draining:
            return JSONResponse(error_body("draining", "server_error"), status_code=503)
        if state.serving is None:
            return JSONResponse(error_body("loading" if state.load_error is None else "failed to load",
                                           "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    def metrics():  # sync: the engine snapshot waits for the step in progress, in a worker thread
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving().models.model_list()

    if config.allow_runtime_lora_updating:  # vLLM's endpoints, off unless asked for
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoraAdapterRequest):
            await asyncio.to_thread(serving().models.add_lora, req.lora_name, req.lora_path)
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoraAdapterRequest):
            serving().models.remove_lora(req.lora_name)
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    # Each OpenAI route: its request to engine inputs, the engine requests started (the engine's refusal
    # is an error status before any byte is sent), then the response, or its chunks as they come.
    async def started(s: Serving, inputs, id_prefix: str, request: Request):
        """The response's head and the stream of the engine requests started for `inputs`."""
        head = ResponseHead(random_id(id_prefix), now(), inputs.model)
        outputs = await until_disconnected(request, start(s.llm, state.metrics, inputs.prompts, inputs.params,
                                                          head.id, inputs.lora))
        return head, outputs

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        s = serving()
        inputs = s.preprocessor.completion(req)
        head, outputs = await started(s, inputs, "cmpl", request)
        if req.stream:
            return StreamingResponse(s.responses.completion_chunks(req, head, inputs.params, outputs),
                                     media_type="text/event-stream")
        finals = await until_disconnected(request, final_outputs(outputs))
        return JSONResponse(s.responses.completion(req, head, finals).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        s = serving()
        inputs = s.preprocessor.chat(req)
        head, outputs = await started(s, inputs, "chatcmpl", request)
        if req.stream:
            return StreamingResponse(s.responses.chat_chunks(req, head, inputs.params, inputs.tool_parser, outputs),
                                     media_type="text/event-stream")
        (final,) = await until_disconnected(request, final_outputs(outputs))
        return JSONResponse(s.responses.chat(req, head, inputs.tool_parser, final).model_dump())

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        s = serving()
        s.models.resolve(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = s.preprocessor.chat_prompt(req.messages, req.add_generation_prompt)["prompt_token_ids"]
        else:
            s.preprocessor.need_tokenizer("/tokenize needs a tokenizer", "prompt")
            ids = s.preprocessor.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": s.models.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        s = serving()
        s.models.resolve(req.model)
        s.llm.input_processor.check_token_ids(req.tokens, "tokens")
        s.preprocessor.need_tokenizer("/detokenize needs a tokenizer", "tokens")
        return {"prompt": s.preprocessor.tokenizer.decode(req.tokens)}

    return app
