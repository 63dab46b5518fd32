"""What several test folders share, in one importable place (never imported by file path):
`kube` (the control plane's binaries, polling, the HPA controller, the picker on Kubernetes
discovery) and `extproc_client` (speaks ext_proc to a picker as Envoy does)."""
