"""A small local stand-in for Envoy Gateway, for running the stack on one machine.

It is not a product and not a general proxy: it does exactly what this project's Gateway does
with two listeners, so the local stack behaves like the cluster:

- `http` (8080): the baseline HTTPRoute. Envoy's default LeastRequest balancing (two random
  choices over in-flight counts), optionally over weighted backend groups (stable / canary
  Services with HTTPRoute backendRef weights).
- `llm-gw` (8081): the route with the EnvoyExtensionPolicy. Every request first runs the Envoy
  ext_proc exchange with the picker (BUFFERED or FULL_DUPLEX_STREAMED request bodies), applies
  its header/body mutations and immediate responses, and goes to the endpoint in
  `x-gateway-destination-endpoint` (BackendTrafficPolicy endpointOverride); least request is the
  fallback. Picker unreachable: 503 (FailClose) or least request (FailOpen).

Run: `python -m local.gateway --endpoints 127.0.0.1:8101,127.0.0.1:8102 --picker 127.0.0.1:9002`.
"""

from .balancer import Endpoint, LeastRequest, Route
from .server import Gateway, GatewayConfig

__all__ = ["Endpoint", "Gateway", "GatewayConfig", "LeastRequest", "Route"]
