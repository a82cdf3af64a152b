"""The layout's parallel dimensions, declared once: the list every layer reads.

A dimension splits the world of ranks one way (dp, pp, tp, cp). Each is one
:class:`Dimension` in :data:`DIMENSIONS`, in the order its config key is declared and
recorded (``parallel.dp``, ``parallel.pp``, ``parallel.tp``, ``parallel.cp``; a
checkpoint's ``layout``):

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
  model's layers into stages, each rank running its own; :data:`Role.TOKENS` splits
  each sample's sequence over its ranks, each running the whole model on its part;
- ``own_streams``: its ranks draw distinct random streams (dropout masks), so a rank's
  stream is keyed by its coordinate on every such axis;
- ``home``: the package that holds its code (what it applies to a model, its checks
  against the config, the model's spec and the world, how the planner prices it), and
  ``plan_position`` / ``plan_options``: where its degree and its own search keys sit in a
  planned layout's label (``tp=2,pp=2,cp=1,dp=2,v=2,mbs=..``).

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
a ring) is declared so, field by field:

- ``key="cp"``, ``axis="cp"`` (``ParallelConfig.cp``, default 1);
- ``rank_order=2`` (tp's is 3): the mesh ``pp, dp, cp, tp``, so a ring's neighbours are
  tp groups apart; the composition applies the in-place parts innermost axis first (tp,
  then cp), then activation checkpointing and the pipeline's cut;
- ``plan_position=25``: its degree between pp's and dp's in a planned layout's label;
- ``roles={Role.REPLICAS, Role.TOKENS}``: with ``REPLICAS`` its ranks hold the same
  parameters, so the replica group is the flattened dp x cp (the data-parallel strategy
  reduces the gradients and ZeRO shards over it; a step's held-out totals are summed
  over it); ``TOKENS`` splits each sample's tokens over its ranks. Not ``SAMPLES``: the
  global batch is split over dp only, every cp rank of a replica taking the same
  samples. ``TOKENS`` makes it ``changes_model``: the apart sync modes and dynamic
  balancing refuse it, and the gradients go through the model-parallel side;
- ``own_streams=True``: its ranks hold different tokens, so draw different masks;
- ``home="disttrain.parallel.context"``.
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
    TOKENS = "tokens"


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
    Dimension(key="tp", axis="tp", rank_order=3, plan_position=10,
              roles=frozenset({Role.TENSORS}), own_streams=False,
              home="disttrain.parallel.tensor",
              plan_options=(PlanOption(name="sp", default=0, position=80, flag=True),)),
    Dimension(key="cp", axis="cp", rank_order=2, plan_position=25,
              roles=frozenset({Role.REPLICAS, Role.TOKENS}), own_streams=True,
              home="disttrain.parallel.context"),
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
