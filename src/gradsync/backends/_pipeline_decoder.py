"""Pipeline stages of a Transformers decoder (``LlamaForCausalLM`` and the models laid out as
it is), split by layer names: ``pp_split=["model.layers.2"]``.

Such a model's forward is no ``nn.Sequential``: it embeds the tokens, builds the causal mask
and the rotary position embeddings once, runs every decoder layer with them, then the final
norm and the head. A stage runs its part of that: the first embeds, every stage computes the
mask and the rotary embeddings of its own input (they depend on the sequence only, not on the
weights), runs its layers, and the last applies the norm and returns the head's logits. The
activation between stages is the hidden state ``(batch, sequence, hidden)``.

Each rank keeps the whole model object with the other stages' layers, embedding, norm and
head removed, so the stage's parameter names are the whole model's (checkpoints reshard to
one process by name). A model whose head shares its weight with the embedding
(``tie_word_embeddings``) is refused: the tie would cross the first and last stage.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradsync.errors import ConfigError, UsageError

#: Where the decoder layers sit in the model (the split paths are ``f"{LAYERS}.{i}"``).
LAYERS = "model.layers"


def is_decoder(model: nn.Module) -> bool:
    """Whether ``model`` has the layout of a Transformers causal-LM decoder: ``model.embed_tokens``,
    ``model.layers`` (a ModuleList), ``model.norm``, ``model.rotary_emb`` and ``lm_head``."""
    base = model._modules.get("model")
    if base is None or not isinstance(model._modules.get("lm_head"), nn.Module):
        return False
    held = base._modules
    return isinstance(held.get("layers"), nn.ModuleList) and all(
        isinstance(held.get(name), nn.Module) for name in ("embed_tokens", "norm", "rotary_emb")
    )


def starts(model: nn.Module, paths: Sequence[str], stages: int) -> list[int]:
    """The index of the first layer of each stage and the layer count at the end, having
    checked that ``paths`` name decoder layers in order, leave no stage empty and cross no
    tied weight; one ConfigError line otherwise (before any collective)."""
    name = f"pp_split={list(paths)!r}"
    layers = model.get_submodule(LAYERS)
    count = len(layers._modules)
    found = [0]
    for path in paths:
        head, _, index = path.rpartition(".")
        if head != LAYERS or not index.isdigit() or int(index) >= count:
            raise ConfigError(
                f"{name}: {path!r} is no layer of the {type(model).__name__}, whose stages are "
                f"cut at its decoder layers: give '{LAYERS}.i' with 0 < i < {count}"
            )
        if int(index) <= found[-1]:
            raise ConfigError(
                f"{name} leaves stage {len(found) - 1} without a decoder layer: {path!r} does "
                "not come after the previous cut; name the layers in increasing order"
            )
        found.append(int(index))
    head_weight = getattr(model.get_submodule("lm_head"), "weight", None)
    embed_weight = getattr(model.get_submodule("model.embed_tokens"), "weight", None)
    if head_weight is not None and head_weight is embed_weight:
        raise ConfigError(
            f"{name} puts the embedding on stage 0 and lm_head on stage {stages - 1}, and the "
            f"{type(model).__name__} ties their weights (tie_word_embeddings=True), which "
            "cannot cross stages; build it with tie_word_embeddings=False"
        )
    config = getattr(model.get_submodule("model"), "config", None)
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        window is not None and getattr(config, "use_sliding_window", True)
    ):
        raise ConfigError(
            f"{name}: the {type(model).__name__} has sliding-window attention (sliding_window="
            f"{window!r}), and a stage builds the full causal mask only; build it with "
            "sliding_window=None, or split it with a callable"
        )
    return [*found, count]


def stage(model: nn.Module, bounds: list[int], index: int) -> nn.Module:
    """Stage ``index`` of ``model`` (cut at ``bounds``, from :func:`starts`): the model itself
    with every other stage's parts removed, running its part in forward."""
    base = model.get_submodule("model")
    layers = base.get_submodule("layers")
    for i, key in enumerate(list(layers._modules)):
        if not bounds[index] <= i < bounds[index + 1]:
            del layers._modules[key]  # the others keep their keys: "model.layers.3" stays
    first, last = index == 0, index == len(bounds) - 2
    if not first:
        del base._modules["embed_tokens"]
    if not last:
        del base._modules["norm"]
        del model._modules["lm_head"]
    model.__class__ = type(f"Stage{type(model).__name__}", (type(model),), {"forward": _forward})
    return model


