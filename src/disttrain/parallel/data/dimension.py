"""dp's behaviour: nothing applied to the model (the data-parallel strategy runs over
the replica group), no check of its own beyond the layout's arithmetic and the checks
of the strategy, sync mode and optimizer the config selects
(:func:`disttrain.parallel.registry.check_selected`)."""

from __future__ import annotations

from ...dimensions import dimension

ENTRY = dimension("dp")
