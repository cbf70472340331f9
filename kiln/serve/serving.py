"""What the OpenAI endpoints share: prompts and chat templates to token ids, request fields to
SamplingParams, starting engine requests (errors surface before any byte is sent), merging the
streams of a multi-prompt request, logprobs in OpenAI's two formats, and watching for clients
that hang up."""
import asyncio
import functools
import itertools
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING

from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import APIError, ChatMessage, SamplingFields
from kiln.serve.tools import PARSERS

if TYPE_CHECKING:
    from kiln.runtime.frontend.async_llm import AsyncLLM

# Request fields whose name starts an engine/SamplingParams error message ("max_tokens (300) + ...").
_PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
           "stop_token_ids", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "prompt", "use_beam_search", "best_of", "length_penalty", "early_stopping"}


class ClientDisconnected(Exception):
    pass


class Serving:
    def __init__(self, llm: "AsyncLLM", tokenizer, model_names: list[str], metrics: ServerMetrics,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False):
        self.llm, self.tokenizer, self.metrics = llm, tokenizer, metrics
        self.model_names = model_names
        self.chat_template = chat_template
        self.tool_parser = None if tool_call_parser is None else PARSERS[tool_call_parser]()
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.max_model_len = llm.input_processor.info.max_model_len
        self.vocab_size = llm.model_config.vocab_size
        model = llm.model_config
        total, active = model.parameter_counts()
        self.model_metadata = dict(parameters=total, active_parameters=active,
                                   num_experts=model.moe.num_experts or None,
                                   experts_per_token=model.moe.top_k or None)
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._token_str)
        self.loras: dict = {}  # served adapter name -> LoRARequest
        self._lora_ids = itertools.count(1)

    # -- requests ------------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.loras:
            raise APIError(404, f"The model `{requested}` does not exist. Served: "
                           f"{', '.join([*self.model_names, *self.loras])}", "model", "model_not_found")
        return requested

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in `path` as model `name` (checked now: a bad one is a 400)."""
        from kiln.runtime.lora_request import LoRARequest

        if name in self.loras or name in self.model_names:
            raise APIError(400, f"The model `{name}` is already served", "lora_name")
        lora = LoRARequest(name, next(self._lora_ids), str(path))
        try:
            self.llm.input_processor.check_lora(lora)
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        self.loras[name] = lora

    def remove_lora(self, name: str) -> None:
        """Requests naming it from now on get 404; those running finish with it."""
        if self.loras.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not served", "lora_name", "model_not_found")

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, tool_guide: GuidedDecodingParams | None = None
                        ) -> SamplingParams:
        """tool_guide: the grammar of a required or named tool_choice, which takes the place of the
        request's own structured-output fields (none may be set then)."""
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        fields = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
                      frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty)
        guide = guided_decoding(req)
        if tool_guide is not None:
            if guide is not None:
                raise APIError(400, "a required or named tool_choice cannot be combined with response_format or "
                               "structured outputs", "tool_choice")
            guide = tool_guide
        try:
            return SamplingParams(
                **{k: v for k, v in fields.items() if v is not None}, max_tokens=max_tokens,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, guided_decoding=guide,
                use_beam_search=req.use_beam_search, best_of=getattr(req, "best_of", None),
                length_penalty=req.length_penalty, early_stopping=req.early_stopping)
        except ValueError as e:
            raise bad_request(e) from None

    def text_prompt(self, prompt: str | list[int]) -> dict:
        if isinstance(prompt, str):
            self.need_tokenizer("prompt is text", "prompt")
            ids = self.tokenizer.encode(prompt)  # as LLMEngine does for a text prompt
            text = prompt
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.vocab_size})", "prompt")
            ids, text = list(prompt), None
        if not ids:
            raise APIError(400, "the prompt is empty (it has no tokens)", "prompt")
        return {"prompt_token_ids": ids, "prompt": text}

    def need_tokenizer(self, what: str, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{what}, but the server was started with --skip-tokenizer-init (no "
                           f"tokenizer): send the prompt as token ids to /v1/completions", param)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> dict:
        self.need_tokenizer("chat messages need the tokenizer's chat template", "messages")
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the model's tokenizer has no chat template: use /v1/completions, or "
                           "start `kiln serve` with --chat_template", "messages")
        conversation = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            message = {"role": m.role, "content": content or ""}
            if m.tool_calls:  # as transformers' templates take them: arguments as a dict
                message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            for key in ("tool_call_id", "name"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            conversation.append(message)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, tokenize=False, tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # the template raised (jinja's raise_exception, a bad role ...)
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS etc.
        if not ids:
            raise APIError(400, "the chat prompt is empty (it has no tokens)", "messages")
        return {"prompt_token_ids": ids, "prompt": text}

    async def start(self, prompts: list[dict], params: SamplingParams, request_id: str,
                    prompt_param: str = "prompt", cache_salt: str | None = None, model: str | None = None
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Add one engine request per prompt; returns once each has its first output (so that a bad
        request is an error status, not a broken stream), as one stream of (prompt index, output).
        model: a served LoRA adapter's name runs the prompts with it."""
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        lora = self.loras.get(model)
        gens = [self.metrics.track(self.llm.generate({**p, **salt}, params, f"{request_id}-{i}", lora))
                for i, p in enumerate(prompts)]
        try:
            firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        except BaseException:  # cancelled (the client went away): every generate aborted its request
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            raise
        errors = [e for e in firsts if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            e = errors[0]
            if isinstance(e, ValueError):
                raise bad_request(e, prompt_param)
            if isinstance(e, RuntimeError) and "shut down" in str(e):
                raise APIError(503, "the server is shutting down")
            raise e
        return merge(gens, firsts)

    # -- logprobs ------------------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:  # vLLM's spelling with --return-tokens-as-token-ids
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None],
                            offset: int) -> dict:
        """The legacy completions format; top_logprobs hold the sampled token and the top n."""
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tok, lp in zip(token_ids, logprobs):
            s = self.token_str(tok)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if lp is None:  # the first prompt token has no logprob
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(lp[tok])
                out["top_logprobs"].append({self.token_str(t): v for t, v in lp.items()})
        return out

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int) -> dict:
        content = []
        for tok, lp in zip(token_ids, logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({**self._top(tok, lp[tok]), "top_logprobs": [self._top(t, v) for t, v in top]})
        return {"content": content}

    def _top(self, token_id: int, logprob: float) -> dict:
        s = self.token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", errors="replace"))}


async def merge(gens: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """One stream out of several requests' streams; closing it aborts the requests not finished."""
    tasks = []
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = [i for i, f in enumerate(firsts) if not f.finished]
        if len(live) == 1:
            async for out in gens[live[0]]:
                yield live[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i):
            try:
                async for out in gens[i]:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.ensure_future(pump(i)) for i in live]
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)


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


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(payload) -> str:
    if not isinstance(payload, str):
        payload = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


