"""The layout's parallel dimensions, declared once: the list every layer reads.

A dimension splits the world of ranks one way (dp, pp, tp). Each is one
:class:`Dimension` in :data:`DIMENSIONS`, in the order its config key is declared and
recorded (``parallel.dp``, ``parallel.pp``, ``parallel.tp``; a checkpoint's ``layout``):

- ``key``: its field in the ``[parallel]`` section (``config_key``: ``parallel.<key>``);
  its degree; ``derived``: 0 there means the ranks the other dimensions leave;
- ``axis`` and ``rank_order``: its named axis of the ``DeviceMesh`` and where that axis
  sits, outermost (0) first; global ranks are numbered row-major over that shape;
- ``roles``: what it does to a training step, which is all that the code above reads:
  :data:`Role.SAMPLES` splits each global batch's samples over its ranks;
  :data:`Role.REPLICAS` gives its ranks the same parameters, whose gradients are summed,
  and which ZeRO shards, over the flattened group of every such dimension (the data-
  parallel strategy ``parallel.strategy`` names runs over that group);
  :data:`Role.TENSORS` cuts parameter tensors into boxes, one per rank (the Placement's
  sharding group: what is identical there is written once); :data:`Role.LAYERS` cuts the
  model's layers into stages, each rank running its own;
- ``own_streams``: its ranks draw distinct random streams (dropout masks), so a rank's
  stream is keyed by its coordinate on every such axis;
- ``home``: the package that holds its code (what it applies to a model, its checks
  against the config, the model's spec and the world, how the planner prices it), and
  ``plan_position`` / ``plan_options``: where its degree and its own search keys sit in a
  planned layout's label (``tp=2,pp=2,dp=2,v=2,mbs=..``).

The declaration is pure data, so ``config`` (the layout's arithmetic), ``parallel``
(topology, composition, placement), ``train`` and ``plan`` all import it. What each entry
does lives in its home and is attached to the entry there:
:mod:`disttrain.parallel.dimensions` maps every entry to its behaviour (apply, check,
pricing) and refuses an entry without one. Nothing outside the registry and a dimension's
own home names a dimension; ``tests/test_dimensions.py`` holds ``compose.py``,
``placement.py``, ``topology.py``, ``train/`` and ``plan/`` to it.

**Adding a dimension** (``docs/architecture.md`` lists every step): its entry here, its
field in :class:`~disttrain.config.schema.ParallelConfig`, its home package with a
behaviour attached in :mod:`disttrain.parallel.dimensions`, its tests.

**Context parallelism** (``cp``: each sample's sequence split over N ranks, attention as
a ring) would be declared, field by field:

- ``key="cp"``, ``axis="cp"``, ``derived=False`` (``ParallelConfig.cp``, default 1);
- ``rank_order=2`` and tp's becomes 3: the mesh ``pp, dp, cp, tp``, so a ring's
  neighbours are tp groups apart, and the composition, which applies the in-place parts
  innermost axis first, applies tp, then cp (before activation checkpointing and the
  pipeline's cut): cp composes with tp and pp by construction;
- ``plan_position=25`` (its degree between pp's and dp's in a planned layout's label);
- ``roles={Role.REPLICAS, Role.TOKENS}``, the second a new role: its ranks split each
  sample's tokens. With ``REPLICAS`` its ranks hold the same parameters, so the replica
  group (``Groups.replicas``, ``Topology.role_group``) becomes the flattened dp x cp:
  the data-parallel strategy reduces the gradients and ZeRO shards over it, and a step's
  held-out totals are summed over it, with no other change. Not ``SAMPLES``: the global
  batch is still split over dp only (``BatchPlan.shares``, the data cursor), every cp
  rank of a replica taking the same samples. A role beyond ``SAMPLES`` and ``REPLICAS``
  makes it ``changes_model``: the apart sync modes and dynamic balancing refuse it, and
  the gradients go through the model-parallel side (the global norm over the world);
- ``own_streams=True``: its ranks hold different tokens, so different dropout masks;
- ``home="disttrain.parallel.context"``, whose behaviour is: ``apply`` returning an
  ``AppliedDimension`` that swaps the model's attention for the ring (through the
  model's pluggable attention and ``position_ids``), ``counts_loss`` True on every rank
  (each counts its own tokens: the global token count stays a sum over the world),
  ``activation_length`` T / N (what a pipeline's stages exchange) and, a method the
  protocol gains with cp (the identity by default, so no other part changes),
  ``local_batch``: this rank's chunks i and 2N-1-i of every micro-batch and their
  global positions, which the step passes call; ``check``: a sequence not divisible by
  2N, a model whose attention is not recognised, sequence parallelism where the two
  cannot combine (one line, the fix); ``pricing``: candidates (the divisors of the ranks
  tp leaves), its rule (2N divides the sequence), its messages per layer (N - 1 blocks
  of keys and values around the ring forward, twice that backward, priced as
  point-to-point messages) and what it divides (every activation and the attention's
  work by N), which the planner reads through the new role as it reads the tensor and
  layer roles today.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass


class Role(enum.Enum):
    """What a dimension does to a training step (see the module docstring)."""

    SAMPLES = "samples"
    REPLICAS = "replicas"
    TENSORS = "tensors"
    LAYERS = "layers"


@dataclass(frozen=True, kw_only=True)
class PlanOption:
    """A search key of the planner that belongs to one dimension (the pipeline's chunks
    per rank ``v``). ``position``: its place in a planned layout's label among every
    key (dimensions' degrees, these, and the planner's own ``mbs``, ``zero``,
    ``recompute``); ``always_shown``: in the label even at ``default``; ``flag``: a
    yes / no choice (written 0 / 1)."""

    name: str
    default: int
    position: int
    always_shown: bool = True
    flag: bool = False


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One parallel dimension of the layout (see the module docstring for each field)."""

    key: str
    axis: str
    rank_order: int
    plan_position: int
    roles: frozenset[Role]
    own_streams: bool
    home: str
    derived: bool = False
    plan_options: tuple[PlanOption, ...] = ()

    @property
    def config_key(self) -> str:
        """Its field as the user writes it: ``parallel.<key>``."""
        return f"parallel.{self.key}"

    def has(self, role: Role) -> bool:
        return role in self.roles

    @property
    def changes_model(self) -> bool:
        """Whether it changes the model a replica runs (a role beyond splitting the
        samples and holding replicas: it shards, cuts, ...)."""
        return bool(self.roles - {Role.SAMPLES, Role.REPLICAS})


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(key="dp", axis="dp", rank_order=1, plan_position=30, derived=True,
              roles=frozenset({Role.SAMPLES, Role.REPLICAS}), own_streams=True,
              home="disttrain.parallel.data"),
    # v: model chunks per pipeline rank (> 1: the interleaved schedule); gpipe: GPipe's
    Dimension(key="pp", axis="pp", rank_order=0, plan_position=20,
              roles=frozenset({Role.LAYERS}), own_streams=True,
              home="disttrain.parallel.pipeline",
              plan_options=(PlanOption(name="v", default=1, position=40),
                            PlanOption(name="gpipe", default=0, position=90,
                                       always_shown=False, flag=True))),
    # sp: sequence parallelism
    Dimension(key="tp", axis="tp", rank_order=2, plan_position=10,
              roles=frozenset({Role.TENSORS}), own_streams=False,
              home="disttrain.parallel.tensor",
              plan_options=(PlanOption(name="sp", default=0, position=80, flag=True),)),
)


