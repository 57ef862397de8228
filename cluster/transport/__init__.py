from cluster.transport.base import KVArrival, KVTransport, TransferStats
from cluster.transport.factory import TransportSpec, create_transport

__all__ = ["KVArrival", "KVTransport", "TransferStats", "TransportSpec", "create_transport"]
