"""/v1/chat/completions: the messages through the tokenizer's chat template, then one engine request
with `n` samples."""
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.serve.protocol import (APIError, AssistantMessage, ChatChoice, ChatCompletionRequest,
                                 ChatCompletionResponse, error_body, now, random_id)
from kiln.serve.serving import ChoiceStream, Serving, sse, stop_holdback, until_disconnected, usage


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, request: Request):
    model = serving.model_name(req.model)
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tool calling is not supported", "tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    prompt = serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs)
    top_n = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = serving.sampling_params(req, max_tokens, top_n if req.logprobs else None)
    rid, created = random_id("chatcmpl"), now()
    head = {"id": rid, "created": created, "model": model}
    if req.stream:
        stream = await until_disconnected(request, serving.start([prompt], params, rid, "messages", req.cache_salt))
        return StreamingResponse(_stream(serving, req, stream, head, holdback=stop_holdback(params)),
                                 media_type="text/event-stream")

    async def collect():
        final = None
        async for _, out in await serving.start([prompt], params, rid, "messages", req.cache_salt):
            final = out
        return final

    out = await until_disconnected(request, collect())
    choices = []
    for c in out.outputs:
        logprobs = serving.chat_logprobs(c.token_ids, c.logprobs, top_n) if req.logprobs else None
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return JSONResponse(ChatCompletionResponse(**head, choices=choices, usage=usage([out])).model_dump())


async def _stream(serving, req, stream, head, holdback):
    head = {**head, "object": "chat.completion.chunk"}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    top_n = req.top_logprobs or 0
    states: dict[int, ChoiceStream] = {}
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
                if not text and c.finish_reason is None and (not req.logprobs or not tokens):
                    continue
                logprobs = serving.chat_logprobs(tokens, lps, top_n) if req.logprobs else None
                delta = {"content": text} if text else {}
                yield chunk(c.index, delta, logprobs, c.finish_reason, c.stop_reason)
        if include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
    except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse(error_body(f"generation failed: {e}", "server_error"))
    finally:
        await stream.aclose()
    yield sse("[DONE]")
