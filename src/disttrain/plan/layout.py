"""One candidate the planner prices: a :class:`PlannedLayout`.

It holds more than the mesh (:class:`disttrain.config.layout.Layout`: dp, pp, tp,
zero): also how each step runs on it. (tp, pp, dp, v, mbs, zero, recompute, sp):
tensor, pipeline and data parallel degrees (ranks ordered pp, dp, tp, outermost first,
as disttrain's mesh), v model chunks per pipeline rank (v > 1: the interleaved
schedule, else 1F1B, or GPipe with ``gpipe``), the micro-batch size, the ZeRO stage
over dp, activation recomputation (none, selective: attention's scores only, full:
everything but each layer's input) and sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class PlannedLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    v: int = 1
    mbs: int = 1
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    gpipe: bool = False  # v = 1 only: every forward before any backward

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        if self.v > 1:
            return "interleaved"
        return "gpipe" if self.gpipe else "1f1b"

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def label(self) -> str:
        return (f"tp={self.tp},pp={self.pp},dp={self.dp},v={self.v},mbs={self.mbs},"
                f"zero={self.zero},recompute={self.recompute},sp={int(self.sp)}"
                + (",gpipe=1" if self.gpipe else ""))
