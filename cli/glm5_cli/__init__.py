"""The `glm5` command. Importing it sets the process's gRPC defaults, before anything imports grpc."""

from glm5.grpc_env import default_grpc_experiments

default_grpc_experiments()
