"""Offline validation of the rendered manifests (`python -m validation`).

Renders every overlay, base and Argo CD app path with `kubectl kustomize`, validates built-in kinds
against the Kubernetes JSON schemas (strict), custom resources against the pinned CRDs (defaults,
CEL rules), runs kubeconform over the same output, and checks the GitHub workflow files.
"""
