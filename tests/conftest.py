"""Suite-wide settings: NCCL's rules on every Communicator (Gloo runs obey what NCCL
would impose: no receive-from-any on data groups, point-to-point messages matched in
posting order only). Set here, before any test spawns a process, so workers inherit it."""

import os

from disttrain.comm.collectives import NCCL_RULES_ENV

os.environ.setdefault(NCCL_RULES_ENV, "1")
