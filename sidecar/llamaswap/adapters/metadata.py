"""Reading Envoy's dynamic metadata: one filter's namespace, if it is there."""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import struct_pb2

from llamaswap._proto.envoy.config.core.v3 import base_pb2

# A namespace's fields: a protobuf map of JSON values.
Fields = Mapping[str, struct_pb2.Value]


def namespace_fields(metadata: base_pb2.Metadata, namespace: str) -> Fields | None:
    """`metadata.filter_metadata[namespace].fields`, without creating the namespace (protobuf
    maps create a missing entry when indexed); found once, it serves every key read from it."""
    filter_metadata = metadata.filter_metadata
    return filter_metadata[namespace].fields if namespace in filter_metadata else None

