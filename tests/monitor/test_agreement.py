"""Ranks started with different configs or models stop at start, naming the difference."""

from __future__ import annotations

import pytest
import torch
from support import SyntheticTokens, fit_tiny, tiny_config
from torch import nn

from disttrain import Trainer
from disttrain.data import collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.testing import DistributedTestError, run_distributed


def _fit_with_rank_dependent(what: str, run_dir: str) -> None:
    import torch.distributed as dist

    odd = dist.get_rank() == 1
    if what == "config":
        fit_tiny(2, run_dir, lr=0.01 if odd else 0.003)
        return
    cfg = tiny_config(steps=2)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    if odd:  # same config, different code: a norm without parameters
        model.ln_f = nn.LayerNorm(cfg.model.d_model, elementwise_affine=False)
    Trainer(model, SyntheticTokens(), token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()


@pytest.mark.parametrize("what,named", [
    ("config", "config train.lr is 0.003 on rank 0 but 0.01 on rank 1"),
    ("model", "parameter ln_f.weight is (32,) float32 on rank 0 but absent on rank 1"),
])
def test_ranks_that_disagree_stop_at_start(what, named, tmp_path):
    with pytest.raises(DistributedTestError, match="ranks disagree at start") as err:
        run_distributed(_fit_with_rank_dependent, 2, args=(what, str(tmp_path)), timeout=60)
    assert named in str(err.value)
