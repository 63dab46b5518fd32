"""Protocol: the Envoy ext_proc stream, gRPC health, TLS."""
