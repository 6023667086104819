"""Conventions shared by the custom resources' models: camelCase on the wire, unknown fields rejected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GROUP = "glm5.ai"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class Spec(BaseModel):
    """Base of every spec model. The same model validates in the operator and emits the CRD schema."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
