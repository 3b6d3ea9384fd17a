"""Kubernetes operator for DisaggregatedModel: builds prefill, decode and router workloads from one object."""
