"""/v1/chat/completions: the messages (and tools) through the tokenizer's chat template, then one engine
request with `n` samples; tool calls parsed out of the output in the model's format (kiln/serve/tools.py)."""
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.serve.protocol import (APIError, AssistantMessage, ChatChoice, ChatCompletionRequest,
                                 ChatCompletionResponse, error_body, now, random_id)
from kiln.runtime.sampling_params import GuidedDecodingParams
from kiln.serve.serving import ChoiceStream, Serving, sse, stop_holdback, until_disconnected, usage
from kiln.serve.tools import JsonCalls, ToolParser, ToolStream, forced_calls_grammar, tool_schemas


def tool_plan(serving: Serving, req: ChatCompletionRequest) -> tuple[ToolParser | None, GuidedDecodingParams | None]:
    """(the parser of the model's tool calls, None when no calls are expected; the grammar of a
    required or named tool_choice). vLLM's rules: `auto` (the default with tools) needs
    --enable-auto-tool-choice and --tool-call-parser; `required` and a named function need no parser:
    without one their calls are a JSON array under a grammar from the tools (tools.JsonCalls)."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, None
    try:
        schemas = tool_schemas(req.tools)
    except ValueError as e:
        raise APIError(400, str(e), "tools") from None
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None, None
    parser = serving.tool_parser
    if choice == "auto" and not (serving.enable_auto_tool_choice and parser):
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                       "--tool-call-parser", "tool_choice")
    if parser is None:
        parser = JsonCalls()
    if choice == "auto":
        return parser, None
    name = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if name not in schemas:
            raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                           f"({', '.join(schemas)})", "tool_choice")
    parallel = req.parallel_tool_calls is not False
    guide = GuidedDecodingParams(grammar=forced_calls_grammar(parser, schemas, name, parallel))
    try:
        guide.check()
    except ValueError as e:
        raise APIError(400, f"the tools' parameters schemas do not compile into a grammar: {e}", "tools") from None
    return parser, guide


def _finish(reason: str | None, calls) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, request: Request):
    model = serving.model_name(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    parser, tool_guide = tool_plan(serving, req)
    prompt = serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs, req.tools)
    top_n = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = serving.sampling_params(req, max_tokens, top_n if req.logprobs else None, tool_guide=tool_guide)
    rid, created = random_id("chatcmpl"), now()
    head = {"id": rid, "created": created, "model": model}
    if req.stream:
        stream = await until_disconnected(request, serving.start([prompt], params, rid, "messages", req.cache_salt,
                                                                 model))
        return StreamingResponse(_stream(serving, req, stream, head, stop_holdback(params), parser),
                                 media_type="text/event-stream")

    async def collect():
        final = None
        async for _, out in await serving.start([prompt], params, rid, "messages", req.cache_salt, model):
            final = out
        return final

    out = await until_disconnected(request, collect())
    choices = []
    for c in out.outputs:
        logprobs = serving.chat_logprobs(c.token_ids, c.logprobs, top_n) if req.logprobs else None
        content, calls = parser.extract(c.text) if parser is not None else (c.text, [])
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls or None),
                                  logprobs=logprobs, finish_reason=_finish(c.finish_reason, calls),
                                  stop_reason=c.stop_reason))
    return JSONResponse(ChatCompletionResponse(**head, choices=choices, usage=usage([out])).model_dump())


async def _stream(serving, req, stream, head, holdback, parser):
    head = {**head, "object": "chat.completion.chunk"}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    top_n = req.top_logprobs or 0
    states: dict[int, ChoiceStream] = {}
    calls: dict[int, ToolStream] = {}  # with a tool parser: each choice's content and tool-call deltas
    final = None

    def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None):
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
                    **extra})

    try:
        # Every choice opens with the assistant's role, as OpenAI's stream does.
        for index in range(req.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for _, out in stream:
            if out.finished:
                final = out
            for c in out.outputs:
                st = states.setdefault(c.index, ChoiceStream(holdback))
                if st.done:
                    continue
                text, tokens, lps = st.advance(c)
                delta = {}
                if parser is not None:
                    ts = calls.setdefault(c.index, ToolStream(parser))
                    text, deltas = ts.feed(text, final=c.finish_reason is not None)
                    if deltas:
                        delta["tool_calls"] = deltas
                if text:
                    delta["content"] = text
                if not delta and c.finish_reason is None and (not req.logprobs or not tokens):
                    continue
                logprobs = serving.chat_logprobs(tokens, lps, top_n) if req.logprobs else None
                made = parser is not None and calls[c.index].calls
                yield chunk(c.index, delta, logprobs, _finish(c.finish_reason, made), c.stop_reason)
        if include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
    except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse(error_body(f"generation failed: {e}", "server_error"))
    finally:
        await stream.aclose()
    yield sse("[DONE]")
