"""One candidate the planner prices: a :class:`PlannedLayout`.

It holds more than the mesh (:class:`disttrain.config.layout.Layout`: a degree per
declared dimension, and zero): also how each step runs on it. A degree per dimension
(:data:`disttrain.dimensions.DIMENSIONS`, ranks ordered as disttrain's mesh), each
dimension's own search keys (``PlanOption``: the pipeline's chunks per rank ``v`` and
its GPipe schedule, tensor parallelism's sequence parallelism ``sp``), and the planner's
own: the micro-batch size ``mbs``, the ZeRO stage over the replica group, activation
recomputation (none, selective: attention's scores only, full: everything but each
layer's input). The degrees of the roles (:data:`~disttrain.dimensions.Role`) are what
the cost model reads: the tensor shards, the stages, the replicas, the sample split,
the token split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dimensions import DIMENSIONS, PlanOption, Role, derived_dimension, with_role

RECOMPUTE = ("none", "selective", "full")
OPTIONS: tuple[PlanOption, ...] = tuple(o for d in DIMENSIONS for o in d.plan_options)
# the planner's own keys' places among every key of a label (PlanOption.position)
_MBS, _ZERO, _RECOMPUTE = 50, 60, 70


@dataclass(frozen=True, init=False)
class PlannedLayout:
    """``PlannedLayout(tp=2, pp=2, dp=2, v=2, mbs=4, zero=1)``: degrees by dimension
    key (left out: 1), dimension options by name (left out: their default), and the
    planner's ``mbs``, ``zero``, ``recompute``."""

    degrees: tuple[int, ...]
    options: tuple[int, ...]
    mbs: int
    zero: int
    recompute: str

    def __init__(self, *, mbs: int = 1, zero: int = 0, recompute: str = "none",
                 **keys: int | bool) -> None:
        unknown = sorted(set(keys) - _KNOWN)
        if unknown:
            raise TypeError(f"PlannedLayout has no key {unknown}; the keys are "
                            f"{', '.join(sorted(_KNOWN))}, mbs, zero, recompute")
        self._set(tuple(int(keys.get(d.key, 1)) for d in DIMENSIONS),
                  tuple(int(keys.get(o.name, o.default)) for o in OPTIONS),
                  mbs, zero, recompute)

    @classmethod
    def of(cls, degrees: tuple[int, ...], options: tuple[int, ...], mbs: int, zero: int,
           recompute: str) -> PlannedLayout:
        """From the degrees (declaration order) and options (:data:`OPTIONS` order) as
        they are held (the search builds its candidates so)."""
        planned = cls.__new__(cls)
        planned._set(degrees, options, mbs, zero, recompute)
        return planned

    def _set(self, degrees: tuple[int, ...], options: tuple[int, ...], mbs: int,
             zero: int, recompute: str) -> None:
        for name, value in (("degrees", degrees), ("options", options), ("mbs", mbs),
                            ("zero", zero), ("recompute", recompute)):
            object.__setattr__(self, name, value)

    def degree(self, key: str) -> int:
        """The degree of the dimension whose config key is ``key``."""
        return self.degrees[_DEGREE_INDEX[key]]

    def option(self, name: str) -> int:
        """The value of the dimension option ``name``."""
        return self.options[_OPTION_INDEX[name]]

    def role(self, role: Role) -> int:
        """The product of the degrees of the dimensions that take ``role``."""
        return _product(self.degrees, _ROLE_INDICES[role])

    @property
    def ranks(self) -> int:
        return math.prod(self.degrees)

    @property
    def shards(self) -> int:
        """Ways each weight matrix is cut (the tensor-sharding dimensions)."""
        return _product(self.degrees, _TENSORS_AT)

    @property
    def stages(self) -> int:
        """Stages the layers are cut into."""
        return _product(self.degrees, _LAYERS_AT)

    @property
    def replicas(self) -> int:
        """Ranks of the replica group (gradients reduced, ZeRO sharded over it)."""
        return _product(self.degrees, _REPLICAS_AT)

    @property
    def token_split(self) -> int:
        """Ranks each sample's tokens are split over (each holding 1/this of them)."""
        return _product(self.degrees, _TOKENS_AT)

    def span(self, role: Role) -> int:
        """Consecutive devices a group of ``role`` spans: its degrees times those of the
        axes inside its outermost one."""
        outer = min(d.rank_order for d in with_role(role))
        return math.prod(self.degree(d.key) for d in DIMENSIONS if d.rank_order >= outer)

    def micro_batches(self, global_batch: int) -> int:
        """Per step and replica: the batch split over the sample-splitting ranks."""
        return global_batch // (_product(self.degrees, _SAMPLES_AT) * self.mbs)

    def items(self, *, shown: bool = False) -> list[tuple[str, int | str]]:
        """(key, value) of every key in label order (a flag as 0 / 1); ``shown``: only
        those always shown (the options shown only when set left out)."""
        keyed: list[tuple[int, str, int | str]] = [
            (d.plan_position, d.key, self.degree(d.key)) for d in DIMENSIONS]
        keyed += [(o.position, o.name, self.option(o.name)) for o in OPTIONS
                  if o.always_shown or not shown]
        keyed += [(_MBS, "mbs", self.mbs), (_ZERO, "zero", self.zero),
                  (_RECOMPUTE, "recompute", self.recompute)]
        return [(k, v) for _, k, v in sorted(keyed, key=lambda t: t[0])]

    def label(self) -> str:
        """``tp=2,pp=2,cp=1,dp=2,v=1,mbs=4,zero=1,recompute=none,sp=0``: every key always
        shown, and the others where they differ from their default."""
        hidden = {o.name: o.default for o in OPTIONS if not o.always_shown}
        return ",".join(f"{k}={v}" for k, v in self.items()
                        if k not in hidden or v != hidden[k])

    @classmethod
    def whole(cls, ranks: int, *, mbs: int = 1, zero: int = 0, recompute: str = "none"
              ) -> PlannedLayout:
        """Every one of ``ranks`` devices a replica (the derived dimension takes them
        all)."""
        return cls(mbs=mbs, zero=zero, recompute=recompute, **{derived_dimension().key: ranks})


def figure(role: Role, what: str) -> str:
    """The name of a figure of ``role``'s part of a step (``tp_comm``, ``pp_bubble``,
    ``dp_comm_exposed``): the key of the first declared dimension taking the role, then
    ``what``."""
    return f"{next(d for d in DIMENSIONS if d.has(role)).key}_{what}"


_DEGREE_INDEX = {d.key: i for i, d in enumerate(DIMENSIONS)}
_OPTION_INDEX = {o.name: i for i, o in enumerate(OPTIONS)}
_KNOWN = set(_DEGREE_INDEX) | set(_OPTION_INDEX)
_ROLE_INDICES = {r: tuple(_DEGREE_INDEX[d.key] for d in with_role(r)) for r in Role}
_TENSORS_AT, _LAYERS_AT = _ROLE_INDICES[Role.TENSORS], _ROLE_INDICES[Role.LAYERS]
_REPLICAS_AT, _SAMPLES_AT = _ROLE_INDICES[Role.REPLICAS], _ROLE_INDICES[Role.SAMPLES]
_TOKENS_AT = _ROLE_INDICES[Role.TOKENS]


def _product(values: tuple[int, ...], at: tuple[int, ...]) -> int:
    """The product of ``values`` at positions ``at`` (the cost model asks often)."""
    return values[at[0]] if len(at) == 1 else math.prod(values[i] for i in at)
