"""The token-in-token-out (TITO) gateway for RL rollouts."""
