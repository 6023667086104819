"""Paged KV-cache storage shared by the worker (serving) and the trainer."""
