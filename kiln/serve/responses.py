"""A request's RequestOutputs as OpenAI's responses and SSE chunks (protocol models both): choices
numbered across prompts, text held back while it could still become a stop string, logprobs in
OpenAI's two formats, tool calls read out of a chat's output (whole, or delta by delta), usage."""
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from pydantic import BaseModel

from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                 ChatCompletionStreamResponse, ChatLogprobs, ChatStreamChoice, CompletionChoice,
                                 CompletionLogprobs, CompletionRequest, CompletionResponse, CompletionStreamChoice,
                                 CompletionStreamResponse, DeltaMessage, DeltaToolCall, PromptTokensDetails,
                                 TokenLogprob, TopLogprob, UsageInfo, error_body)
from kiln.serve.tools import ToolParser, ToolStream

Outputs = AsyncIterator[tuple[int, RequestOutput]]


@dataclass
class ResponseHead:
    """What every response and chunk of a request starts with."""
    id: str
    created: int
    model: str


class Responses:
    """The tokenizer spells the tokens of logprobs and a token-id prompt's echo (without one, a token is
    `token_id:<id>`, as vLLM spells it with --return-tokens-as-token-ids, and nothing is echoed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._token_str)

    # -- /v1/completions: choice index = prompt * n + sample ---------------------------------------
    def completion(self, req: CompletionRequest, head: ResponseHead, outputs: list[RequestOutput]
                   ) -> CompletionResponse:
        ids = req.return_token_ids or self.tokenizer is None
        echo_logprobs = req.echo and req.logprobs is not None
        choices = []
        for i, out in enumerate(outputs):
            prompt_text = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None:
                    tokens, lps = list(c.token_ids), list(c.logprobs)
                    if echo_logprobs:
                        tokens, lps = out.prompt_token_ids + tokens, list(out.prompt_logprobs) + lps
                    logprobs = self.completion_logprobs(tokens, lps, 0)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prompt_text + c.text,
                                                logprobs=logprobs, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason,
                                                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                                                token_ids=list(c.token_ids) if ids else None))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(**asdict(head), choices=choices, usage=usage(outputs))

    async def completion_chunks(self, req: CompletionRequest, head: ResponseHead, params: SamplingParams,
                                outputs: Outputs) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        holdback = stop_holdback(params)
        ids = req.return_token_ids or self.tokenizer is None
        states: dict[int, ChoiceStream] = {}
        offsets: dict[int, int] = {}
        finals = {}

        def chunk(choices: list[CompletionStreamChoice], **fields) -> str:
            return sse(CompletionStreamResponse(**asdict(head), object="text_completion", choices=choices, **fields))

        try:
            async for i, out in outputs:
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
                        text = self._prompt_text(out) + text
                        if req.logprobs is not None:
                            tokens, lps = out.prompt_token_ids + tokens, list(out.prompt_logprobs) + lps
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self.completion_logprobs(tokens, lps, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                    choice = CompletionStreamChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                    **({"token_ids": tokens} if ids else {}))
                    yield chunk([choice], **extra)
            if include_usage:
                yield chunk([], usage=usage([finals[i] for i in sorted(finals)]))
        except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
            yield sse_error(f"generation failed: {e}")
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions: one prompt, n samples; tool calls read by the request's parser -------
    def chat(self, req: ChatCompletionRequest, head: ResponseHead, parser: ToolParser | None,
             out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            logprobs = self.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            content, calls = parser.extract(c.text) if parser is not None else (c.text, [])
            message = AssistantMessage(content=content, tool_calls=calls or None)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=_finish(c.finish_reason, calls), stop_reason=c.stop_reason))
        return ChatCompletionResponse(**asdict(head), choices=choices, usage=usage([out]))

    async def chat_chunks(self, req: ChatCompletionRequest, head: ResponseHead, params: SamplingParams,
                          parser: ToolParser | None, outputs: Outputs) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        holdback = stop_holdback(params)
        top_n = req.top_logprobs or 0
        states: dict[int, ChoiceStream] = {}
        calls: dict[int, ToolStream] = {}  # with a tool parser: each choice's content and tool-call deltas
        final = None

        def chunk(choices: list[ChatStreamChoice], **fields) -> str:
            return sse(ChatCompletionStreamResponse(**asdict(head), object="chat.completion.chunk", choices=choices,
                                                    **fields))

        def choice(index, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                           stop_reason=stop_reason)], **extra)

        try:
            # Every choice opens with the assistant's role, as OpenAI's stream does.
            for index in range(req.n):
                yield choice(index, DeltaMessage(role="assistant", content=""))
            async for _, out in outputs:
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
                        if deltas:  # each as the parser wrote it: a call's first delta has its id and name
                            delta["tool_calls"] = [DeltaToolCall.model_validate(d) for d in deltas]
                    if text:
                        delta["content"] = text
                    if not delta and c.finish_reason is None and (not req.logprobs or not tokens):
                        continue
                    logprobs = self.chat_logprobs(tokens, lps, top_n) if req.logprobs else None
                    made = parser is not None and calls[c.index].calls
                    yield choice(c.index, DeltaMessage(**delta), logprobs, _finish(c.finish_reason, made),
                                 c.stop_reason)
            if include_usage and final is not None:
                yield chunk([], usage=usage([final]))
        except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
            yield sse_error(f"generation failed: {e}")
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    # -- logprobs ----------------------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None],
                            offset: int) -> CompletionLogprobs:
        """The legacy completions format; top_logprobs hold the sampled token and the top n."""
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for tok, lp in zip(token_ids, logprobs):
            s = self.token_str(tok)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if lp is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(lp[tok])
                out.top_logprobs.append({self.token_str(t): v for t, v in lp.items()})
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int) -> ChatLogprobs:
        content = []
        for tok, lp in zip(token_ids, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(TokenLogprob(**self._top(tok, lp[tok]), top_logprobs=[TopLogprob(**self._top(t, v))
                                                                                 for t, v in top]))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> dict:
        s = self.token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", errors="replace"))}

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt as echo shows it: its text, or its token ids decoded."""
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(out.prompt_token_ids)


class ChoiceStream:
    """What one streamed choice has sent. While a sequence runs, the last characters that could
    begin a stop string are held back: the engine cuts the text when the stop string completes."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.text_sent = 0
        self.tokens_sent = 0
        self.started = False
        self.done = False

    def advance(self, out: CompletionOutput) -> tuple[str, list[int], list | None]:
        final = out.finish_reason is not None
        end = len(out.text) if final else len(out.text) - self.holdback
        text = out.text[self.text_sent:end] if end > self.text_sent else ""
        self.text_sent = max(self.text_sent, end)
        tokens = out.token_ids[self.tokens_sent:]
        logprobs = out.logprobs[self.tokens_sent:] if out.logprobs is not None else None
        self.tokens_sent = len(out.token_ids)
        self.done = final
        return text, tokens, logprobs


def stop_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _finish(reason: str | None, calls) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def sse(chunk: BaseModel) -> str:
    """A chunk as one server-sent event: the fields the server set (protocol.py's streamed chunks)."""
    return _event(chunk.model_dump(exclude_unset=True))


def sse_error(message: str) -> str:
    return _event(error_body(message, "server_error"))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
