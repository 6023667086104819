"""One model replica over several ranks (tensor + expert parallelism): process groups, rank 0's driver and the
followers' loop. A single-device worker uses none of it."""
