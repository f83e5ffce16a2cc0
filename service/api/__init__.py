"""The rollout service: engine loop, gRPC and HTTP APIs, weight pushes, metrics."""
