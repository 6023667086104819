"""The router's view of its workers: discovery, health, load, circuit breakers, picking one."""
