"""The cluster on one machine: the vLLM simulator (`local.sim`), the real data plane (`local.dataplane`: Envoy Gateway standalone + Envoy), the launcher (`local.stack`)."""
