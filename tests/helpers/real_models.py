"""Third-party models from tiny configs with random initialisation (no downloads), each with one
batch used as the library's docs show: `model(input_ids, attention_mask=...)` with the loss
from `.logits` (a `loss_fn`), or with `labels=...` and the model's own `.loss` (no `loss_fn`).
`build(name, meta=False)` makes the same model and batch for the same name (importable by
spawned processes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import transformers
from torch import nn

transformers.logging.set_verbosity_error()  # tiny configs: warnings about vocabulary ids

BATCH, SEQ, VOCAB = 8, 8, 96
MICROBATCHES = 4


@dataclass
class RealCase:
    """`model(*args, **kwargs)`; the loss is `loss_fn(output, target)`, or `output.loss` when
    `loss_fn` is None (the labels are then among the keyword arguments)."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor | None
    loss_fn: Callable[..., torch.Tensor] | None

    def eager_loss(self, model: nn.Module | None = None) -> torch.Tensor:
        output = (model or self.model)(*self.args, **self.kwargs)
        return output.loss if self.loss_fn is None else self.loss_fn(output, self.target)

    def step(self, pipe: Any) -> torch.Tensor | None:
        return pipe.step(*self.args, target=self.target, **self.kwargs)


def next_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a language model's `.logits` against `target` token ids."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, target)


def _padding_mask() -> torch.Tensor:
    """Right padding on two rows (one in each half of the batch, so two microbatches hold one)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 6:] = 0
    mask[6, 3:] = 0
    return mask


def _decoder(config_class: type, model_class: type, **extra: Any) -> Callable[[], nn.Module]:
    config = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **extra,
    )
    return lambda: model_class(config_class(**config))


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


# name -> (model constructor, the batch as (args, kwargs, target) from a generator, loss_fn)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple], Callable | None]] = {
    # tied input and output embeddings; loss from the logits
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        lambda g: ((_tokens(g),), {"attention_mask": _padding_mask()}, _tokens(g)),
        next_token_loss,
    ),
    # the model's own loss from labels
    "llama": (
        _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
        lambda g: ((_tokens(g),), {"attention_mask": _padding_mask(), "labels": _tokens(g)}, None),
        None,
    ),
    "qwen2": (
        _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        lambda g: ((_tokens(g),), {"attention_mask": _padding_mask()}, _tokens(g)),
        next_token_loss,
    ),
    # mixture of experts with the default experts implementation
    "mixtral": (
        _decoder(
            transformers.MixtralConfig, transformers.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2
        ),
        lambda g: ((_tokens(g),), {"attention_mask": _padding_mask(), "labels": _tokens(g)}, None),
        None,
    ),
    # encoder with a 2-D padding mask
    "bert": (
        lambda: transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        ),
        lambda g: (
            (_tokens(g),),
            {"attention_mask": _padding_mask(), "labels": torch.randint(0, 3, (BATCH,), generator=g)},
            None,
        ),
        None,
    ),
    # encoder-decoder; the decoder's inputs are the shifted labels
    "t5": (
        lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        lambda g: ((), {"input_ids": _tokens(g), "attention_mask": _padding_mask(), "labels": _tokens(g)}, None),
        None,
    ),
    # vision transformer on images
    "vit": (
        lambda: transformers.ViTForImageClassification(
            transformers.ViTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                image_size=16,
                patch_size=4,
                num_labels=5,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        lambda g: ((torch.randn(BATCH, 3, 16, 16, generator=g),), {}, torch.randint(0, 5, (BATCH,), generator=g)),
        classification_loss,
    ),
}
NAMES = tuple(MODELS)


def build(name: str, meta: bool = False) -> RealCase:
    """Model `name` (random initialisation from seed 0; on the meta device with `meta`) and its
    batch (seed 1)."""
    make, batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = make()
    else:
        model = make()
    args, kwargs, target = batch(torch.Generator().manual_seed(1))
    return RealCase(name, model, args, kwargs, target, loss_fn)
