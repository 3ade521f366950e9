"""LUMEN's gRPC control plane (lumen.proto, package lumen.v1).

The generated modules (lumen_pb2*, from `make proto`) are used only inside this package;
everything else talks through the typed wrappers: `client` (Coordinator and Agent clients),
`server` (the node's gRPC server), `agent_service`, `progress` and `tls`.
"""
