"""An OpenAI request body -> prompt token ids and SamplingParams, with 400s naming the field.

Done before anything is queued, so context-length errors, out-of-vocabulary logit_bias ids and
the like are refused up front. The choices of one prompt differ only in their seed: choice i
samples with `seed + i` (wrapping inside the 64-bit range), so a seeded request with n > 1 is
reproducible and its choices differ.
"""

from __future__ import annotations

from dataclasses import replace

from dynaspec.models.tokenizer import ChatTemplateError
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from dynaspec.server.tools import ToolPlan
from dynaspec.structured_params import StructuredOutputParams

Req = CompletionRequest | ChatCompletionRequest


def prompts_ids(tok, req: Req, tools: ToolPlan | None) -> list[list[int]]:
    """One token-id list per prompt (chat: the rendered conversation)."""
    if isinstance(req, ChatCompletionRequest):
        extra = {"tools": req.tool_dicts()} if tools is not None else {}
        try:
            text = tok.apply_chat_template(req.chat_messages(), **extra)
        except ChatTemplateError as exc:
            raise APIError(400, f"chat template failed: {exc}", "messages",
                           "chat_template_error") from None
        except Exception as exc:  # noqa: BLE001 - a template's own error, from user data
            raise APIError(400, f"chat template failed: {type(exc).__name__}: {exc}",
                           "messages", "chat_template_error") from None
        return [tok.encode(text)]
    return [_encode_prompt(tok, p) if isinstance(p, str) else list(p) for p in req.prompt]


def _encode_prompt(tok, text: str) -> list[int]:
    """A text prompt's ids. Text made only of characters the vocabulary cannot encode (some
    control characters, which the tokenizer drops) has no ids: it is generated from the start of
    a document (the BOS token, else the EOS document separator), as OpenAI's completions API
    does for an empty prompt, rather than refused for a prompt the client did send."""
    ids = tok.encode(text)
    if not ids:
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        ids = [start] if start is not None else []
    return ids


def base_params(req: Req, num_prompt: int, ctx: int, vocab: int, tok,
                grammar: StructuredOutputParams | None, logprobs_floor: int | None = None
                ) -> SamplingParams:
    chat = isinstance(req, ChatCompletionRequest)
    where = "messages" if chat else "prompt"
    if num_prompt == 0:
        raise APIError(400, f"{where} is empty (0 tokens)", where)
    room = ctx - num_prompt
    if room <= 0:
        raise APIError(400, f"{where} has {num_prompt} tokens but the model's context length "
                       f"is {ctx}, which leaves no room to generate", where,
                       "context_length_exceeded")
    limit = req.token_limit if isinstance(req, ChatCompletionRequest) else req.max_tokens
    if limit is not None and limit > room:
        name = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) \
            and req.max_completion_tokens else "max_tokens"
        raise APIError(400, f"{name} {limit} + {num_prompt} prompt tokens exceed the model's "
                       f"context length {ctx}", name, "context_length_exceeded")
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) \
        if isinstance(req, ChatCompletionRequest) else req.logprobs
    if logprobs_floor is not None and logprobs is None:
        logprobs = logprobs_floor  # best_of ranks by them; the response leaves them out
    max_tokens = limit or room
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens,
            stop=req.stop_list, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos), logprobs=logprobs, structured_output=grammar,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logit_bias=logit_bias(req.logit_bias, vocab),
            min_tokens=min(req.min_tokens or 0, max_tokens),  # documented: at most the limit
            bad_words_ids=bad_words_ids(tok, req.bad_words or ()))
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ")[0]) from None


def logit_bias(raw: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (raw or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias")
        if int(key) >= vocab:
            continue  # a token that can never be generated: its bias changes nothing
        if not -100.0 <= bias <= 100.0:
            raise APIError(400, f"logit_bias[{key!r}] = {bias} is outside [-100, 100]",
                           "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def bad_words_ids(tok, words) -> tuple[tuple[int, ...], ...]:
    """Each word as it would be tokenized at the start of a text and after a space (vLLM)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        if not word.strip():
            raise APIError(400, "bad_words entries must contain a non-space character",
                           "bad_words")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tok.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i's params: its own seed stream when the request is seeded."""
    if params.seed is None or i == 0:
        return params
    seed = params.seed + i
    if seed >= 2**64:
        seed -= 2**64
    return replace(params, seed=seed)
