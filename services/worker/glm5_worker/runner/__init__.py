"""What every rank of a replica runs (ModelRunner, compiled steps, weights, the step thread); rank 0's engine
sits above it, the replica's collectives (glm5_worker.parallel) between the two."""
