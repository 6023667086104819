"""Shared RL pieces: rollout records, the rollout buffer, sample filtering (gateway and trainer)."""
