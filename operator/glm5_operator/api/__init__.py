"""The custom resources' API: spec models (the single source of the CRD schema) and semantic validation."""

from glm5_operator.api.base import API_VERSION, GROUP, VERSION
from glm5_operator.api.deployment import GLM5DeploymentSpec
from glm5_operator.api.rljob import RLJobSpec
from glm5_operator.api.validation import InvalidSpec, parse_deployment, parse_rljob

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "GLM5DeploymentSpec",
    "InvalidSpec",
    "RLJobSpec",
    "parse_deployment",
    "parse_rljob",
]
