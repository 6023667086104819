"""Other projects' CRDs (vendored under tests/data/crds) as JSON Schemas, to check what the operator renders for
them (kubernetes-validate knows only Kubernetes' own kinds)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import yaml

CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"


def _to_jsonschema(node: Any) -> Any:
    """Kubernetes' structural-schema extensions dropped (x-kubernetes-int-or-string: an int or a string)."""
    if isinstance(node, dict):
        out = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
        return out
    if isinstance(node, list):
        return [_to_jsonschema(v) for v in node]
    return node


def crd_schema(file: str, version: str) -> dict[str, Any]:
    """The JSON Schema of `version` of the CRD in tests/data/crds/`file` (.gz: gzipped)."""
    path = CRDS / file
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    crd = yaml.safe_load(text)
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return dict(_to_jsonschema(found["schema"]["openAPIV3Schema"]))