def _arguments(arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        raise APIError(400, f"a tool call's function.arguments must be a JSON object, got {arguments[:200]!r}",
                       "messages") from None
    if not isinstance(value, dict):
        raise APIError(400, f"a tool call's function.arguments must be a JSON object, got {arguments[:200]!r}",
                       "messages")
    return value


def guided_decoding(req: SamplingFields) -> GuidedDecodingParams | None:
    """The request's structured-output fields as one guide: OpenAI's response_format, vLLM's
    structured_outputs or its older guided_* fields (one of them; 400 naming the field otherwise,
    or when the guide does not parse)."""
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise APIError(400, f"guided_decoding_backend {req.guided_decoding_backend!r} is not available; "
                       f"this server guides with xgrammar", "guided_decoding_backend")
    if req.guided_whitespace_pattern is not None:
        raise APIError(400, "guided_whitespace_pattern is not supported (xgrammar takes none); use "
                       "structured_outputs.disable_any_whitespace", "guided_whitespace_pattern")
    given = {}
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given["response_format"] = dict(json_object=True)
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        given["response_format"] = dict(json=rf.json_schema.json_schema)
    elif rf is not None and rf.type == "structural_tag":
        if not rf.structural_tag:
            raise APIError(400, "response_format structural_tag needs structural_tag", "response_format")
        given["response_format"] = dict(structural_tag=rf.structural_tag)
    if req.structured_outputs is not None:
        given["structured_outputs"] = {("json" if k == "json_schema" else k): v
                                       for k, v in req.structured_outputs.model_dump(exclude_none=True).items()}
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            given[f"guided_{name}"] = {name: value}
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"only one structured-output field may be set, got {', '.join(given)}", next(iter(given)))
    (param, fields), = given.items()
    try:
        guide = GuidedDecodingParams(**fields)
        guide.check()
    except ValueError as e:
        detail = str(e).split(" is not valid: ", 1)
        message = f"{param} is not valid: {detail[1]}" if len(detail) == 2 else f"{param}: {e}"
        raise APIError(400, message, param) from None
    return guide


def bad_request(e: Exception, prompt_param: str = "prompt") -> APIError:
    msg = str(e)
    first = msg.split(" ", 1)[0]
    param = first if first in _PARAMS else None
    if param == "prompt":
        param = prompt_param
    return APIError(400, msg, param)


async def until_disconnected(request, work: Awaitable):
    """Await `work` unless the client hangs up first: then cancel it (its requests are aborted)
    and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
