"""Kimi-VL processor for vLLM's Kimi-VL path (loaded as remote code from the checkpoint).

vLLM's KimiVLMultiModalProcessor calls `AutoProcessor.from_pretrained(..., trust_remote_code)`
and reads `image_processor.{patch_size, merge_kernel_size, in_token_limit}` and `image_token`.
Like Kimi-VL's published processor, this wraps the checkpoint's own tokenizer (AutoTokenizer) and
the image processor in image_processing_kimi_vl.py, and expands each `<|media_pad|>` in the text
into one placeholder per merge window of its image, so input_ids line up with the image
features. (vLLM sees the placeholders already expanded and leaves them as they are.)
"""

from __future__ import annotations

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin


class KimiVLProcessor(ProcessorMixin):
    # transformers 5 finds the sub-processors from __init__'s argument names and loads them with
    # AutoImageProcessor (preprocessor_config.json's auto_map) and AutoTokenizer.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|media_pad|>"
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, **kwargs) -> BatchFeature:
        if images is None and text is None:
            raise ValueError("give text, images or both")
        return_tensors = kwargs.pop("return_tensors", None)
        image_inputs, grids = {}, []
        if images is not None:
            image_inputs = dict(self.image_processor(images))
            grids = image_inputs["image_grid_hws"].tolist()
        texts = [] if text is None else [text] if isinstance(text, str) else list(text)
        mh, mw = self.image_processor.merge_kernel_size
        index = 0
        for i, t in enumerate(texts):
            parts = t.split(self.image_token)
            out = [parts[0]]
            for part in parts[1:]:
                if index >= len(grids):
                    raise ValueError(f"more {self.image_token} in the text than images given")
                h, w = grids[index]
                out.append(self.image_token * (h // mh * (w // mw)) + part)
                index += 1
            texts[i] = "".join(out)
        if texts and index != len(grids):
            raise ValueError(f"{len(grids)} images but {index} {self.image_token} in the text")
        text_inputs = {}
        if texts:
            text_inputs = self.tokenizer(
                texts, return_tensors=return_tensors, **_tokenizer_kwargs(kwargs)
            )
        return BatchFeature(data={**text_inputs, **image_inputs})

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        names = self.tokenizer.model_input_names + self.image_processor.model_input_names
        return list(dict.fromkeys(names))


def _tokenizer_kwargs(kwargs: dict) -> dict:
    # The few tokenizer options a caller may pass through; anything else (image options) is dropped.
    keep = ("add_special_tokens", "padding", "truncation", "max_length")
    return {k: v for k, v in kwargs.items() if k in keep}