def dimension(key: str) -> Dimension:
    """The entry whose config key is ``key`` (a dimension's own code finds itself so)."""
    for d in DIMENSIONS:
        if d.key == key:
            return d
    raise KeyError(f"no parallel dimension {key!r}; the dimensions are "
                   f"{', '.join(d.key for d in DIMENSIONS)}")


@functools.cache
def mesh_order() -> tuple[Dimension, ...]:
    """The entries in rank order, outermost first: the mesh's axes."""
    return tuple(sorted(DIMENSIONS, key=lambda d: d.rank_order))


@functools.cache
def plan_order() -> tuple[Dimension, ...]:
    """The entries in the order of a planned layout's label."""
    return tuple(sorted(DIMENSIONS, key=lambda d: d.plan_position))


@functools.cache
def with_role(role: Role) -> tuple[Dimension, ...]:
    """The entries that take ``role``, in rank order."""
    return tuple(d for d in mesh_order() if d.has(role))


def derived_dimension() -> Dimension:
    """The entry whose degree the others' leave (exactly one is declared so)."""
    found = [d for d in DIMENSIONS if d.derived]
    if len(found) != 1:
        raise RuntimeError(f"exactly one dimension must be derived, found {len(found)}")
    return found[0]


def joined(dims: Iterable[Dimension], sep: str = " x ") -> str:
    """Their keys joined, for a message: ``pp x tp``."""
    return sep.join(d.key for d in dims)


def spoken(dims: Iterable[Dimension]) -> str:
    """Their keys as a list in words: ``pp``, ``pp and tp``, ``pp, cp and tp``."""
    keys = [d.key for d in dims]
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"
