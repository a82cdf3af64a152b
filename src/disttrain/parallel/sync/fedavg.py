"""Federated averaging: clients (the dp ranks) train on their own non-IID partition
of the training set; after each round the models are averaged, weighted by the number
of samples each client trained on.

Partitioning: client ``c`` of ``C`` holds the contiguous index range
``[c N / C, (c + 1) N / C)`` of the dataset (:func:`client_partition`). Datasets
numbered file by file (the default corpus: windows shard by shard, one shard per source
file) thus give each client different files - different modules, different styles -
which is the non-IID case federated learning is about. The samples never leave their
client: only parameters are communicated.

A round is ``sync_every`` local steps (not epochs: a partition of the default corpus
holds tens of thousands of windows, so even one local epoch would be thousands of
steps, far past the point where client models drift apart). In each step a chosen client
trains on ``global_batch / dp`` samples drawn from its partition in a seeded order
(epoch after epoch over the partition). At the start of each round the same seeded draw
on every rank chooses ``max(1, round(fed_fraction x C))`` clients; the others sit the
round out (no steps, weight 0 in the average). Each client keeps its own optimizer state
across rounds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ...comm.collectives import Communicator
from ...data.sampler import GlobalOrderSampler
from ...names import SYNC_FEDAVG
from .modes import PeriodicSync
from .vectors import weighted_average


def client_partition(num_samples: int, client: int, clients: int) -> range:
    """Client ``client``'s dataset indices: a contiguous range, disjoint from the other
    clients', together covering ``range(num_samples)``."""
    if not 0 <= client < clients:
        raise ValueError(f"client={client} is outside 0..{clients - 1}")
    return range(client * num_samples // clients, (client + 1) * num_samples // clients)


def choose_clients(seed: int, round_index: int, clients: int, fraction: float) -> list[int]:
    """The clients training in round ``round_index`` (sorted); the same on every rank."""
    count = min(clients, max(1, round(fraction * clients)))
    digest = hashlib.sha256(f"disttrain-fedavg:{seed}:{round_index}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return sorted(torch.randperm(clients, generator=gen)[:count].tolist())


class FedAvg(PeriodicSync):
    """One client per dp rank; a sample-weighted average every ``every`` steps."""

    name = SYNC_FEDAVG
    def __init__(self, model: nn.Module, comm: Communicator, *, num_samples: int,
                 every: int, fraction: float, seed: int) -> None:
        super().__init__(model, comm, every)
        self.fraction, self.seed = fraction, seed
        self.client, self.clients = comm.rank, comm.size
        self.partition = client_partition(num_samples, self.client, self.clients)
        if len(self.partition) == 0:
            raise ValueError(f"client {self.client} of {self.clients} gets no samples "
                             f"from a dataset of {num_samples}")
        self.order = GlobalOrderSampler(len(self.partition), seed + 1 + self.client)
        self.local_position = 0   # next position in this client's own order
        self.round_samples = 0    # samples this client trained on in the current round
        self.samples_used = 0

    def chosen(self, step: int) -> list[int]:
        return choose_clients(self.seed, step // self.every, self.clients, self.fraction)

    def select(self, step: int, indices: list[int]) -> list[int] | None:
        """``len(indices)`` samples of this client's partition, or None when it sits
        this round out."""
        if self.client not in self.chosen(step):
            return None
        local = self.order.indices(self.local_position, len(indices))
        self.local_position += len(indices)
        self.round_samples += len(local)
        return [self.partition[i] for i in local]

    def _round(self) -> None:
        weighted_average(self.comm, self.params, float(self.round_samples))
        self.samples_used += self.round_samples
        self.round_samples = 0

    def metrics(self) -> dict[str, Any]:
        return {**super().metrics(),
                "fed_clients_per_round": len(self.chosen(0)),
                "fed_client0_samples": self.samples_used}
