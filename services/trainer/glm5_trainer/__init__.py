"""The RL trainer: losses, stability guards, weight versions (the training loop builds on these)."""
