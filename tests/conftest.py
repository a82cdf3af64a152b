"""Suite-wide settings: NCCL's rules on every Communicator (Gloo runs obey what NCCL
would impose: no receive-from-any on data groups, point-to-point messages matched in
posting order only). Set here, before any test spawns a process, so workers inherit it.

Ranks of ``run_distributed`` worlds are forked, not spawned: a spawned rank imports
torch again (several seconds on a small machine, per rank, per world)."""

import os

from disttrain.comm.collectives import NCCL_RULES_ENV
from disttrain.testing import START_METHOD_ENV

os.environ.setdefault(NCCL_RULES_ENV, "1")
os.environ.setdefault(START_METHOD_ENV, "fork")
