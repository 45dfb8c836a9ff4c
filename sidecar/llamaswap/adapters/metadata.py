"""Reading Envoy's dynamic metadata: one value of one filter's namespace, if it is there."""

from __future__ import annotations

from google.protobuf import struct_pb2

from llamaswap._proto.envoy.config.core.v3 import base_pb2


def metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    """`metadata.filter_metadata[namespace][key]`, without creating either on the way (protobuf
    maps create a missing entry when indexed)."""
    filter_metadata = metadata.filter_metadata
    if namespace not in filter_metadata:
        return None
    fields = filter_metadata[namespace].fields
    return fields[key] if key in fields else None
