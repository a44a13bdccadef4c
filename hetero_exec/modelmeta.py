"""get_modelmeta(): the model's metadata as onnxruntime's ModelMetadata reports it."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx


@dataclass(frozen=True)
class ModelMetadata:
    """>>> import onnx.helper as h
    >>> m = h.make_model(h.make_graph([], "g", [], []), producer_name="p", model_version=3)
    >>> meta = ModelMetadata.of(m)
    >>> (meta.producer_name, meta.graph_name, meta.version)
    ('p', 'g', 3)
    """

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    #: the model's model_version; onnxruntime reports INT64_MAX when the model sets none
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "ModelMetadata":
        return cls(producer_name=model.producer_name, graph_name=model.graph.name,
                   domain=model.domain, description=model.doc_string,
                   graph_description=model.graph.doc_string, version=_version(model),
                   custom_metadata_map={p.key: p.value for p in model.metadata_props})


#: what onnxruntime reports as the version of a model that sets no model_version
UNSET_VERSION = 2**63 - 1


def _version(model: onnx.ModelProto) -> int:
    """model_version when the model sets one (0 included), else UNSET_VERSION."""
    return int(model.model_version) if model.HasField("model_version") else UNSET_VERSION
