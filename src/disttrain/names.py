"""Names two modules must agree on, defined once."""

SYNC_EVERY_STEP = "every_step"