def feed(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``pipeline_step``'s ``inputs`` as a mapping: ``{"input_ids": ..., "attention_mask":
    ...}`` (the mask optional); one UsageError line for other keys or a mask whose shape is
    not the ids'."""
    unknown = sorted(set(inputs) - {"input_ids", "attention_mask"})
    if "input_ids" not in inputs or unknown:
        raise UsageError(
            f"accel.pipeline_step() got inputs with the keys {sorted(inputs)}; a decoder "
            "pipeline takes {'input_ids': ids, 'attention_mask': mask} (the mask optional)"
        )
    check_mask(inputs)
    return inputs["input_ids"], inputs.get("attention_mask")


def check_mask(inputs: Mapping[str, Any]) -> None:
    """The padding mask of ``inputs`` (where given with ``input_ids``) has the ids' shape,
    ``(batch, sequence)``; one UsageError line otherwise."""
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if mask is None or ids is None:
        return
    got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    if got != tuple(ids.shape):
        raise UsageError(
            f"accel.pipeline_step() got inputs['attention_mask'] of shape {got} and input_ids "
            f"of shape {tuple(ids.shape)}: the padding mask is (batch, sequence), 1 on tokens "
            "and 0 on padding"
        )


@functools.cache
def _mask_maker() -> tuple[Callable[..., Any], tuple[str, ...]]:
    """transformers' ``create_causal_mask`` and the names of its parameters (the cache's has
    changed across releases: ``past_key_values`` and ``cache_position``, then ``cache``)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask, tuple(inspect.signature(create_causal_mask).parameters)


class Part(nn.Module):
    """One stage of a decoder with several stages per rank: the modules of its part of the
    forward (shared with the model, whose root keeps the parameter names)."""

    def __init__(self, model: nn.Module, bounds: list[int], index: int) -> None:
        super().__init__()
        base: Any = model.get_submodule("model")
        first, last = index == 0, index == len(bounds) - 2
        self.config = base.config
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList(list(base.layers)[bounds[index] : bounds[index + 1]])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.get_submodule("lm_head") if last else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return _run(self.config, self, self.layers, self, x, attention_mask)


def parts(model: nn.Module, bounds: list[int]) -> list[nn.Module]:
    """A module running each stage of ``model`` cut at ``bounds`` (several stages per rank)."""
    return [Part(model, bounds, s) for s in range(len(bounds) - 1)]


def _forward(
    self: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """A decoder stage's forward: token ids (first stage) or hidden states in; hidden states,
    or the logits on the last stage, out."""
    base: Any = self._modules["model"]
    return _run(base.config, base, base.layers, self, x, attention_mask)


def _run(
    config: Any,
    base: nn.Module,
    layers: Any,
    top: nn.Module,
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Embed (where ``base`` holds ``embed_tokens``), build the mask (causal, and the padding
    of ``attention_mask`` when given) and the rotary embeddings of the sequence, run
    ``layers``, then the norm and ``top``'s head (where held)."""
    held: Any = base._modules
    hidden = held["embed_tokens"](x) if held.get("embed_tokens") is not None else x
    steps = torch.arange(hidden.shape[1], device=hidden.device)
    positions = steps.unsqueeze(0)
    make_mask, names = _mask_maker()
    given = {
        "config": config,
        "inputs_embeds": hidden,
        "input_embeds": hidden,  # the name before transformers 5
        "attention_mask": attention_mask,
        "cache": None,
        "past_key_values": None,
        "cache_position": steps,
        "position_ids": positions,
    }
    mask = make_mask(**{name: given[name] for name in names if name in given})
    rotary = held["rotary_emb"](hidden, position_ids=positions)
    for layer in layers:
        hidden = layer(
            hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions
        )
    if held.get("norm") is None:
        return hidden
    return top._modules["lm_head"](held["norm"](hidden))  # type: ignore[no-any-return, misc]
