"""The `glm5` command. Importing it sets the process's gRPC defaults, before anything imports grpc, and keeps a known
library report out of its exits (glm5.exit_report)."""

from glm5.exit_report import drop_nanobind_leak_report
from glm5.grpc_env import default_grpc_experiments

default_grpc_experiments()
drop_nanobind_leak_report()
