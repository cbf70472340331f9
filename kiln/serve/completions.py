"""/v1/completions: one engine request per prompt, `n` choices each (index = prompt * n + sample)."""
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.serve.protocol import (APIError, CompletionChoice, CompletionRequest, CompletionResponse, error_body,
                                 now, random_id)
from kiln.serve.serving import ChoiceStream, Serving, sse, stop_holdback, until_disconnected, usage


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def create_completion(serving: Serving, req: CompletionRequest, request: Request):
    model = serving.model_name(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    prompts = [serving.text_prompt(p) for p in _prompts(req.prompt)]
    echo_logprobs = req.echo and req.logprobs is not None
    params = serving.sampling_params(req, req.max_tokens, req.logprobs,
                                     prompt_logprobs=req.logprobs if echo_logprobs else None)
    rid, created = random_id("cmpl"), now()
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if req.stream:
        stream = await until_disconnected(request, serving.start(prompts, params, rid, cache_salt=req.cache_salt,
                                                                 model=model))
        return StreamingResponse(_stream(serving, req, prompts, params, stream, head),
                                 media_type="text/event-stream")

    async def collect():
        finals = {}
        async for i, out in await serving.start(prompts, params, rid, cache_salt=req.cache_salt, model=model):
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(prompts))]

    outputs = await until_disconnected(request, collect())
    ids = req.return_token_ids or serving.tokenizer is None
    choices = []
    for i, out in enumerate(outputs):
        prompt_text = _prompt_text(serving, prompts[i]) if req.echo else ""
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                tokens, lps = list(c.token_ids), list(c.logprobs)
                if echo_logprobs:
                    tokens, lps = out.prompt_token_ids + tokens, list(out.prompt_logprobs) + lps
                logprobs = serving.completion_logprobs(tokens, lps, 0)
            choices.append(CompletionChoice(index=i * req.n + c.index, text=prompt_text + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                                            token_ids=list(c.token_ids) if ids else None))
    choices.sort(key=lambda c: c.index)
    return JSONResponse(CompletionResponse(**head, choices=choices, usage=usage(outputs)).model_dump())


def _prompt_text(serving: Serving, prompt: dict) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    if serving.tokenizer is None:
        return ""
    return serving.tokenizer.decode(prompt["prompt_token_ids"])


async def _stream(serving, req, prompts, params, stream, head):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    holdback = stop_holdback(params)
    ids = req.return_token_ids or serving.tokenizer is None
    states: dict[int, ChoiceStream] = {}
    offsets: dict[int, int] = {}
    finals = {}
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                st = states.setdefault(index, ChoiceStream(holdback))
                if st.done or (not st.started and not c.token_ids and c.finish_reason is None):
                    continue  # nothing to say yet (the prompt is still being prefilled)
                first = not st.started
                text, tokens, lps = st.advance(c)
                if not text and c.finish_reason is None and not (tokens and (req.logprobs is not None or ids)):
                    continue
                st.started = True
                if first and req.echo:
                    text = _prompt_text(serving, prompts[i]) + text
                    if req.logprobs is not None:
                        tokens, lps = out.prompt_token_ids + tokens, list(out.prompt_logprobs) + lps
                logprobs = None
                if req.logprobs is not None:
                    logprobs = serving.completion_logprobs(tokens, lps, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                if ids:
                    choice["token_ids"] = tokens
                yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
    except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse(error_body(f"generation failed: {e}", "server_error"))
    finally:
        await stream.aclose()
    yield sse("[DONE]")
