"""The prefill step, free of I/O: prompt + image embeddings → first token + latent KV."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from epd.generation.params import SamplingParams
from epd.generation.sampling import make_generator, sample, token_logprob
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.multimodal.prompt import scatter_image_embeddings
from epd.wire.messages import KVHandoff


class PrefillEngine:
    def __init__(
        self, lm: DeepseekV3ForCausalLM, tokenizer: PreTrainedTokenizerBase, placeholder_id: int
    ) -> None:
        self.lm, self.tokenizer, self.placeholder_id = lm, tokenizer, placeholder_id
        self.device = lm.lm_head.weight.device

    @torch.inference_mode()
    def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        image_embeddings: torch.Tensor | None,
        sampling: SamplingParams,
        reply_to: str = "",
    ) -> KVHandoff:
        """Prefill one prompt; image_embeddings (N, hidden) fill its N placeholder slots."""
        ids = torch.tensor(prompt_ids, device=self.device)
        embeds = self.lm.embed(ids)
        if image_embeddings is not None:
            embeds = scatter_image_embeddings(
                embeds, ids, image_embeddings.to(self.device), self.placeholder_id
            )
        hidden, cache = self.lm.prefill(embeds)
        logits = self.lm.logits(hidden[-1])
        generator = make_generator(sampling.seed)
        token = sample(logits, sampling, generator)
        logprob = None
        if sampling.logprobs:
            logprob = token_logprob(logits, token, sampling.top_logprobs, self.tokenizer)
        return KVHandoff(
            request_id=request_id,
            reply_to=reply_to,
            prompt_tokens=len(prompt_ids),
            first_token=token,
            first_logprob=logprob,
            sampling=sampling,
            rng_state=generator.get_state(),
            cache=cache.tensor().cpu(),  # here, off the event loop that sends it
        )
