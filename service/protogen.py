"""The gRPC code of proto/ for the server: the same generated modules the client uses (client/protogen.py)."""

from client.protogen import pb2, pb2_grpc

__all__ = ["pb2", "pb2_grpc"]
