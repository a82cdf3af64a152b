"""One rank of a replica group in the fault-tolerance tests (started by torchrun through
disttrain.launch.replicas): the tiny GPT on synthetic tokens, its run directory the
first argument, the config's keys as JSON in the second."""

from __future__ import annotations

import json
import sys

import torch
from support import SyntheticTokens, tiny_config

from disttrain import Trainer
from disttrain.data import collate_token_batch
from disttrain.models import GPT, token_loss

if __name__ == "__main__":
    run_dir, keys = sys.argv[1], json.loads(sys.argv[2])
    cfg = tiny_config(**keys)
    torch.manual_seed(cfg.train.seed)
    Trainer(GPT(cfg.model), SyntheticTokens(mask=True), token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()
