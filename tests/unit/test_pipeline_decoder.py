"""A Transformers decoder cut by layer names (``pp_split=["model.layers.2"]``), in one process:
the stages run one after the other give the whole model's logits, keep the whole model's
parameter names between them, and a bad split is one ConfigError line."""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync import ConfigError
from gradsync.backends import _pipeline

pytest.importorskip("transformers")

from scenarios.pp_decoder import VOCAB, make_llama


@pytest.mark.parametrize("split", [["model.layers.2"], ["model.layers.1", "model.layers.3"]])
def test_the_stages_in_turn_give_the_whole_models_logits(split):
    whole = make_llama()
    stages = [
        _pipeline.Cut(copy.deepcopy(whole), split, len(split) + 1).stage(i)
        for i in range(len(split) + 1)
    ]
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, whole(x).logits, rtol=1e-6, atol=1e-6)
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert sorted(n for held in names for n in held) == sorted(
        n for n, _ in whole.named_parameters()
    )
    assert names[0][0] == "model.embed_tokens.weight" and names[-1][-1] == "lm_head.weight"


@pytest.mark.parametrize(
    ("split", "tied", "says"),
    [
        (["model.layers.9"], False, "is no layer of the LlamaForCausalLM"),
        (["model.norm"], False, "is no layer of the LlamaForCausalLM"),
        (["model.layers.0"], False, "leaves stage 0 without a decoder layer"),
        (["model.layers.2", "model.layers.2"], False, "leaves stage 1 without a decoder layer"),
        (["model.layers.2"], True, "tie_word_embeddings=True"),
    ],
)
def test_a_bad_cut_is_one_config_error_line(split, tied, says):
    with pytest.raises(ConfigError) as err:
        _pipeline.Cut(make_llama(tied=tied), split, len(split) + 1)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_same_loop_runs_a_decoder_in_one_process():
    """Without a pipeline, pipeline_step runs the whole decoder and hands its logits (not its
    output object) to the loss, as the last stage does."""
    from torch.utils.data import DataLoader

    from gradsync import Accelerator

    from scenarios.pp_decoder import Tokens, counted, token_loss

    accel = Accelerator(backend="single", gradient_accumulation_steps=1, count_items=counted)
    model, loader = accel.prepare(make_llama(), DataLoader(Tokens(4), batch_size=4))
    x, y, _ = next(iter(loader))
    with accel.accumulate(model):
        loss = accel.pipeline_step(model, x, y, token_loss, "sum")
    want = token_loss(make_llama()(x).logits, y)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
