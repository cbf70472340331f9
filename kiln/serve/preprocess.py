"""An OpenAI request as the engine takes it: the served model and adapter it names, its prompts (a
chat's rendered by the chat template), its SamplingParams (structured outputs, or a required or named
tool_choice, as a guide) and, for a chat with tools, the parser its output's tool calls are read with.

The prompts are not checked here: the engine's input processor checks every prompt as it is added
(kiln/runtime/frontend/input_processor.py), and the app answers its InvalidRequestError with a 400.
What is checked here is what only an OpenAI request has: its fields' combinations, its structured
outputs and tools, its chat template."""
import json
from dataclasses import dataclass

from kiln.runtime.lora_request import LoRARequest
from kiln.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from kiln.serve.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from kiln.serve.served_models import ServedModels
from kiln.serve.tools import PARSERS, JsonCalls, ToolParser, forced_calls_grammar, tool_schemas


@dataclass
class EngineInputs:
    model: str  # the served name the response answers with
    lora: LoRARequest | None
    prompts: list[dict]  # one engine request each, as AsyncLLM.generate takes them
    params: SamplingParams
    tool_parser: ToolParser | None = None  # a chat's, when tool calls are expected in its output


class Preprocessor:
    def __init__(self, models: ServedModels, tokenizer, chat_template: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False):
        self.models, self.tokenizer, self.chat_template = models, tokenizer, chat_template
        self.tool_parser = None if tool_call_parser is None else PARSERS[tool_call_parser]()
        self.enable_auto_tool_choice = enable_auto_tool_choice

    def completion(self, req: CompletionRequest) -> EngineInputs:
        """One prompt per text or token-id list in `prompt`, the choices of prompt i being i * n .. i * n + n - 1."""
        model, lora = self.models.resolve(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        salt = {} if req.cache_salt is None else {"cache_salt": req.cache_salt}
        prompts = [{**({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}), **salt}
                   for p in _prompts(req.prompt)]
        echo_logprobs = req.echo and req.logprobs is not None
        params = self.sampling_params(req, req.max_tokens, req.logprobs,
                                      prompt_logprobs=req.logprobs if echo_logprobs else None)
        return EngineInputs(model, lora, prompts, params)

    def chat(self, req: ChatCompletionRequest) -> EngineInputs:
        model, lora = self.models.resolve(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        parser, tool_guide = self.tool_plan(req)
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                  req.chat_template_kwargs, req.tools)
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      tool_guide=tool_guide)
        return EngineInputs(model, lora, [prompt], params, parser)

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, tool_guide: GuidedDecodingParams | None = None
                        ) -> SamplingParams:
        """tool_guide: the grammar of a required or named tool_choice, which takes the place of the
        request's own structured-output fields (none may be set then). Values SamplingParams refuses
        raise its InvalidRequestError, naming the field."""
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
        return SamplingParams(
            **{k: v for k, v in fields.items() if v is not None}, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, guided_decoding=guide,
            use_beam_search=req.use_beam_search, best_of=getattr(req, "best_of", None),
            length_penalty=req.length_penalty, early_stopping=req.early_stopping)

    def need_tokenizer(self, what: str, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{what}, but the server was started with --skip-tokenizer-init (no "
                           f"tokenizer): send the prompt as token ids to /v1/completions", param)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> dict:
        """The messages through the chat template, as a prompt of token ids with its text."""
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
        # the template writes BOS and the like itself
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text}

    def tool_plan(self, req: ChatCompletionRequest) -> tuple[ToolParser | None, GuidedDecodingParams | None]:
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
        parser = self.tool_parser
        if choice == "auto" and not (self.enable_auto_tool_choice and parser):
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


def _prompts(prompt) -> list:
    """`prompt` as a list of prompts: a text, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


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
    except ValueError as e:  # the guide names itself guided_decoding: the request's field is `param`
        detail = str(e).split(" is not valid: ", 1)
        message = f"{param} is not valid: {detail[1]}" if len(detail) == 2 else f"{param}: {e}"
        raise APIError(400, message, param) from None
    return guide
