"""Output lengths: what a request's answer will cost, learned online from what the deployment
answered (features.py: what a request shows; predictor.py: the learner; work.py: each endpoint's
predicted remaining work)."""
