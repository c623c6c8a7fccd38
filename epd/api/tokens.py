"""vLLM's tokenizer routes, which lm-eval and other clients find and use instead of loading the
tokenizer themselves: POST /tokenize (a text prompt, or chat messages), POST /detokenize, GET
/tokenizer_info."""

from __future__ import annotations

from typing import Any

from epd.api.errors import bad_request
from epd.api.prepare import Conversation, PromptBuilder
from epd.api.schema import DetokenizeRequest, TokenizeRequest
from epd.checkpoint.tokenizer import decode_text


def tokenize(builder: PromptBuilder, request: TokenizeRequest) -> dict[str, Any]:
    """The prompt's token ids as /v1/completions would prefill them (with the default
    `add_special_tokens`), their count, the context length, and each token's spelling if
    asked."""
    builder.check_text_fits([request.prompt])
    tokenizer = builder.tokenizer
    ids = list(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
    return tokenized(builder, ids, request.return_token_strs)


def tokenize_chat(
    builder: PromptBuilder, conversation: Conversation, images: list[bytes], spelled: bool
) -> dict[str, Any]:
    """vLLM's chat form: the ids /v1/chat/completions would prefill for the conversation,
    each image's tokens included (its placeholder repeated, as prefill gets it)."""
    _, counts = builder.image_tokens(images)
    return tokenized(builder, builder.prompt_ids(conversation, counts), spelled)


def tokenized(builder: PromptBuilder, ids: list[int], spelled: bool) -> dict[str, Any]:
    return {
        "count": len(ids),
        "max_model_len": builder.context_length,
        "tokens": ids,
        "token_strs": builder.tokenizer.convert_ids_to_tokens(ids) if spelled else None,
    }


def detokenize(builder: PromptBuilder, request: DetokenizeRequest) -> dict[str, str]:
    """The text of token ids of the vocabulary, at most a context's worth."""
    tokens = request.tokens
    if len(tokens) > builder.context_length:
        raise bad_request(
            f"{len(tokens)} tokens are more than the context length of {builder.context_length}",
            param="tokens",
        )
    if outside := [t for t in tokens if t >= builder.vocab_size]:
        raise bad_request(
            f"token id {outside[0]} is outside the vocabulary of {builder.vocab_size}",
            param="tokens",
        )
    return {"prompt": decode_text(builder.tokenizer, tokens)}


def tokenizer_info(builder: PromptBuilder) -> dict[str, Any]:
    """What a client needs to tokenise as the server does: the special tokens, the chat
    template, the context length. (lm-eval takes the routes above only if `eos_token` is
    here.)"""
    tokenizer = builder.tokenizer
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": builder.context_length,
        "vocab_size": builder.vocab_size,
    }
