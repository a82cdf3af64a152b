"""Fault tolerance between data-parallel replica groups, on torchft
(``parallel.fault_tolerance = "replica"``): see :mod:`.replicas` for the step's
semantics and :mod:`disttrain.launch.replicas` for how the groups are started."""
