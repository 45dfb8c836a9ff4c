"""The adapters: Envoy's protocols (ext_authz Check, the gRPC access log) <-> the runtime's types,
the admin HTTP server, how outcomes look over HTTP, and the upstream's HTTP API. No decisions here.

They import the Envoy contract (`llamaswap.envoy.contract`), never the bootstrap builder.
"""
