"""Local stand-ins for the cluster: the vLLM simulator (`local.sim`), the local gateway, the launcher."""
