"""Queues, batching and dispatch of requests to workers."""
